"""Training runs: started as a CLI subprocess (under the supervisor, supervise.py), listed with their state, stopped
with SIGTERM (the loop writes a checkpoint) and resumed with `resume=auto`.

Everything about a run is read from its output folder under runs/, never from the studio's memory, so the list is
the same after the studio restarts: `studio.json` (how the studio launched it: the command, the supervisor's process
id), `studio_exit.json` (the exit code, written by the supervisor), `metrics.jsonl`, the `step_N/` checkpoints and
`final/`. A folder written by the CLI alone is listed too, its state read from its checkpoints and final/.

States: running (the supervisor is alive), finished (exit 0, or final/ complete), stopped (stopped by a signal, or
ended without final/ but with a checkpoint to resume from), failed (any other exit; the log's `error:` line says
why).

A folder the list cannot read (a record missing a key or not JSON, a link out of the workdir) is left out of the
list with a warning in the log, so one bad folder hides no other run; asked for by name, it is the one-line error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TypeVar

import psutil
from pydantic import BaseModel, ValidationError

from gpt4all_training.config.loader import read_yaml
from gpt4all_training.config.secrets import scrub
from gpt4all_training.errors import UserError
from gpt4all_training.studio.configs import ACCELERATE_DIR, check_values, load_in, require_run_folder
from gpt4all_training.studio.supervise import LAUNCHERS
from gpt4all_training.studio.workdir import RUNS_DIR, Workdir
from gpt4all_training.tracking.tracker import read_metrics
from gpt4all_training.files import MARKER, atomic_write
from gpt4all_training.run_folder import (EXIT_FILE, FINAL_DIR, LOG_FILE, METRICS_FILE, RECORD_FILE, REPORT_FILE,
                                         final_folder, step_folders)

log = logging.getLogger("gpt4all_training.studio")

LOG_TAIL_LINES = 40
STOPPING_SIGNALS = ("SIGTERM", "SIGINT")


class RunConflict(UserError):
    """A run is already running where this one would go: the API answers 409."""


@dataclass(frozen=True)
class Launch:
    """How to start a run: its config (a path in the workdir), the launcher, and the devices it takes.
    `devices`: CUDA device numbers ("0,1"), or "" for every device the machine has (and the CPU)."""
    config: str
    launcher: str = "python"
    accelerate_config: Optional[str] = None  # a file name in the repository's configs/accelerate/
    num_processes: Optional[int] = None
    devices: str = ""
    allow_concurrent: bool = False

    def device_set(self) -> Optional[frozenset[str]]:
        """The device numbers, or None for all of them."""
        named = frozenset(d.strip() for d in self.devices.split(",") if d.strip())
        return named or None


def overlapping(a: Optional[frozenset[str]], b: Optional[frozenset[str]]) -> bool:
    return a is None or b is None or bool(a & b)


def train_arguments(launch: Launch, resume: bool) -> list[str]:
    return ["train", "--config", launch.config, *(["resume=auto"] if resume else [])]


def commands(launch: Launch, resume: bool) -> tuple[list[str], list[str]]:
    """(the command line a user would type from the workdir, the one the supervisor runs): the same program, named
    by its console script for the user and by this interpreter for the supervisor."""
    arguments = train_arguments(launch, resume)
    if launch.launcher == "python":
        return ["gpt4all-training", *arguments], [sys.executable, "-m", "gpt4all_training.cli", *arguments]
    options = []
    if launch.accelerate_config:
        config_file = ACCELERATE_DIR / launch.accelerate_config
        options += ["--config_file", str(config_file), *rendezvous_options(config_file)]
    if launch.num_processes:
        options += ["--num_processes", str(launch.num_processes)]
    shown = ["accelerate", "launch", *options, "-m", "gpt4all_training.cli", *arguments]
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    return shown, [accelerate, "launch", *options, "-m", "gpt4all_training.cli", *arguments]


def rendezvous_options(config_file: Path) -> list[str]:
    """A free --main_process_port for a one-machine config that names none: under accelerate's fixed default (29500)
    a second run beside the first (on other devices, as allowed) could not start its process group."""
    values = read_yaml(config_file)
    if values.get("main_process_port") is not None or (values.get("num_machines") or 1) > 1:
        return []
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return ["--main_process_port", str(probe.getsockname()[1])]


def check_launch(launch: Launch) -> None:
    if launch.launcher not in LAUNCHERS:
        raise UserError(f"launcher {launch.launcher!r}: must be one of {', '.join(LAUNCHERS)}")
    if launch.launcher == "python" and (launch.accelerate_config or launch.num_processes):
        raise UserError("accelerate_config, num_processes: only `accelerate launch` reads them; choose the "
                        "accelerate launcher")
    if launch.accelerate_config and launch.accelerate_config not in accelerate_configs():
        raise UserError(f"accelerate_config {launch.accelerate_config}: not one of "
                        f"{', '.join(accelerate_configs())}")
    if launch.num_processes is not None and launch.num_processes < 1:
        raise UserError(f"num_processes: must be at least 1, got {launch.num_processes}")
    if not all(d.strip().isdigit() for d in launch.devices.split(",") if d.strip()):
        raise UserError(f"devices {launch.devices!r}: CUDA device numbers separated by commas (e.g. 0,1), or empty "
                        f"for all")


def accelerate_configs() -> list[str]:
    return sorted(p.name for p in ACCELERATE_DIR.glob("*.yaml"))


class RunRecord(BaseModel):
    """studio.json: how the studio launched the run (Runs.launch writes it)."""
    command: str
    config: str
    pid: int
    create_time: float
    launch: Optional[Launch] = None


class ExitRecord(BaseModel):
    """studio_exit.json: how the run ended (the supervisor writes it)."""
    exit_code: int
    stop_signal: Optional[str] = None


class BadRecord(UserError):
    """A run's record file that is not what the studio writes: a key missing, a value of another type, not JSON."""


Record = TypeVar("Record", bound=BaseModel)


def read_record(folder: Path, name: str, shape: type[Record]) -> Optional[Record]:
    """The run's record file `name` read as `shape`; None when there is none, BadRecord naming the file and what is
    wrong when it is not one."""
    path = folder / name
    if not path.exists():
        return None
    where = f"{RUNS_DIR}/{folder.name}/{name}"
    try:
        return shape.model_validate_json(path.read_bytes())
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror or type(exc).__name__})"
    except ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(part) for part in error["loc"])
        problem = (f"lacks {key!r}" if error["type"] == "missing" else
                   f"not JSON ({error['msg']})" if error["type"] == "json_invalid" else
                   f"{key or 'the file'}: {error['msg']}")
    raise BadRecord(f"{where}: {problem}; the studio writes this file itself, so it was changed or damaged since: "
                    f"remove it, or the run's folder")


def write_json(path: Path, value: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(value, indent=1))


def alive(record: Optional[RunRecord]) -> bool:
    """Whether the supervisor the record names still runs (the same process: its start time matches, so a process
    id reused by the system later is not mistaken for it)."""
    if record is None:
        return False
    try:
        process = psutil.Process(record.pid)
        return abs(process.create_time() - record.create_time) < 1.0 and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, OverflowError):  # a pid no process can have
        return False


def log_tail(folder: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last lines of the run's log, secrets masked."""
    path = folder / LOG_FILE
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 64 * 1024))
        text = f.read().decode("utf-8", errors="replace")
    # A progress bar redraws its line after a carriage return: keep what the line shows last.
    shown = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n")]
    return [scrub(line) for line in shown if line.strip()][-lines:]


def error_line(folder: Path) -> Optional[str]:
    """The CLI's one-line error from the log (`error: ...`), or its last line when there is none."""
    tail = log_tail(folder, 200)
    errors = [line for line in tail if line.startswith("error: ")]
    return errors[-1] if errors else (tail[-1] if tail else None)


def run_state(folder: Path, record: Optional[RunRecord], ended: Optional[ExitRecord]) -> str:
    if alive(record) and ended is None:
        return "running"
    final = (final_folder(folder) / MARKER).is_file()
    if ended is not None and ended.exit_code == 0 or ended is None and final:
        return "finished"
    complete = [step for step, path in step_folders(folder) if (path / MARKER).is_file()]
    stopped = ended is not None and (ended.stop_signal in STOPPING_SIGNALS
                                     or ended.exit_code in (128 + signal.SIGTERM, 128 + signal.SIGINT))
    if stopped or ended is None and complete:
        return "stopped"
    return "failed"


def run_info(workdir: Workdir, folder: Path, detail: bool = False) -> dict[str, Any]:
    """What the run list and the run page show of the run in `folder`, read from the folder alone."""
    record = read_record(folder, RECORD_FILE, RunRecord)
    ended = read_record(folder, EXIT_FILE, ExitRecord)
    state = run_state(folder, record, ended)
    rows = read_metrics(folder / METRICS_FILE)
    training = [row for row in rows if "loss" in row]
    checkpoints = [step for step, path in step_folders(folder) if (path / MARKER).is_file()]
    max_steps = None
    if record and workdir.path(record.config, "config").is_file():
        max_steps = read_yaml(workdir.path(record.config, "config")).get("max_steps")
    info = {"name": folder.name, "output_dir": workdir.relative(folder), "state": state,
            "step": training[-1]["step"] if training else 0, "max_steps": max_steps,
            "last": training[-1] if training else None, "checkpoints": checkpoints,
            "final": workdir.relative(final_folder(folder)) if (final_folder(folder) / MARKER).is_file() else None,
            "command": record.command if record else None, "config": record.config if record else None,
            "launch": dataclasses.asdict(record.launch) if record and record.launch else None,
            "exit_code": ended.exit_code if ended else None,
            "resumable": state in ("stopped", "failed") and bool(checkpoints) and record is not None}
    if state == "failed":
        info["error"] = error_line(folder)
    if detail:
        info["log"] = log_tail(folder)
        info["report"] = workdir.relative(folder / REPORT_FILE) if (folder / REPORT_FILE).is_file() else None
    return info


def is_run_folder(folder: Path) -> bool:
    return folder.is_dir() and any((folder / name).exists() for name in (RECORD_FILE, METRICS_FILE, FINAL_DIR))


class Runs:
    """Starts, stops and lists the runs under runs/. The supervisors this studio started are kept as Popen objects
    only to collect their exit status (a finished child would otherwise linger as a zombie while the studio runs);
    their state comes from the folders."""

    def __init__(self, workdir: Workdir, hidden_env: tuple[str, ...] = (), secrets: tuple[str, ...] = ()):
        self.workdir = workdir
        self.hidden_env = hidden_env  # variables the run must not see: the studio's API key
        self.secrets = secrets  # what no config it starts may hold (the key's value): a config written by hand too
        self.children: dict[str, subprocess.Popen] = {}
        # Requests run in threads: two starts at once (a double click) must not both pass the conflict check.
        self.starting = threading.Lock()

    def folder(self, name: str) -> Path:
        folder = self.workdir.path(f"{RUNS_DIR}/{name}", "run")
        if folder.parent != self.workdir.path(RUNS_DIR) or not is_run_folder(folder):
            raise UserError(f"run {name}: no such run in {RUNS_DIR}/")
        return folder

    def list(self) -> list[dict[str, Any]]:
        for child in self.children.values():
            child.poll()
        root = self.workdir.root / RUNS_DIR
        folders = sorted(root.iterdir()) if root.is_dir() and self.workdir.inside(root) else []
        listed = []
        for folder in folders:
            if not is_run_folder(folder):
                continue
            try:
                listed.append(run_info(self.workdir, self.folder(folder.name)))
            except UserError as exc:
                log.warning("%s/%s left out of the run list: %s", RUNS_DIR, folder.name, exc)
        return listed

    def info(self, name: str) -> dict[str, Any]:
        if name in self.children:
            self.children[name].poll()
        return run_info(self.workdir, self.folder(name), detail=True)

    def start(self, launch: Launch, resume: bool = False) -> dict[str, Any]:
        """Start (or, with `resume`, continue) the run of `launch.config`; RunConflict when that run, or another
        one on the same devices, is running (unless launch.allow_concurrent)."""
        check_launch(launch)
        config = load_in(self.workdir, launch.config)
        check_values(config.to_dict(), self.secrets)
        folder = require_run_folder(self.workdir, config.output_dir)
        with self.starting:
            self.check_conflicts(launch, folder.name)
            return self.launch(launch, folder, resume)

    def check_conflicts(self, launch: Launch, name: str) -> None:
        for run in self.list():
            if run["state"] != "running":
                continue
            if run["name"] == name:
                raise RunConflict(f"run {name}: already running; stop it first")
            other = Launch(**run["launch"]) if run["launch"] else Launch(config="")
            if not launch.allow_concurrent and overlapping(launch.device_set(), other.device_set()):
                raise RunConflict(f"run {run['name']} is running on {other.devices or 'all devices'}: one run at a "
                                  f"time per device; stop it, choose other devices, or allow concurrent runs")

    def launch(self, launch: Launch, folder: Path, resume: bool) -> dict[str, Any]:
        """The supervisor, started in a session of its own, with the run's record written for later readers."""
        shown, argv = commands(launch, resume)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / EXIT_FILE).unlink(missing_ok=True)
        env = {key: value for key, value in os.environ.items() if key not in self.hidden_env}
        # The page shows the log: the progress bars that can be turned off are (log_tail keeps the last state of
        # the others, which redraw their line after carriage returns).
        env.update(PYTHONUNBUFFERED="1", TQDM_DISABLE="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
        if launch.device_set() is not None:
            env["CUDA_VISIBLE_DEVICES"] = launch.devices
        record = {"command": shlex.join(shown), "config": launch.config, "launch": dataclasses.asdict(launch),
                  "started": time.time()}
        with open(folder / LOG_FILE, "ab") as log:
            log.write(f"$ {record['command']}\n".encode())
        supervisor = [sys.executable, "-m", "gpt4all_training.studio.supervise", str(folder), launch.launcher, "--",
                      *argv]
        # A session of its own: stopping or killing the studio (Ctrl-C included) leaves the run going.
        child = subprocess.Popen(supervisor, cwd=self.workdir.root, env=env, start_new_session=True,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.children[folder.name] = child
        record.update(pid=child.pid, create_time=psutil.Process(child.pid).create_time())
        write_json(folder / RECORD_FILE, record)
        return run_info(self.workdir, folder, detail=True)

    def stop(self, name: str) -> dict[str, Any]:
        """SIGTERM to the run's supervisor, which passes it to the training processes: each finishes its step,
        writes a checkpoint and exits."""
        folder = self.folder(name)
        record = read_record(folder, RECORD_FILE, RunRecord)
        ended = read_record(folder, EXIT_FILE, ExitRecord)
        if record is None or ended is not None or not alive(record):
            raise RunConflict(f"run {name}: not running")
        os.kill(record.pid, signal.SIGTERM)
        return run_info(self.workdir, folder, detail=True)

    def resume(self, name: str) -> dict[str, Any]:
        """Start the run again from its newest checkpoint, with the launch it was started with."""
        folder = self.folder(name)
        record = read_record(folder, RECORD_FILE, RunRecord)
        if record is None or record.launch is None:
            raise UserError(f"run {name}: started outside the studio; resume it with `gpt4all-training train "
                            f"--config ... resume=auto`")
        info = run_info(self.workdir, folder)
        if info["state"] == "finished":
            raise RunConflict(f"run {name}: finished; there is nothing to resume")
        return self.start(record.launch, resume=True)
