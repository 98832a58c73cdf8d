"""Issue 40, class 4: a finished run's final/ is never replaced by accident, with or without checkpoints. The same
command again says the run finished and exits 0 having changed nothing; another config is refused in one line naming
the changed keys (a run without checkpoints cannot continue, so it would train from step 0 over final/), unless
resume=never, which sets the finished run aside whole first. A run stopped before its first save has nothing to
continue: the same command starts from step 0 and says so.

Every case runs through each command line that reaches training (`ENTRY_POINTS`): `python train.py` as a real process
and `gpt4all-training train` in this process. The runs are copies of the session's finished runs (conftest.py): the
reference (6 steps, no checkpoints) and the checkpointed one (steps 2 and 4, then final/).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Callable

import pytest
from resume.harness import run_train as run_with_crash
from support.launch import explain
from support.outputs import assert_bitwise_equal_weights, exact_rows, step_dirs

from gpt4all_training.cli.main import main

from .entry_points import snapshot
from .harness import error_lines, run_train


def in_process(capsys, config: Path, output_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`gpt4all-training train` run by main() in this process, as the completed process it would have been."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(config), f"output_dir={output_dir}", *overrides])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([], exit_info.value.code, out, err)


def script(capsys, config: Path, output_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run_train(config, output_dir, *overrides)


ENTRY_POINTS: dict[str, Callable[..., subprocess.CompletedProcess]] = {
    "python train.py": script, "gpt4all-training train": in_process}


def finished_line(out: Path) -> str:
    return (f"output_dir {out}: its last run finished (final/) with this config; nothing to do. To train again from "
            f"step 0, pass resume=never (the finished run is set aside, not deleted) or choose another output_dir")


def refused_line(out: Path, changes: str) -> str:
    return (f"error: output_dir {out}: holds a finished run (final/) that left no checkpoint to continue, and this "
            f"config changes what it trained: {changes}; choose a new output_dir, or pass resume=never to train from "
            f"step 0 with the finished run set aside (not deleted)")


def assert_one_line(result: subprocess.CompletedProcess, code: int, line: str) -> None:
    """Exit `code` with `line` the only thing said: on stdout for a success, as the one error line otherwise."""
    assert result.returncode == code, explain(result)
    assert "Traceback" not in result.stderr
    if code == 0:
        assert result.stdout.splitlines() == [line] and error_lines(result.stderr) == []
    else:
        assert error_lines(result.stderr) == [line] and result.stdout == ""


# (overrides, exit code, the line) for a rerun into the finished run without checkpoints
WITHOUT_CHECKPOINTS = [
    ((), 0, finished_line),
    (("resume=auto",), 0, finished_line),
    (("save_every=3", "log_every=2"), 0, finished_line),  # how the run is watched and saved is not what it trains
    (("lr=5e-3",), 2, lambda out: refused_line(out, "lr (0.001 -> 0.005)")),
    (("resume=auto", "lr=5e-3", "seed=4"), 2, lambda out: refused_line(out, "seed (3 -> 4), lr (0.001 -> 0.005)")),
    (("lr=5e-3", "resume_allow_changes=[lr]"), 2, lambda out: refused_line(out, "lr (0.001 -> 0.005)")),
]
CASES = [(entry, *case) for entry in ENTRY_POINTS for case in WITHOUT_CHECKPOINTS]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("entry, overrides, code, line", CASES,
                         ids=[f"{entry}-{' '.join(overrides) or 'same'}" for entry, overrides, *_ in CASES])
def test_a_finished_run_without_checkpoints_is_never_replaced(hard_config, reference, tmp_path, capsys, entry,
                                                              overrides, code, line):
    out = shutil.copytree(reference, tmp_path / "run")
    before = snapshot(out)
    assert_one_line(ENTRY_POINTS[entry](capsys, hard_config, out, *overrides), code, line(out))
    assert snapshot(out) == before  # final/, metrics.jsonl, run_id, report: every byte, every mode


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_finished_run_with_checkpoints_run_again_has_nothing_to_do(hard_config, checkpointed_run, tmp_path, capsys,
                                                                     entry):
    out = shutil.copytree(checkpointed_run, tmp_path / "run")
    before = snapshot(out)
    assert_one_line(ENTRY_POINTS[entry](capsys, hard_config, out, "save_every=2"), 0,
                    f"output_dir {out}: its last run finished (final/ is newer than its last checkpoint, step_4) with "
                    f"this config; nothing to do. To train again, pass resume=never (from step 0; the finished run is "
                    f"set aside, not deleted) or resume=auto (from step_4), or choose another output_dir")
    assert snapshot(out) == before


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_resume_never_sets_the_finished_run_aside_whole_and_trains_the_new_config(hard_config, reference, tmp_path,
                                                                                  capsys, entry):
    out = shutil.copytree(reference, tmp_path / "run")
    before = snapshot(out)
    result = ENTRY_POINTS[entry](capsys, hard_config, out, "resume=never", "lr=5e-3")
    assert result.returncode == 0, explain(result)
    assert result.stdout.splitlines()[0] == (
        f"resume=never: moved the previous run's files (final, metrics.jsonl, report.html, run_id) into "
        f"{out / 'set-aside-1'}; nothing was deleted; training from step 0")
    moved = {name: what for name, what in before.items() if name.split("/")[0] != "tokenized"}
    assert snapshot(out / "set-aside-1") == moved
    assert_bitwise_equal_weights(out / "set-aside-1" / "final", reference / "final")
    assert [row["lr"] for row in exact_rows(out) if "loss" in row][0] == 5e-3  # the new run, trained from step 0
    assert (out / "final" / "COMPLETE").is_file() and step_dirs(out) == []


@pytest.fixture(scope="module")
def killed_before_its_first_save(hard_config, tmp_path_factory) -> Path:
    """The 6 steps without checkpoints, killed after step 2: run_id, tokenized data and two metrics rows, no
    checkpoint and no final/ (copy it before rerunning into it)."""
    out = tmp_path_factory.mktemp("killed-before-save") / "run"
    killed = run_with_crash(hard_config, out, crash="after_step:2", timeout=300)
    assert killed.returncode == -9, explain(killed)
    assert [row["step"] for row in exact_rows(out)] == [1, 2] and step_dirs(out) == []
    assert not (out / "final").exists()
    return out


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_run_killed_before_its_first_save_is_trained_again_from_step_0(hard_config, reference,
                                                                         killed_before_its_first_save, tmp_path,
                                                                         capsys, entry):
    """Nothing to continue and no model to keep: the same command starts from step 0, says so first, and its
    metrics replace the killed run's; the result is the uninterrupted run's, bit for bit."""
    out = shutil.copytree(killed_before_its_first_save, tmp_path / "run")
    run_id = (out / "run_id").read_text().strip()
    result = ENTRY_POINTS[entry](capsys, hard_config, out)
    assert result.returncode == 0, explain(result)
    assert result.stdout.splitlines()[0] == (
        f"note: the run last started in {out} ({run_id}) left no checkpoint and no final/, so this run starts from "
        f"step 0 and its metrics replace that run's")
    assert exact_rows(out) == exact_rows(reference)
    assert_bitwise_equal_weights(out / "final", reference / "final")
