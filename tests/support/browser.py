"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: commands on fd 3,
replies and events on fd 4, NUL-separated JSON), with the standard library only. It gives what `--dump-dom` cannot:
every console error and uncaught exception, real mouse input, waiting on a condition in real time, and screenshots.

Debian's chromium is found on PATH; `chromium_path()` runs scripts/ensure_chromium.sh once when it is missing."""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from support.paths import REPO

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync", "--hide-scrollbars",
         "--remote-debugging-pipe"]
WIDTH, HEIGHT = 1280, 800


def chromium_path() -> Optional[str]:
    """Debian's chromium, installed by scripts/ensure_chromium.sh (root and the package mirror) when missing."""
    if not shutil.which("chromium"):
        subprocess.run(["bash", str(REPO / "scripts" / "ensure_chromium.sh")], capture_output=True, timeout=1200)
    return shutil.which("chromium")


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with one page. `errors` collects console errors and uncaught exceptions as text."""

    def __init__(self, executable: str, width: int = WIDTH, height: int = HEIGHT, extra_flags: tuple = ()):
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        # The shell moves the pipes to fds 3 and 4, where --remote-debugging-pipe expects them.
        self.process = subprocess.Popen(
            ["sh", "-c", 'exec "$0" "$@" 3<&0 4>&1 0</dev/null 1>/dev/null', executable, *FLAGS, *extra_flags,
             f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._write, self._read = self.process.stdin.fileno(), self.process.stdout.fileno()
        self._buffer = b""
        self._next_id = 0
        self.errors: list[str] = []
        self.events: list[dict] = []
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            for domain in ("Page", "Runtime", "Log"):
                self.page(f"{domain}.enable")
            self.page("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                      mobile=False)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ the protocol

    def _message(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise BrowserError(f"no message from chromium within {timeout} s")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise BrowserError("chromium closed its pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message = json.loads(raw)
        if "method" in message:
            self._event(message)
        return message

    def _event(self, message: dict) -> None:
        self.events.append(message)
        params = message.get("params", {})
        if message["method"] == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append(details.get("exception", {}).get("description") or details.get("text", ""))
        elif message["method"] == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif message["method"] == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.errors.append(params["entry"].get("text", ""))

    def call(self, method: str, session: str | None = None, timeout: float = 120.0, **params) -> dict:
        self._next_id += 1
        request = {"id": self._next_id, "method": method, "params": params}
        if session:
            request["sessionId"] = session
        os.write(self._write, json.dumps(request).encode() + b"\0")
        while True:
            message = self._message(timeout)
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})

    def page(self, method: str, timeout: float = 120.0, **params) -> dict:
        return self.call(method, session=self.session, timeout=timeout, **params)

    # ------------------------------------------------------------ what tests and benchmarks do

    def open(self, path: Path | str, fragment: str = "", timeout: float = 180.0) -> float:
        """Navigate to a file (or a URL) and wait for the load event; returns the seconds from navigation to load.
        `errors` starts empty for each page."""
        url = str(path) if "://" in str(path) else Path(path).resolve().as_uri()
        # Through a blank page: a new fragment on the same file would otherwise only scroll, not load.
        self._navigate("about:blank", timeout)
        self.errors.clear()
        started = time.perf_counter()
        self._navigate(url + fragment, timeout)
        return time.perf_counter() - started

    def _navigate(self, url: str, timeout: float) -> None:
        self.events.clear()
        self.page("Page.navigate", url=url)
        deadline = time.perf_counter() + timeout
        while not any(e["method"] == "Page.loadEventFired" for e in self.events):
            self._message(max(deadline - time.perf_counter(), 0.01))

    def evaluate(self, expression: str, timeout: float = 120.0) -> Any:
        """The value of a JavaScript expression (a promise is awaited)."""
        result = self.page("Runtime.evaluate", timeout=timeout, expression=expression, awaitPromise=True,
                           returnByValue=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise BrowserError(details.get("exception", {}).get("description") or details.get("text"))
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 120.0) -> float:
        """Poll until `expression` is truthy; returns the seconds waited."""
        started = time.perf_counter()
        while not self.evaluate(expression):
            if time.perf_counter() - started > timeout:
                raise BrowserError(f"still false after {timeout} s: {expression}")
            time.sleep(0.02)
        return time.perf_counter() - started

    def next_frame(self) -> None:
        """Return once the page has painted a frame after everything queued so far."""
        self.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")

    def mouse(self, kind: str, x: float, y: float, **params) -> None:
        """A real input event: kind is mousePressed, mouseMoved, mouseReleased or mouseWheel."""
        self.page("Input.dispatchMouseEvent", type=kind, x=x, y=y, **params)

    def click(self, x: float, y: float) -> None:
        self.mouse("mousePressed", x, y, button="left", clickCount=1)
        self.mouse("mouseReleased", x, y, button="left", clickCount=1)

    def downloads_to(self, folder: Path) -> None:
        """Files the page downloads land in `folder`, under their suggested names."""
        self.call("Browser.setDownloadBehavior", behavior="allow", downloadPath=str(folder))

    def center_of(self, selector: str) -> tuple[float, float]:
        box = self.evaluate(f"(r => [r.left + r.width / 2, r.top + r.height / 2])"
                            f"(document.querySelector({json.dumps(selector)}).getBoundingClientRect())")
        return box[0], box[1]

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (BrowserError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdin.close()
        self.process.stdout.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
