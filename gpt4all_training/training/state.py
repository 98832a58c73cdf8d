"""Where a run is: the optimizer steps taken and the tokens trained so far, what a checkpoint restores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrainState:
    step: int = 0  # optimizer steps taken
    trained_tokens: int = 0  # positions with a loss, over every rank, since step 0

    def after(self, result: dict[str, Any]) -> TrainState:
        """The state after one more optimizer step with train_step's `result`."""
        return TrainState(self.step + 1, self.trained_tokens + int(result["n_trained"]))

    def epoch(self, steps_per_epoch: int) -> float:
        """Epochs trained, fractional."""
        return self.step / steps_per_epoch
