"""Learning rate as a pure function of the optimiser step.

`step` counts optimiser steps taken so far: the lr used for step 0 is the first warmup value, so no step trains at
lr 0. Two shapes:
- `cosine` (the default): linear warmup, then cosine down to exactly `min_lr` at the run's last step;
- `gpt3` (mesh-transformer-jax's schedule): linear warmup, then a half-cosine from `lr` to `end_lr` over
  `anneal_steps`, then `end_lr` until the run ends, however long it is.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from gpt4all_training.config.blocks import Schedule


def cosine_with_min_lr(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then cosine from `lr` down to exactly `min_lr` at the last
    step.

    `step` counts optimiser steps taken so far (the lr used for step 0 is the first warmup value). The last step
    of the run is `total_steps - 1`; it uses `min_lr`. gpt4all stretched the horizon by steps*min_lr/lr instead,
    which never reaches `min_lr` under a cosine.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = total_steps - 1 - warmup_steps
    if decay_steps <= 0:
        return lr
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def gpt3_schedule(step: int, lr: float, end_lr: float, warmup_steps: int, anneal_steps: int) -> float:
    """mesh-transformer-jax's GPT-3 schedule: warmup to `lr`, half-cosine to `end_lr` over `anneal_steps`, then flat.

    Step `warmup_steps - 1` and step `warmup_steps` both use `lr`; step `warmup_steps + anneal_steps` and every
    later one use `end_lr`. Unlike `cosine`, the shape does not depend on the run's length: a longer run simply
    stays at `end_lr` for longer (mesh-transformer-jax's `total_steps` was the anneal length, not the run length).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if anneal_steps <= 0:
        return end_lr
    progress = min(1.0, (step - warmup_steps) / anneal_steps)
    return end_lr + (lr - end_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def learning_rate(step: int, config: Schedule, total_steps: int) -> float:
    """The lr of optimiser step `step` under `config.lr_schedule`: the one function the loop and `plan` both use."""
    if config.lr_schedule == "gpt3":
        assert config.anneal_steps is not None  # validate() requires it for gpt3
        return gpt3_schedule(step, config.lr, config.end_lr, config.warmup_steps, config.anneal_steps)
    return cosine_with_min_lr(step, config.lr, config.min_lr, config.warmup_steps, total_steps)


def schedule_notes(config: Schedule, total_steps: int) -> list[str]:
    """What of its schedule a run of `total_steps` never reaches, one line each: the one check `plan` prints as notes
    and `train` prints at its start. A warmup that leaves no step to decay in (the rate only rises, or rises then
    stays at lr), or gpt3's anneal ending after the last step."""
    floor = ("end_lr", config.end_lr) if config.lr_schedule == "gpt3" else ("min_lr", config.min_lr)
    if config.warmup_steps > 0 and config.warmup_steps >= total_steps - 1:
        # 5-10% of the steps, and at most total_steps - 2 so that at least the last step decays
        low, high = (max(0, min(math.ceil(share * total_steps), total_steps - 2)) for share in (0.05, 0.10))
        suggested = (str(low) if low == high else f"{low}-{high}") + (" (5-10% of the steps)" if high else "")
        return [f"warmup_steps {config.warmup_steps} leaves none of the run's {total_steps} optimiser steps to "
                f"decay in: the learning rate rises to {learning_rate(total_steps - 1, config, total_steps):.3g} "
                f"(lr is {config.lr:.3g}) and never comes down to {floor[0]} {floor[1]:.3g}; set "
                f"warmup_steps={suggested}"]
    if config.lr_schedule == "gpt3" and config.anneal_steps is not None \
            and config.warmup_steps + config.anneal_steps > total_steps:
        return [f"warmup_steps + anneal_steps = {config.warmup_steps + config.anneal_steps} is more than the "
                f"{total_steps} steps: the run ends before end_lr"]
    return []


def total_optimizer_steps(steps_per_epoch: int, num_epochs: int, max_steps: int | None) -> int:
    """Optimizer steps of the whole run, across epochs: the one number the schedule, plan and loop share."""
    total = steps_per_epoch * num_epochs
    return min(total, max_steps) if max_steps else total


def lr_factor(step: int, config: Schedule, total_steps: int) -> float:
    return learning_rate(step, config, total_steps) / config.lr


def build_scheduler(optimizer: torch.optim.Optimizer, config: Schedule, total_steps: int):
    """The LambdaLR that drives `optimizer` (the one that applies the updates) along learning_rate."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, config=config, total_steps=total_steps))
