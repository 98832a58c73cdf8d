"""Resume under FSDP2 on CPU (gloo): `accelerate launch --config_file configs/accelerate/fsdp2_2proc.yaml`, killed
with SIGKILL inside the second epoch (after step 14) and resumed with resume=auto from step_12, where each rank
reloads its own shards of the weights and the optimizer state from fsdp/rank{r}.pt.

Tolerance. As for DDP and ZeRO-2 (test_ddp_resume.py): the resume restores the same bytes on every rank and each
later step repeats the same per-rank arithmetic and collectives, so the resumed run equals the uninterrupted FSDP2
run bit for bit, and the test requires that. Against the 1-process reference the runs differ only in the order in
which the ranks' gradients are summed, over 30 AdamW steps: logged losses within 6.8e-7 and final weights within
1.07e-5, measured (ZeRO-2 measures 1.24e-5 there). The bounds, ZeRO-2's (1e-5 for losses, 2e-5 for weights), stay
far below a real fault (a wrongly normalised loss moves weights by 5e-4 or more, a resume that dropped the Adam
moments by 3.6e-3).
"""

from __future__ import annotations

import pytest
import torch
from support.launch import explain
from support.outputs import assert_same_run, assert_steps_monotone, exact_rows, max_weight_difference, step_dirs

from .harness import TOTAL_STEPS, run_train

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

PER_RANK = ["batch_size=2"]  # 2 ranks x 2 = the reference's global batch of 4, so step s trains the same examples


def test_fsdp2_kill_and_resume_matches_the_uninterrupted_fsdp2_run(resume_config, reference, tmp_path):
    uninterrupted, out = tmp_path / "uninterrupted", tmp_path / "run"
    result = run_train(resume_config, uninterrupted, *PER_RANK, processes=2, fsdp=True)
    assert result.returncode == 0, explain(result)
    assert_steps_monotone(uninterrupted, TOTAL_STEPS)

    killed = run_train(resume_config, out, *PER_RANK, processes=2, fsdp=True, crash="after_step:14")
    assert killed.returncode != 0, explain(killed)
    assert "step_12" in step_dirs(out) and "final" not in [p.name for p in out.iterdir()]
    shards = sorted(p.name for p in (out / "step_12" / "fsdp").iterdir())
    assert shards == ["rank0.pt", "rank1.pt"]
    step = [torch.load(out / "step_12" / "fsdp" / name, weights_only=True)["optimizer"]["state"][0]["step"]
            for name in shards]
    assert step == [12, 12]  # each rank's Adam state, at the checkpoint's step

    resumed = run_train(resume_config, out, *PER_RANK, "resume=auto", processes=2, fsdp=True)
    assert resumed.returncode == 0, explain(resumed)
    assert "step_12 at step 12" in resumed.stdout
    assert_same_run(out, uninterrupted, TOTAL_STEPS)  # bitwise, see the module docstring
    losses = [r["loss"] for r in exact_rows(out) if "loss" in r]
    expected = [r["loss"] for r in exact_rows(reference) if "loss" in r]
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-5
    assert max_weight_difference(out / "final", reference / "final") < 2e-5
