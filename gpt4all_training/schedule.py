"""Learning rate as a pure function of the optimiser step."""

from __future__ import annotations

import math


def cosine_with_min_lr(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then cosine from `lr` down to exactly `min_lr` at the last step.

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
