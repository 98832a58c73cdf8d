"""The learning-rate schedule: warmup, then cosine to exactly min_lr at the last step."""

import math

import pytest

from gpt4all_training.training.schedule import cosine_with_min_lr

LR, MIN_LR, WARMUP, TOTAL = 1e-3, 1e-4, 10, 111  # decay over steps 10..110: 100 steps


def lr_at(step: int) -> float:
    return cosine_with_min_lr(step, LR, MIN_LR, WARMUP, TOTAL)


def test_warmup_is_linear_and_ends_at_peak():
    assert lr_at(0) == pytest.approx(LR / 10)
    assert lr_at(4) == pytest.approx(LR / 2)
    assert lr_at(WARMUP - 1) == pytest.approx(LR)
    assert lr_at(WARMUP) == pytest.approx(LR)


def test_cosine_midpoint_is_halfway_between_lr_and_min_lr():
    assert lr_at(WARMUP + 50) == pytest.approx((LR + MIN_LR) / 2)
    assert lr_at(WARMUP + 25) == pytest.approx(MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi / 4)))


def test_last_step_reaches_min_lr_exactly():
    assert lr_at(TOTAL - 1) == pytest.approx(MIN_LR, rel=1e-12)
    assert all(lr_at(s) >= MIN_LR for s in range(TOTAL))


def test_gpt4all_horizon_trick_does_not_reach_min_lr():
    """gpt4all stretched the horizon by steps*min_lr/lr and decayed to 0: at its last step the lr is far below min_lr."""
    n = TOTAL - WARMUP
    stretched = n + int(n * MIN_LR / LR)
    progress = (n - 1) / stretched
    gpt4all_last = LR * 0.5 * (1 + math.cos(math.pi * progress))
    assert abs(gpt4all_last - MIN_LR) > 0.5 * MIN_LR
    assert lr_at(TOTAL - 1) == pytest.approx(MIN_LR)


def test_schedule_counts_optimizer_steps_without_warmup():
    assert cosine_with_min_lr(0, LR, MIN_LR, 0, 3) == pytest.approx(LR)
    assert cosine_with_min_lr(2, LR, MIN_LR, 0, 3) == pytest.approx(MIN_LR)
    assert cosine_with_min_lr(0, LR, MIN_LR, 0, 1) == LR  # a one-step run trains at the peak
