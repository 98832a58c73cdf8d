"""Helpers of the resume tests: running training as a real subprocess, and comparing two runs exactly."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from conftest import PYTHON, REPO
from safetensors.torch import load_file

RUNNER = Path(__file__).with_name("crash_runner.py")
TORCHRUN = str(Path(PYTHON).parent / "torchrun")
ACCELERATE = str(Path(PYTHON).parent / "accelerate")
ZERO2 = REPO / "configs" / "deepspeed" / "ds_config.json"


# Exec the command with RLIMIT_FSIZE set: a write past the limit then fails with EFBIG ("File too large"), like a
# full disk, without root (Python ignores SIGXFSZ, so the write raises instead of killing the process).
LIMIT_FILE_SIZE = ("import os, resource, sys; n = int(sys.argv[1]); "
                   "resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])")


def run_train(config: Path, output_dir: Path, *overrides: str, crash: str | None = None, env: dict | None = None,
              max_file_bytes: int | None = None, processes: int = 1, deepspeed: bool = False,
              timeout: int = 900) -> subprocess.CompletedProcess:
    """`train.py --config CONFIG output_dir=... OVERRIDES` in a fresh process (through crash_runner.py when
    `crash` names a stop point; under torchrun when `processes` > 1, or accelerate launch with DeepSpeed ZeRO-2;
    with no file larger than `max_file_bytes`)."""
    script = str(RUNNER if crash else REPO / "train.py")
    launcher = [TORCHRUN, "--standalone", f"--nproc_per_node={processes}"] if processes > 1 else [PYTHON]
    if deepspeed:
        launcher = [ACCELERATE, "launch", "--use_deepspeed", f"--num_processes={processes}",
                    f"--main_process_port={free_port()}", f"--deepspeed_config_file={ZERO2}"]
    if max_file_bytes:
        launcher = [PYTHON, "-c", LIMIT_FILE_SIZE, str(max_file_bytes), *launcher]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    if crash:
        full_env["CRASH_AT"] = crash
    return subprocess.run([*launcher, script, "--config", str(config), f"output_dir={output_dir}", *overrides],
                          cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    """A port nobody listens on now (accelerate launch defaults to 29500, which a concurrent launch may hold)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def exact_rows(output_dir: Path) -> list[dict]:
    """Every logged row, less what measures the machine rather than the training (speeds and memory peaks):
    the losses, lr, gradient norms, token counts and validation results a resumed run must repeat bit for bit."""
    return [{k: v for k, v in row.items() if not (k.endswith("_per_s") or k.startswith("peak_"))}
            for row in metrics(output_dir)]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def max_weight_difference(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def assert_bitwise_equal_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    unequal = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not unequal, f"{len(unequal)} tensors differ, e.g. {unequal[0]}: max {max_weight_difference(a, b)}"


def assert_steps_monotone(output_dir: Path, total_steps: int) -> None:
    """Training rows for steps 1..total exactly once each, in order (no duplicates, no gaps)."""
    steps = [row["step"] for row in metrics(output_dir) if "loss" in row]
    assert steps == list(range(1, total_steps + 1))


def assert_same_run(output_dir: Path, reference: Path, total_steps: int) -> None:
    assert_steps_monotone(output_dir, total_steps)
    assert exact_rows(output_dir) == exact_rows(reference)
    assert_bitwise_equal_weights(output_dir / "final", reference / "final")


def step_dirs(output_dir: Path) -> list[str]:
    return sorted((p.name for p in output_dir.iterdir() if p.name.startswith("step_")),
                  key=lambda name: int(name.split("_")[1].split(".")[0]))


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
