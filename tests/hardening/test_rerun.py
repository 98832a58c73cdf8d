"""Running the same command again: a rerun into an output_dir whose last run left a checkpoint continues it (the
first line says so), one with another config is refused in one line before any data is read, a finished run is not
retrained (nothing to do, exit 0), `resume=never` starts over with the old run set aside (never deleted), and final/
is only ever replaced by a run that finished. test_finished_run.py has the finished runs over every entry point."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from resume.harness import run_train as run_with_crash
from support.launch import explain
from support.outputs import assert_bitwise_equal_weights, exact_rows, step_dirs

from gpt4all_training.cli.main import main
from gpt4all_training.run_folder import RUN_ID_FILE
from gpt4all_training.training.checkpoint import MARKER, sha256, start_over

from .harness import error_lines, one_error_line, run_train


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def interrupted(hard_config, tmp_path_factory) -> Path:
    """Ctrl-C after step 3 of the 6: the run writes step_3 and stops (copy it before rerunning into it)."""
    out = tmp_path_factory.mktemp("rerun-interrupted") / "run"
    result = run_with_crash(hard_config, out, crash="SIGINT:3", timeout=300)
    assert result.returncode == 130, explain(result)
    assert step_dirs(out) == ["step_3"] and not (out / "final").exists()
    return out


@pytest.mark.integration
@pytest.mark.slow
def test_a_rerun_after_ctrl_c_continues_by_default(hard_config, reference, interrupted, tmp_path):
    """With dtype auto the run still says first that it resumes, and then what auto resolved to (the run's dtype)."""
    out = shutil.copytree(interrupted, tmp_path / "run")
    run_id = (out / RUN_ID_FILE).read_text()
    rerun = run_train(hard_config, out, "dtype=auto")
    assert rerun.returncode == 0, explain(rerun)
    assert rerun.stdout.splitlines()[:2] == [
        f"resuming: {out} holds a checkpoint of its last run ({run_id}), {out / 'step_3'}; continuing it (resume=never "
        f"starts over, setting that run aside)",
        "dtype: auto is float32 (what the run this one continues resolved)"]
    assert f"resumed from {out / 'step_3'} at step 3" in rerun.stdout
    assert exact_rows(out) == exact_rows(reference)
    assert_bitwise_equal_weights(out / "final", reference / "final")


@pytest.mark.integration
@pytest.mark.slow
def test_a_rerun_with_another_config_is_refused_in_one_line_before_the_data_is_read(hard_config, interrupted,
                                                                                      tmp_path, capsys):
    out = shutil.copytree(interrupted, tmp_path / "run")
    before = tree(out)
    line = one_error_line(capsys, ["train", "--config", str(hard_config), f"output_dir={out}", "lr=2e-3",
                                   "weight_decay=0.1"])
    assert line == (f"error: checkpoint {out / 'step_3'}: this config changes what the run trains: lr (0.001 -> "
                    f"0.002), weight_decay (0.0 -> 0.1); resume with the checkpoint's values, or list the keys in "
                    f"resume_allow_changes to change them on purpose (or pass resume=never to start over, setting "
                    f"that run aside, or start a new output_dir)")
    assert tree(out) == before  # nothing tokenised, cached, logged or moved


@pytest.mark.integration
@pytest.mark.slow
def test_a_finished_run_is_not_retrained_and_resume_never_starts_over_without_losing_it(
        hard_config, reference, checkpointed_run, tmp_path, capsys):
    """The finished run (checkpoints at steps 2 and 4, final/) run again as it was: nothing to do (exit 0), nothing
    touched. With resume=never it is moved whole into set-aside-1/; the new run, killed after step 3, has no final/
    (the old one is not replaced by a run that did not finish); the next rerun continues the new run and finishes
    it."""
    out = shutil.copytree(checkpointed_run, tmp_path / "run")
    before = tree(out)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(hard_config), f"output_dir={out}", "save_every=2"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.splitlines() == [
        f"output_dir {out}: its last run finished (final/ is newer than its last checkpoint, step_4) with this "
        f"config; nothing to do. To train again, pass resume=never (from step 0; the finished run is set aside, not "
        f"deleted) or resume=auto (from step_4), or choose another output_dir"]
    assert tree(out) == before

    old_id = (out / RUN_ID_FILE).read_text()
    killed = run_with_crash(hard_config, out, "resume=never", "save_every=1", crash="after_save:3", timeout=300)
    assert killed.returncode == -9, explain(killed)
    moved = [name for name in sorted(before) if "/" not in name or name.split("/")[0] != "tokenized"]
    assert killed.stdout.splitlines()[0] == (
        f"resume=never: moved the previous run's files (final, metrics.jsonl, report.html, run_id, step_2, step_4) "
        f"into {out / 'set-aside-1'}; nothing was deleted; training from step 0")
    assert tree(out / "set-aside-1") == {name: before[name] for name in moved}
    assert step_dirs(out) == ["step_2", "step_3"] and not (out / "final").exists()
    assert (out / RUN_ID_FILE).read_text() != old_id

    finished = run_train(hard_config, out, "save_every=1")
    assert finished.returncode == 0, explain(finished)
    assert finished.stdout.splitlines()[0].startswith(f"resuming: {out} holds a checkpoint of its last run")
    assert (out / "final" / MARKER).is_file() and tree(out / "set-aside-1") == {name: before[name] for name in moved}
    assert exact_rows(out) == exact_rows(reference)
    assert_bitwise_equal_weights(out / "final", reference / "final")
    assert error_lines(finished.stderr) == []


def test_starting_over_moves_only_what_runs_wrote(tmp_path):
    """resume=never into a folder that also holds the user's own files (an output_dir of `.`, say): the runs'
    checkpoints, final/, record and trackers' files move into the next set-aside-K/; the tokenized-data cache,
    earlier set-aside folders and anything else stay."""
    for name in ("step_2", "step_4.set-aside-1", "final", "tensorboard", "tokenized", "set-aside-1", "notes"):
        (tmp_path / name).mkdir()
    for name in ("run_id", "metrics.jsonl", "report.html", "wandb_run_id", "train.py"):
        (tmp_path / name).write_text(name)
    said = []
    start_over(tmp_path, said.append)
    assert sorted(p.name for p in (tmp_path / "set-aside-2").iterdir()) == [
        "final", "metrics.jsonl", "report.html", "run_id", "step_2", "step_4.set-aside-1", "tensorboard",
        "wandb_run_id"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "set-aside-1", "set-aside-2", "tokenized",
                                                           "train.py"]
    assert said == [f"resume=never: moved the previous run's files (final, metrics.jsonl, report.html, run_id, "
                    f"step_2, step_4.set-aside-1, tensorboard, wandb_run_id) into {tmp_path / 'set-aside-2'}; "
                    f"nothing was deleted; training from step 0"]
    start_over(tmp_path, said.append)  # nothing of a run is left: nothing moves, nothing is said
    assert len(said) == 1 and not (tmp_path / "set-aside-3").exists()
