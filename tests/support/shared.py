"""Building a fixture's files once for a whole test run, however many pytest-xdist workers ask for them.

A session fixture is otherwise built once per worker: under `make test`'s two workers, a reference training run that
tests in two files compare with would run twice. `built_once` makes the first process that asks build the folder
while the others wait on a lock, then hands every process the same folder. Whatever is built this way must not be
changed by the tests that read it (copy it first), as with any session fixture."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from filelock import FileLock


def run_folder(tmp_path_factory) -> Path:
    """A folder shared by every worker of this test run and new for each run: the controller's basetemp under
    pytest-xdist (each worker's basetemp is a subfolder of it), the basetemp itself otherwise."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(folder: Path, build: Callable[[Path], object]) -> Path:
    """`folder`, made by `build(folder)` in the first process that asks for it; the others wait for it and reuse it.
    A folder whose build failed or was cut short (no `.done` marker beside it) is removed and built again."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    done = folder.with_name(f"{folder.name}.done")
    with FileLock(folder.with_name(f"{folder.name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            build(folder)
            done.touch()
    return folder


def shared_fixture_folder(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """`built_once` in this test run's shared folder: what a session fixture returns instead of a folder of its
    own worker's."""
    return built_once(run_folder(tmp_path_factory) / "shared" / name, build)


def save_process(result: subprocess.CompletedProcess, path: Path) -> None:
    """A finished subprocess's command, exit code and output as JSON, for `read_process` in another worker."""
    path.write_text(json.dumps({"args": [str(a) for a in result.args], "returncode": result.returncode,
                                "stdout": result.stdout, "stderr": result.stderr}))


def read_process(path: Path) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(**json.loads(path.read_text()))
