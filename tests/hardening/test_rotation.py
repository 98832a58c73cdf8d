"""Rotation never deletes what a resume needs: it counts only this run's checkpoints that verify, leaves other runs'
and corrupt ones alone, keeps the checkpoint a resume started from until a newer valid one exists, and tidies up
when a run starts and ends (a kill between a save and its rotation leaves one too many)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from resume.harness import run_train as run_with_crash
from support.launch import explain
from support.outputs import assert_bitwise_equal_weights, exact_rows, step_dirs

from gpt4all_training.run_folder import RUN_ID_FILE
from gpt4all_training.training.checkpoint import (MARKER, latest_checkpoint, rotate, saved_run_id, sha256, verify,
                                                  write_marker)

from .harness import run_train


def make_checkpoint(root: Path, step: int, run_id: str | None, valid: bool = True) -> Path:
    """A small checkpoint folder with a real marker; `valid=False` flips a byte after the marker was written."""
    folder = root / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "state.json").write_text("{}" if run_id is None else f'{{"step": {step}, "run_id": "{run_id}"}}')
    (folder / "weights.bin").write_bytes(bytes(range(64)) * step)
    write_marker(folder)
    if not valid:
        data = bytearray((folder / "weights.bin").read_bytes())
        data[3] ^= 0xFF
        (folder / "weights.bin").write_bytes(bytes(data))
    return folder


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- rotate() itself

def test_rotation_counts_only_this_runs_valid_checkpoints(tmp_path):
    """The issue's first case: keep_last 1, a corrupt newest checkpoint of this run, another run's higher ones and a
    checkpoint from before run ids; only this run's valid checkpoints older than its newest valid one go."""
    make_checkpoint(tmp_path, 2, "b")
    make_checkpoint(tmp_path, 4, "b")
    make_checkpoint(tmp_path, 6, "b")
    make_checkpoint(tmp_path, 12, "b", valid=False)  # corrupt: not counted, and newer than the kept one: left
    make_checkpoint(tmp_path, 14, "a")
    make_checkpoint(tmp_path, 16, "a")
    make_checkpoint(tmp_path, 18, None)
    (tmp_path / "step_20.tmp").mkdir()
    rotate(tmp_path, "b", keep_last=1)
    assert step_dirs(tmp_path) == ["step_6", "step_12", "step_14", "step_16", "step_18"]
    rotate(tmp_path, "a", keep_last=1)
    assert step_dirs(tmp_path) == ["step_6", "step_12", "step_16", "step_18"]


def test_the_checkpoint_a_resume_started_from_stays_until_a_newer_valid_one_exists(tmp_path):
    started = make_checkpoint(tmp_path, 3, None)  # written before run ids: the resumed run has a new id
    rotate(tmp_path, "new", keep_last=1, started_from=started)
    assert step_dirs(tmp_path) == ["step_3"]
    make_checkpoint(tmp_path, 4, "new", valid=False)
    rotate(tmp_path, "new", keep_last=1, started_from=started)
    assert step_dirs(tmp_path) == ["step_3", "step_4"]  # the newer one is corrupt: nothing to fall back on yet
    make_checkpoint(tmp_path, 5, "new")
    rotate(tmp_path, "new", keep_last=1, started_from=started)
    assert step_dirs(tmp_path) == ["step_5"]


OWNERS = st.sampled_from(["ours", "other", "legacy"])


@settings(max_examples=80, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.lists(st.tuples(OWNERS, st.booleans()), max_size=8), keep_last=st.integers(1, 4),
       keep_every=st.none() | st.integers(2, 4), start=st.none() | st.integers(0, 7))
def test_rotation_never_deletes_what_a_resume_needs(layout, keep_last, keep_every, start):
    """Any mix of this run's, another run's and id-less checkpoints, valid or corrupt, with a resume start among
    them: other runs' are untouched; this run's newest keep_last valid ones stay, and so does everything newer than
    the oldest of them; older ones go unless they are multiples of keep_every."""
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        ids = {"ours": "r1", "other": "r2", "legacy": None}
        folders = [make_checkpoint(root, i + 1, ids[owner], valid) for i, (owner, valid) in enumerate(layout)]
        started = folders[start] if start is not None and start < len(folders) else None
        before = {folder: tree(folder) for folder in folders}
        rotate(root, "r1", keep_last, keep_every, started_from=started)

        ours = [(i + 1, f, valid) for i, ((owner, valid), f) in enumerate(zip(layout, folders))
                if owner == "ours" or f == started]
        kept_valid = [step for step, _, valid in reversed(ours) if valid][:keep_last]
        oldest_kept = min(kept_valid) if len(kept_valid) == keep_last else 0
        for i, ((owner, valid), folder) in enumerate(zip(layout, folders)):
            step, mine = i + 1, owner == "ours" or folder == started
            if not mine or step >= oldest_kept or (keep_every and step % keep_every == 0):
                assert folder.is_dir() and tree(folder) == before[folder], (step, owner, valid)
            else:
                assert not folder.exists(), (step, owner, valid)


# ---------------------------------------------------------------- real runs

@pytest.fixture(scope="module")
def five_checkpoints(hard_config, tmp_path_factory) -> Path:
    """Steps 1-5 of the hardening run, a checkpoint after each (all kept), killed once step_5 is complete."""
    out = tmp_path_factory.mktemp("rotation-source") / "run"
    result = run_with_crash(hard_config, out, "save_every=1", "keep_last=", crash="after_save:5", timeout=300)
    assert result.returncode == -9, explain(result)
    assert step_dirs(out) == ["step_1", "step_2", "step_3", "step_4", "step_5"]
    return out


@pytest.mark.integration
@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_never_costs_the_valid_ones(hard_config, reference, five_checkpoints, tmp_path):
    """keep_last 1 and a corrupt newest step_5: the resume starts from step_1 and keeps each new checkpoint, so a
    second kill still resumes (before: every save kept the corrupt step_5 and deleted the new one, and the next
    resume retrained from step 0)."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("step_1", "step_5"):
        shutil.copytree(five_checkpoints / name, out / name)
    for name in (RUN_ID_FILE, "metrics.jsonl"):
        shutil.copy(five_checkpoints / name, out / name)
    data = bytearray((out / "step_5" / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / "step_5" / "optimizer.pt").write_bytes(bytes(data))

    killed = run_with_crash(hard_config, out, "resume=auto", "save_every=1", "keep_last=1", crash="after_save:3",
                            timeout=300)
    assert killed.returncode == -9, explain(killed)
    assert f"skipping checkpoint {out / 'step_5'}: optimizer.pt does not match its checksum" in killed.stdout
    assert f"resumed from {out / 'step_1'} at step 1" in killed.stdout
    assert sorted(step_dirs(out)) == ["step_3", "step_5.set-aside-1"] and verify(out / "step_3") is None

    resumed = run_train(hard_config, out, "resume=auto", "save_every=1", "keep_last=1")
    assert resumed.returncode == 0, explain(resumed)
    assert f"resumed from {out / 'step_3'} at step 3" in resumed.stdout
    assert sorted(step_dirs(out)) == ["step_5", "step_5.set-aside-1"] and verify(out / "step_5") is None
    assert exact_rows(out) == exact_rows(reference)
    assert_bitwise_equal_weights(out / "final", reference / "final")


@pytest.mark.integration
@pytest.mark.slow
def test_a_fresh_run_next_to_an_older_runs_higher_checkpoints_keeps_its_own(hard_config, reference, five_checkpoints,
                                                                           tmp_path):
    """An older run's step_4 and step_5 stay in output_dir: a fresh run's rotation keeps its own checkpoints,
    resume=auto continues the fresh run rather than the older one, and the older ones are set aside (never deleted)
    when the fresh run needs their names."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("step_4", "step_5"):
        shutil.copytree(five_checkpoints / name, out / name)
    older = {name: tree(out / name) for name in ("step_4", "step_5")}
    older_id = saved_run_id(out / "step_5")

    killed = run_with_crash(hard_config, out, "save_every=1", "keep_last=1", crash="after_save:2", timeout=300)
    assert killed.returncode == -9, explain(killed)
    assert "already holds checkpoints (newest step_5) but this run starts fresh" in killed.stdout
    assert step_dirs(out) == ["step_2", "step_4", "step_5"]
    fresh_id = (out / RUN_ID_FILE).read_text()
    assert saved_run_id(out / "step_2") == fresh_id != older_id

    said = []
    assert latest_checkpoint(out, said.append, fresh_id) == out / "step_2"
    assert said[0] == (f"skipping checkpoint {out / 'step_5'}: written by another run ({older_id}), not by "
                       f"{out / RUN_ID_FILE}'s run {fresh_id}; to continue that run, pass checkpoint={out / 'step_5'}")
    resumed = run_train(hard_config, out, "resume=auto", "save_every=1", "keep_last=1")
    assert resumed.returncode == 0, explain(resumed)
    assert f"resumed from {out / 'step_2'} at step 2" in resumed.stdout
    assert sorted(step_dirs(out)) == ["step_4.set-aside-1", "step_5", "step_5.set-aside-1"]
    assert {name: tree(out / f"{name}.set-aside-1") for name in older} == older  # byte for byte
    assert exact_rows(out) == exact_rows(reference)
    assert_bitwise_equal_weights(out / "final", reference / "final")


@pytest.mark.integration
@pytest.mark.slow
def test_a_kill_between_a_save_and_its_rotation_is_tidied_when_the_next_run_starts_and_ends(hard_config, reference,
                                                                                            tmp_path):
    out = tmp_path / "run"
    killed = run_with_crash(hard_config, out, "save_every=1", "keep_last=2", crash="before_rotate:4", timeout=300)
    assert killed.returncode == -9, explain(killed)
    assert step_dirs(out) == ["step_2", "step_3", "step_4"]  # one more than keep_last
    (out / "step_9.tmp").mkdir()  # and an interrupted save's leftovers

    # No saves in this run (save_every unset): only the rotations at its start and end act. Killed after step 5,
    # it shows what the start did; finishing shows what the end does with a smaller keep_last.
    killed = run_with_crash(hard_config, out, "resume=auto", "save_every=", "keep_last=2", crash="after_step:5",
                            timeout=300)
    assert killed.returncode == -9, explain(killed)
    assert step_dirs(out) == ["step_3", "step_4"]
    finished = run_train(hard_config, out, "resume=auto", "save_every=", "keep_last=1")
    assert finished.returncode == 0, explain(finished)
    assert step_dirs(out) == ["step_4"] and (out / "final" / MARKER).is_file()
    assert exact_rows(out) == exact_rows(reference)
    assert_bitwise_equal_weights(out / "final", reference / "final")


@pytest.mark.integration
@pytest.mark.slow
def test_every_checkpoint_of_a_run_carries_its_id(five_checkpoints):
    run_id = (five_checkpoints / RUN_ID_FILE).read_text()
    assert len(run_id) == 16
    assert {saved_run_id(five_checkpoints / name) for name in step_dirs(five_checkpoints)} == {run_id}
