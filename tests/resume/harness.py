"""Helpers of the resume tests: training as a real subprocess that can be stopped at a chosen point, and a local
Hub."""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from support.launch import TRAIN_SCRIPT, accelerate_deepspeed, accelerate_fsdp2, limit_file_size, torchrun
from support.launch import run_train as run_script
from support.paths import REPO

RUNNER = Path(__file__).with_name("crash_runner.py")
ZERO2 = REPO / "configs" / "deepspeed" / "ds_config.json"
TOTAL_STEPS = 30  # 43 training examples // batch 4 = 10 steps per epoch, x 3 epochs


def run_train(config: Path, output_dir: Path, *overrides: str, crash: str | None = None, env: dict | None = None,
              max_file_bytes: int | None = None, processes: int = 1, deepspeed: bool = False, fsdp: bool = False,
              timeout: int = 900) -> subprocess.CompletedProcess:
    """`train.py --config CONFIG output_dir=... OVERRIDES` in a fresh process (through crash_runner.py when
    `crash` names a stop point; under torchrun when `processes` > 1, or accelerate launch with DeepSpeed ZeRO-2 or
    FSDP2; with no file larger than `max_file_bytes`)."""
    launcher = torchrun(processes) if processes > 1 else None
    if deepspeed:
        launcher = accelerate_deepspeed(processes, ZERO2)
    if fsdp:
        launcher = accelerate_fsdp2(processes)
    env = {**(env or {}), "CRASH_AT": crash} if crash else env
    return run_script(config, output_dir, *overrides, script=RUNNER if crash else TRAIN_SCRIPT, launcher=launcher,
                      prefix=limit_file_size(max_file_bytes) if max_file_bytes else (), env=env, timeout=timeout)


# ---------------------------------------------------------------- a local Hub

class HubServer:
    """A real HTTP server on 127.0.0.1 standing in for the Hub; it records every request.

    With `fail_with` it answers that HTTP status to everything. Otherwise it implements what `create_repo` and
    `upload_folder` call (repo creation, preupload, a commit with inline base64 files) and stores the committed
    files under `store`.
    """

    def __init__(self, fail_with: int | None = None, store: Path | None = None):
        self.fail_with, self.store, self.requests = fail_with, store, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                server.requests.append({"method": self.command, "path": self.path, "headers": headers,
                                        "body": body})
                status, answer = server.answer(self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def answer(self, path: str, body: bytes) -> tuple[int, dict]:
        import base64

        path = path.split("?")[0]
        if self.fail_with:
            return self.fail_with, {"error": "this server always fails"}
        if path == "/api/repos/create":
            request = json.loads(body)
            return 200, {"url": f"{self.url}/{request['organization']}/{request['name']}"}
        if "/preupload/" in path:
            files = json.loads(body)["files"]
            return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                   for f in files]}
        if "/commit/" in path:
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    target = self.store / item["value"]["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(base64.b64decode(item["value"]["content"]))
                elif item["key"] != "header":
                    return 400, {"error": f"unsupported commit operation {item['key']}"}
            repo = path.split("/api/models/")[1].split("/commit/")[0]
            return 200, {"commitUrl": f"{self.url}/{repo}/commit/{'1' * 40}", "commitOid": "1" * 40}
        return 404, {"error": f"not implemented here: {path}"}

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def hub_env(server: HubServer, token: str) -> dict[str, str]:
    """Online, against the local server, with a token from the standard environment variable."""
    return {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_TOKEN": token,
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1",
            # Without it huggingface_hub also fetches an "agent harnesses" registry for its user-agent string.
            "HF_HUB_DISABLE_TELEMETRY": "1"}
