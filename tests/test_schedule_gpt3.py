"""mesh-transformer-jax's GPT-3 schedule: linear warmup, half-cosine to end_lr over anneal_steps, then end_lr."""

from functools import partial

import pytest
import torch

from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import UserError
from gpt4all_training.training.schedule import gpt3_schedule, learning_rate

LR, END_LR, WARMUP, ANNEAL = 1e-3, 1e-4, 4, 12


def lr_at(step: int) -> float:
    return gpt3_schedule(step, LR, END_LR, WARMUP, ANNEAL)


# Computed by hand: warmup (s+1)/4 * 1e-3; then 1e-4 + 9e-4 * (1 + cos(pi * (s-4)/12)) / 2.
HAND = {
    0: 2.5e-4, 1: 5.0e-4, 2: 7.5e-4, 3: 1.0e-3,  # warmup ends at the peak
    4: 1.0e-3,                                   # progress 0: cos 0 = 1
    8: 7.75e-4,                                  # progress 1/3: cos(pi/3) = 1/2 -> 1e-4 + 9e-4 * 3/4
    10: 5.5e-4,                                  # progress 1/2: cos(pi/2) = 0 -> halfway
    12: 3.25e-4,                                 # progress 2/3: cos(2pi/3) = -1/2 -> 1e-4 + 9e-4 * 1/4
    16: 1.0e-4,                                  # progress 1: end_lr
    17: 1.0e-4, 1000: 1.0e-4,                    # constant afterwards, however long the run
}


@pytest.mark.parametrize("step", sorted(HAND))
def test_gpt3_schedule_matches_hand_computed_values(step):
    assert lr_at(step) == pytest.approx(HAND[step], rel=1e-12, abs=1e-18)


def test_gpt3_anneal_is_monotone_and_never_below_end_lr():
    values = [lr_at(s) for s in range(WARMUP, WARMUP + ANNEAL + 1)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert min(lr_at(s) for s in range(200)) == pytest.approx(END_LR)


def test_gpt3_without_warmup_starts_at_peak():
    assert gpt3_schedule(0, LR, END_LR, 0, 2) == LR
    assert gpt3_schedule(1, LR, END_LR, 0, 2) == pytest.approx((LR + END_LR) / 2)
    assert gpt3_schedule(2, LR, END_LR, 0, 2) == pytest.approx(END_LR)


def gpt3_config(**overrides) -> TrainConfig:
    values = dict(model_name="m", dataset_path="d", lr=LR, end_lr=END_LR, warmup_steps=WARMUP, anneal_steps=ANNEAL,
                  lr_schedule="gpt3")
    values.update(overrides)
    return validate(TrainConfig(**values))


def test_learning_rate_dispatches_on_lr_schedule():
    config = gpt3_config()
    # total_steps does not change the gpt3 shape; under cosine it would.
    assert [learning_rate(s, config, 20) for s in (3, 10, 16)] == [lr_at(3), lr_at(10), lr_at(16)]
    assert [learning_rate(s, config, 200) for s in (3, 10, 16)] == [lr_at(3), lr_at(10), lr_at(16)]
    cosine = gpt3_config(lr_schedule="cosine", min_lr=0.0, anneal_steps=None)
    assert learning_rate(19, cosine, 20) == pytest.approx(0.0, abs=1e-18)  # cosine ends at min_lr on the last step


def test_train_loop_scheduler_follows_gpt3():
    """The loop's LambdaLR (train.lr_factor) applies the same values to the optimiser, step by step."""
    from gpt4all_training.training.schedule import lr_factor

    config = gpt3_config()
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, config=config, total_steps=30))
    seen = []
    for _ in range(20):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([lr_at(s) for s in range(20)], rel=1e-12)


@pytest.mark.parametrize("overrides, message", [
    (dict(anneal_steps=None), "anneal_steps: must be at least 1 (lr_schedule: gpt3 needs it), got None"),
    (dict(anneal_steps=0), "anneal_steps: must be at least 1"),
    (dict(end_lr=2e-3), "end_lr: must be between 0 and lr (0.001), got 0.002"),
    (dict(end_lr=-1e-5), "end_lr: must be between 0 and lr"),
    (dict(lr_schedule="linear"), "lr_schedule: must be 'cosine' or 'gpt3', got 'linear'"),
])
def test_gpt3_config_errors_name_the_key(overrides, message):
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        gpt3_config(**overrides)


def test_gpt3_from_yaml_overrides(tmp_path):
    from gpt4all_training.config.loader import load_config

    path = tmp_path / "c.yaml"
    path.write_text("model_name: m\ndataset_path: d\nlr: 1e-3\nlr_schedule: gpt3\nanneal_steps: 12\n")
    config = load_config(path, ["end_lr=1e-4", "warmup_steps=4"])
    assert (config.lr_schedule, config.anneal_steps, config.end_lr, config.warmup_steps) == ("gpt3", 12, 1e-4, 4)
