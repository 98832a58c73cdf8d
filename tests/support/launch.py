"""Running training as a real subprocess (`python`, `torchrun` or `accelerate launch` in front of train.py or a
test runner script), and the pieces every launch needs: a free rendezvous port and a clean environment."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from support.paths import PYTHON, REPO

TORCHRUN = str(Path(PYTHON).with_name("torchrun"))
ACCELERATE = str(Path(PYTHON).with_name("accelerate"))
TRAIN_SCRIPT = REPO / "train.py"
# Variables a launcher sets for its children; inherited from an outer launch they would confuse the inner one.
LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
# Exec the command with RLIMIT_FSIZE set: a write past the limit then fails with EFBIG ("File too large"), like a
# full disk, without root (Python ignores SIGXFSZ, so the write raises instead of killing the process).
LIMIT_FILE_SIZE = ("import os, resource, sys; n = int(sys.argv[1]); "
                   "resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])")


def free_port() -> int:
    """A port nobody listens on now (accelerate launch defaults to 29500, which a concurrent launch may hold), so
    concurrent distributed tests never share a rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def not_answering(process: subprocess.Popen, url: str, timeout_s: float) -> str | None:
    """Wait until `url` answers (a server `process` started); None once it does, else why not: the process exited,
    or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"exited with {process.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2):
                return None
        except OSError:
            time.sleep(0.3)
    return f"was not ready after {timeout_s} s"


def launch_env() -> dict[str, str]:
    """This environment less what an outer launcher set, single-threaded and unbuffered."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("ACCELERATE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return env


def torchrun(processes: int) -> list[str]:
    return [TORCHRUN, "--standalone", f"--nproc_per_node={processes}"]


def accelerate_deepspeed(processes: int, deepspeed_config: Path) -> list[str]:
    return [ACCELERATE, "launch", "--use_deepspeed", f"--num_processes={processes}",
            f"--main_process_port={free_port()}", f"--deepspeed_config_file={deepspeed_config}"]


def accelerate_fsdp2(processes: int) -> list[str]:
    """The documented FSDP2 launch (configs/accelerate/fsdp2_2proc.yaml) with `processes` processes."""
    return [ACCELERATE, "launch", "--config_file", str(REPO / "configs" / "accelerate" / "fsdp2_2proc.yaml"),
            f"--num_processes={processes}", f"--main_process_port={free_port()}"]


def limit_file_size(max_file_bytes: int) -> list[str]:
    """A prefix that runs the rest of the command with no file allowed to grow past `max_file_bytes`."""
    return [PYTHON, "-c", LIMIT_FILE_SIZE, str(max_file_bytes)]


def run_train(config: Path, output_dir: Path, *overrides: str, script: Path = TRAIN_SCRIPT,
              launcher: list[str] | None = None, prefix: list[str] | tuple[str, ...] = (), env: dict | None = None,
              timeout: int = 900) -> subprocess.CompletedProcess:
    """`PREFIX LAUNCHER SCRIPT --config CONFIG output_dir=... OVERRIDES` in a fresh process, from the repository
    root; the launcher is plain `python` unless given, and `prefix` a command that execs the rest (e.g. one that
    drops a capability or limits file sizes first)."""
    command = [*prefix, *(launcher or [PYTHON]), str(script), "--config", str(config), f"output_dir={output_dir}",
               *overrides]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"


def completed_run(config: Path, output_dir: Path, *overrides: str, **options) -> Path:
    """`run_train`, required to exit 0; its output_dir."""
    result = run_train(config, output_dir, *overrides, **options)
    assert result.returncode == 0, explain(result)
    return output_dir
