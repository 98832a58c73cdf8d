"""A run killed with SIGKILL and resumed ends bitwise identical to one that never stopped (CPU, fp32, 1 process).

Kill points: right after a checkpoint (step 8, resumed with checkpoint=PATH), inside the second epoch (step 14),
inside the validation pass of step 15, and while step 20's checkpoint is being written. Each resume is compared
with the uninterrupted reference: final weights with torch.equal on every tensor, and every logged loss, lr,
gradient norm, trained-token count and validation loss with ==.
"""

from __future__ import annotations

import json
import signal

import pytest
from support.launch import explain
from support.outputs import assert_same_run, assert_steps_monotone, exact_rows, metrics, step_dirs

from gpt4all_training.training.checkpoint import MARKER, verify

from .harness import TOTAL_STEPS, run_train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KILLED = -signal.SIGKILL


def reference_rows_through(reference, step: int) -> list[dict]:
    return [row for row in exact_rows(reference) if row["step"] <= step]


def test_reference_keeps_the_last_two_checkpoints_and_every_eighth(reference):
    # Saves at 4, 8, ..., 28 (none at the last step, which writes final/): keep_last=2 leaves 24 and 28,
    # keep_every=8 also leaves 8 and 16 for good.
    assert step_dirs(reference) == ["step_8", "step_16", "step_24", "step_28"]
    assert all(verify(reference / name) is None for name in step_dirs(reference))
    state = json.loads((reference / "step_28" / "state.json").read_text())
    assert {k: state[k] for k in ("step", "epoch", "position", "steps_per_epoch", "seed", "examples_per_step")} == \
        {"step": 28, "epoch": 2, "position": 8, "steps_per_epoch": 10, "seed": 7, "examples_per_step": 4}
    assert state["trained_tokens"] == next(r["trained_tokens"] for r in metrics(reference) if r.get("step") == 28
                                           and "loss" in r)
    assert (reference / "step_28" / "config.yaml").read_text().count("seed: 7") == 1
    assert sorted(p.name for p in (reference / "step_28").iterdir()) == \
        ["COMPLETE", "config.yaml", "model", "optimizer.pt", "rng", "scheduler.pt", "state.json"]
    assert_steps_monotone(reference, TOTAL_STEPS)


def test_kill_right_after_a_checkpoint_then_inside_the_second_epoch(resume_config, reference, tmp_path):
    out = tmp_path / "run"
    killed = run_train(resume_config, out, crash="after_save:8")
    assert killed.returncode == KILLED, explain(killed)
    assert step_dirs(out) == ["step_4", "step_8"]
    assert exact_rows(out) == reference_rows_through(reference, 8)

    # An explicit checkpoint=PATH resume, killed again at step 14 (epoch 2, two steps after step_12).
    killed = run_train(resume_config, out, f"checkpoint={out / 'step_8'}", crash="after_step:14")
    assert killed.returncode == KILLED, explain(killed)
    assert f"resumed from {out / 'step_8'} at step 8 (epoch 1, step 8 of 10" in killed.stdout
    assert exact_rows(out) == reference_rows_through(reference, 14)

    resumed = run_train(resume_config, out, "resume=auto")
    assert resumed.returncode == 0, explain(resumed)
    # Steps 13 and 14 ran twice; their first rows were dropped on resume, so each step is logged once.
    assert f"resumed from {out / 'step_12'} at step 12 (epoch 2, step 2 of 10" in resumed.stdout
    assert_same_run(out, reference, TOTAL_STEPS)


def test_kill_during_evaluation_then_while_saving(resume_config, reference, tmp_path):
    out = tmp_path / "run"
    killed = run_train(resume_config, out, crash="during_eval:15")
    assert killed.returncode == KILLED, explain(killed)
    rows = exact_rows(out)
    assert rows[-1]["step"] == 15 and "loss" in rows[-1]  # step 15 trained and logged, its validation cut off
    assert step_dirs(out) == ["step_8", "step_12"]

    killed = run_train(resume_config, out, "resume=auto", crash="during_save:20")
    assert killed.returncode == KILLED, explain(killed)
    assert "resumed from" in killed.stdout and "step_12 at step 12" in killed.stdout
    # The kill left step_20.tmp without its marker; rotation had not run, so step_12 and step_16 are both there.
    assert step_dirs(out) == ["step_8", "step_12", "step_16", "step_20.tmp"]
    assert not (out / "step_20.tmp" / MARKER).exists() and (out / "step_20.tmp" / "optimizer.pt").is_file()

    resumed = run_train(resume_config, out, "resume=auto")
    assert resumed.returncode == 0, explain(resumed)
    assert f"skipping {out / 'step_20.tmp'}: a save that was interrupted; it is never loaded" in resumed.stdout
    assert f"resumed from {out / 'step_16'} at step 16" in resumed.stdout
    assert step_dirs(out) == ["step_8", "step_16", "step_24", "step_28"]  # the leftover .tmp is gone too
    assert_same_run(out, reference, TOTAL_STEPS)
