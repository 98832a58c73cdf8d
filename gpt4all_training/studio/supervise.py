"""`python -m gpt4all_training.studio.supervise OUTPUT_DIR LAUNCHER -- COMMAND ...`: what the studio starts for a run.

It runs the training command (the CLI, under `python` or `accelerate launch`) with its output in OUTPUT_DIR/train.log,
and when the command ends writes its exit code to OUTPUT_DIR/studio_exit.json: so a run's outcome is on disk even
when the studio that started it was stopped or killed meanwhile (the studio starts this in a session of its own, so
the run outlives it).

SIGTERM or SIGINT sent to this process is forwarded, once, to the training processes themselves: the one process of
a plain launch, or the worker processes of an `accelerate launch` (the launcher would otherwise signal them a second
time, or kill them 5 s later, and a second signal stops a run without its checkpoint). Each then finishes its step,
writes a checkpoint and exits (training/stop.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from gpt4all_training.files import atomic_write
from gpt4all_training.run_folder import EXIT_FILE, LOG_FILE

LAUNCHERS = ("python", "accelerate")


def training_processes(child: subprocess.Popen, launcher: str) -> list[psutil.Process]:
    """The processes that run the training loop: the child itself, or an accelerate launcher's workers (the child
    while it has started none)."""
    try:
        process = psutil.Process(child.pid)
        workers = process.children() if launcher == "accelerate" else []
    except psutil.NoSuchProcess:
        return []
    return workers or [process]


def write_exit(output_dir: Path, code: int, stop_signal: str | None) -> None:
    atomic_write(output_dir / EXIT_FILE,
                 json.dumps({"exit_code": code, "stop_signal": stop_signal, "ended": time.time()}))


def supervise(output_dir: Path, launcher: str, command: list[str]) -> int:
    received: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum, _frame) -> None:
        if received:  # forwarded once already; a second signal would stop the run without its checkpoint
            return
        received.append(signum)
        if child is not None:
            for process in training_processes(child, launcher):
                process.send_signal(signum)

    # Installed before the child starts: a signal in between is remembered and forwarded once it runs.
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    with open(output_dir / LOG_FILE, "ab") as log:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    if received:
        for process in training_processes(child, launcher):
            process.send_signal(received[0])
    returncode = child.wait()
    code = 128 - returncode if returncode < 0 else returncode  # killed by signal N: as a shell reports it, 128 + N
    write_exit(output_dir, code, signal.Signals(received[0]).name if received else None)
    return code


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--" or argv[1] not in LAUNCHERS:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    return supervise(Path(argv[0]), argv[1], argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
