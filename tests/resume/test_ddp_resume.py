"""Resume under 2 processes on CPU (gloo): DDP through torchrun, and DeepSpeed ZeRO-2 through accelerate launch.
Each run is killed with SIGKILL inside the second epoch (after step 14) and resumed with resume=auto.

Tolerance. A resume restores the same bytes on every rank (weights, optimiser or ZeRO partition, scheduler, RNG per
rank), and each later step runs the same per-rank arithmetic and the same two-rank all-reduce, so no summation order
changes: against the uninterrupted run of the same launcher the difference is exactly 0, and both tests require
bitwise equality. Against the 1-process reference the runs differ only by the order in which ranks' gradients are
summed, compounded over 30 AdamW steps: logged losses within 1.3e-6 for both, final weights 2.1e-6 (DDP) and
1.24e-5 (ZeRO-2) on the machine of the second session, 1.29e-5 (DDP) on the machine of the fourth, where the code
of commit 7df8df2 (before the layout work) gives exactly the same 1.2910459e-5: these figures move with the
machine's CPU kernels, not the code. The weight bound, 2e-5 for both launchers, and the loss bound, 1e-5, stay far
below what a real fault does (a wrongly normalised loss moves weights by 5e-4 or more; a resume that dropped the
Adam moments at step 16 moved them by 3.6e-3, measured).
"""

from __future__ import annotations

import pytest
from support.launch import explain
from support.outputs import assert_same_run, assert_steps_monotone, exact_rows, max_weight_difference, step_dirs

from .harness import TOTAL_STEPS, run_train

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

DDP = ["batch_size=2"]  # 2 ranks x 2 = the reference's global batch of 4, so step s trains the same examples


def test_ddp_kill_and_resume_matches_the_uninterrupted_ddp_run(resume_config, reference, tmp_path):
    uninterrupted, out = tmp_path / "uninterrupted", tmp_path / "run"
    result = run_train(resume_config, uninterrupted, *DDP, processes=2)
    assert result.returncode == 0, explain(result)
    assert_steps_monotone(uninterrupted, TOTAL_STEPS)

    killed = run_train(resume_config, out, *DDP, processes=2, crash="after_step:14")
    assert killed.returncode != 0, explain(killed)
    assert "step_12" in step_dirs(out) and "final" not in [p.name for p in out.iterdir()]
    assert sorted(p.name for p in (out / "step_12" / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]

    resumed = run_train(resume_config, out, *DDP, "resume=auto", processes=2)
    assert resumed.returncode == 0, explain(resumed)
    assert "step_12 at step 12" in resumed.stdout
    assert_same_run(out, uninterrupted, TOTAL_STEPS)  # bitwise, see the module docstring
    assert max_weight_difference(out / "final", reference / "final") < 2e-5


def test_zero2_kill_and_resume_matches_the_uninterrupted_zero2_run(resume_config, reference, tmp_path):
    """DeepSpeed ZeRO-2 (2 processes, each resuming its own optimiser partition from deepspeed/): bitwise equal to
    the uninterrupted ZeRO-2 run, and within the parity tolerance of the 1-process reference."""
    pytest.importorskip("deepspeed")
    uninterrupted, out = tmp_path / "uninterrupted", tmp_path / "run"
    result = run_train(resume_config, uninterrupted, *DDP, processes=2, deepspeed=True)
    assert result.returncode == 0, explain(result)

    killed = run_train(resume_config, out, *DDP, processes=2, deepspeed=True, crash="after_step:14")
    assert killed.returncode != 0, explain(killed)
    partitions = sorted(p.name for p in (out / "step_12" / "deepspeed" / "engine").glob("zero_pp_rank_*"))
    assert partitions == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]

    resumed = run_train(resume_config, out, *DDP, "resume=auto", processes=2, deepspeed=True)
    assert resumed.returncode == 0, explain(resumed)
    assert "step_12 at step 12" in resumed.stdout
    assert_same_run(out, uninterrupted, TOTAL_STEPS)  # bitwise, see the module docstring
    losses = [(r["step"], r["loss"]) for r in exact_rows(out) if "loss" in r]
    expected = [(r["step"], r["loss"]) for r in exact_rows(reference) if "loss" in r]
    assert [s for s, _ in losses] == [s for s, _ in expected]
    assert max(abs(a - b) for (_, a), (_, b) in zip(losses, expected)) < 1e-5
    assert max_weight_difference(out / "final", reference / "final") < 2e-5
