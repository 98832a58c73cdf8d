"""Checkpoints are only ever loaded when complete and intact; rotation and a full disk never cost the last good one."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from support.launch import explain
from support.outputs import assert_same_run, step_dirs

from gpt4all_training.training.checkpoint import (MARKER, check_resumable, find_resume_checkpoint, latest_checkpoint,
                                         rng_state, rotate, set_rng_state, sha256, torch_save, verify)
from gpt4all_training.errors import UserError
from gpt4all_training.data.sampling import StepSampler

from .harness import TOTAL_STEPS, HubServer, hub_env, run_train

# The optimiser state of the tiny model is 1.8 MB and its weights 0.9 MB: a 1 MB cap fails the save mid-way.
SMALL_DISK = 1_000_000


def fake_checkpoint(root, name: str, complete: bool = True, run_id: str = "run-a"):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"run_id": run_id}))
    if complete:
        (folder / MARKER).write_text('{"files": {}}')
    return folder


def test_rotation_keeps_the_newest_complete_and_the_permanent_ones(tmp_path):
    for step in (2, 4, 6, 8, 10, 12):
        fake_checkpoint(tmp_path, f"step_{step}")
    fake_checkpoint(tmp_path, "step_14", complete=False)  # not complete: does not count as one of the newest
    fake_checkpoint(tmp_path, "step_16.tmp", complete=False)  # an interrupted save's leftovers
    rotate(tmp_path, "run-a", keep_last=2, keep_every=4)
    assert step_dirs(tmp_path) == ["step_4", "step_8", "step_10", "step_12", "step_14"]
    rotate(tmp_path, "run-a", keep_last=1)
    assert step_dirs(tmp_path) == ["step_12", "step_14"]


@pytest.mark.integration
@pytest.mark.slow
def test_newest_valid_checkpoint_skips_interrupted_and_corrupted_ones(reference, tmp_path):
    for name in ("step_16", "step_24", "step_28"):
        shutil.copytree(reference / name, tmp_path / name)
    data = bytearray((tmp_path / "step_28" / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    (tmp_path / "step_28" / "optimizer.pt").write_bytes(bytes(data))
    (tmp_path / "step_24" / MARKER).unlink()
    shutil.copytree(reference / "step_28", tmp_path / "step_32.tmp")
    said = []
    assert latest_checkpoint(tmp_path, said.append) == tmp_path / "step_16"
    assert said == [f"skipping checkpoint {tmp_path / 'step_28'}: optimizer.pt does not match its checksum "
                    f"(corrupted or truncated)",
                    f"skipping checkpoint {tmp_path / 'step_24'}: no completion marker (the save was interrupted)",
                    f"skipping {tmp_path / 'step_32.tmp'}: a save that was interrupted; it is never loaded"]
    assert find_resume_checkpoint(str(tmp_path / "step_28"), None, tmp_path, said.append) == tmp_path / "step_28"
    with pytest.raises(UserError, match="checkpoint: .*missing is not a folder"):
        find_resume_checkpoint(str(tmp_path / "missing"), None, tmp_path)
    said.clear()
    assert find_resume_checkpoint(None, "auto", tmp_path / "empty", said.append) is None
    assert said == [f"resume=auto: no complete checkpoint in {tmp_path / 'empty'}; starting fresh"]


@pytest.mark.integration
@pytest.mark.slow
def test_resume_refuses_a_different_order_of_examples(reference):
    state = json.loads((reference / "step_8" / "state.json").read_text())
    check_resumable(state, StepSampler(43, 4, seed=7), reference / "step_8")  # the same run: fine
    check_resumable(state, StepSampler(43, 2, world_size=2, seed=7), reference / "step_8")  # same global batch
    with pytest.raises(UserError, match="examples_per_step=4 but this run has 8"):
        check_resumable(state, StepSampler(43, 8, seed=7), reference / "step_8")
    with pytest.raises(UserError, match="seed=7 but this run has 8"):
        check_resumable(state, StepSampler(43, 4, seed=8), reference / "step_8")


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    torch_save(rng_state(), tmp_path / "rank0.pt")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(torch.load(tmp_path / "rank0.pt", weights_only=True))
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


@pytest.mark.integration
@pytest.mark.slow
def test_full_disk_during_a_save_keeps_the_previous_checkpoint_and_pushes_nothing(resume_config, reference,
                                                                                  tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(reference / "step_8", out / "step_8")
    shutil.copy(reference / "metrics.jsonl", out / "metrics.jsonl")
    before = {p.name: sha256(p) for p in (out / "step_8").rglob("*") if p.is_file()}

    with HubServer(fail_with=500) as hub:
        failed = run_train(resume_config, out, "resume=auto", "push_to_hub=true", "save_name=someone/tiny",
                           env=hub_env(hub, "hf_never_used"), max_file_bytes=SMALL_DISK)
    assert failed.returncode == 1, explain(failed)
    assert "resumed from" in failed.stdout and "step_8 at step 8" in failed.stdout
    # One error line (tqdm's bar, left open by the exception, may precede it on the same terminal line).
    errors = [line.split("error: ", 1)[1] for line in failed.stderr.splitlines() if "error: " in line]
    assert ["error: " + line for line in errors] == [
        f"error: step 12: could not write checkpoint {out / 'step_12'} ([Errno 27] File too large); the previous "
        f"checkpoint {out / 'step_8'} is intact. Free disk space, then rerun with resume=auto"]
    assert "Traceback" not in failed.stderr
    assert step_dirs(out) == ["step_8"]  # the partial step_12.tmp was removed
    assert verify(out / "step_8") is None
    assert {p.name: sha256(p) for p in (out / "step_8").rglob("*") if p.is_file()} == before
    assert not (out / "final").exists()
    assert hub.requests == []  # a failed run never pushes

    # With space again, the same output_dir resumes from step_8 and ends exactly where the reference did.
    resumed = run_train(resume_config, out, "resume=auto")
    assert resumed.returncode == 0, explain(resumed)
    assert_same_run(out, reference, TOTAL_STEPS)


def test_resume_takes_auto_or_nothing(resume_config):
    from gpt4all_training.config.loader import load_config

    assert load_config(resume_config, ["resume=auto", "keep_every=100"]).resume == "auto"
    assert load_config(resume_config).resume is None
    with pytest.raises(UserError, match="^resume: must be 'auto' or unset; to resume from a folder use checkpoint="):
        load_config(resume_config, ["resume=step_8"])
    with pytest.raises(UserError, match="^keep_every: must be at least 1"):
        load_config(resume_config, ["keep_every=0"])
