"""What a run trains on and how it is scored, chosen once from `config.objective`.

An objective is one class in a module (or package) of its own here, with the two faces of protocol.py: what the loop
asks (`TrainingObjective`: its data, model, sampler, the step's batches, its loss and what the loss is a sum over,
its window metrics and validation) and what `plan` and `check` ask (`ObjectiveChecks`). `objective_for(config)`
builds it; train(), plan, check and data each call it once. Only config/ and this package read `config.objective`
(tests/test_imports.py enforces it). Adding an objective means its module here and its entry in
config/objectives.py's OBJECTIVES, which names the class; never the loop. What an objective does as the others do
is in shared.py (an objective whose batches come from its data alone takes BatchesFromData's members).

- "sft" (sft.py): prompt/response records or conversations, the loss on the answers.
- "causal_lm" (causal_lm.py): raw text cut into rows of max_length, every token trained.
- "dpo" (dpo/): prompt/chosen/rejected pairs, DPO, IPO or SimPO against a reference; the step's loss is a mean over
  pairs, not tokens.
- "grpo" (grpo/): prompts; completions sampled from the model being trained in step_batches, scored by rewards, and
  GRPO's group-relative clipped policy loss (DAPO, Dr. GRPO); its state_dict keeps sampled rows that later steps
  train on again.
"""

from __future__ import annotations

import pkgutil

from gpt4all_training.config.objectives import OBJECTIVES
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.training.objectives.protocol import Objective

__all__ = ["OBJECTIVES", "objective_for"]


def objective_for(config: TrainConfig) -> Objective:
    """The objective `config.objective` names, built for this config (its class imported now, as the table names
    it)."""
    objective: Objective = pkgutil.resolve_name(OBJECTIVES[config.objective].implementation)(config)
    return objective
