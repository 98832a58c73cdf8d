"""What a run trains on and how it is scored, chosen once from `config.objective`.

An objective is one class in a module of its own here, with the two faces of protocol.py: what the loop asks
(`TrainingObjective`: its data, model, sampler, the step's batches, its loss and what the loss is a sum over, its
window metrics and validation) and what `plan` and `check` ask (`ObjectiveChecks`). `objective_for(config)` builds
it; train(), plan, check and data each call it once. Only config/ and this package read `config.objective`
(tests/test_imports.py enforces it). Adding an objective means a module here, its entry in OBJECTIVES and its choice
in the config; never the loop.

- "sft" (sft.py): prompt/response records or conversations, the loss on the answers.
- "causal_lm" (causal_lm.py): raw text cut into rows of max_length, every token trained.
- "dpo" (dpo.py, preference.py): prompt/chosen/rejected pairs, DPO, IPO or SimPO against a reference; the step's
  loss is a mean over pairs, not tokens.
- "grpo" (grpo.py, rewards.py): prompts; completions sampled from the model being trained in step_batches, scored
  by rewards, and GRPO's group-relative clipped policy loss (DAPO, Dr. GRPO); its state_dict keeps sampled rows that
  later steps train on again.
"""

from __future__ import annotations

from typing import Callable

from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.training.objectives.causal_lm import CausalLM
from gpt4all_training.training.objectives.dpo import DirectPreference
from gpt4all_training.training.objectives.grpo import GroupRelative
from gpt4all_training.training.objectives.protocol import Objective
from gpt4all_training.training.objectives.sft import FineTuning

OBJECTIVES: dict[str, Callable[[TrainConfig], Objective]] = {"sft": FineTuning, "causal_lm": CausalLM,
                                                             "dpo": DirectPreference, "grpo": GroupRelative}


def objective_for(config: TrainConfig) -> Objective:
    """The objective `config.objective` names, built for this config."""
    return OBJECTIVES[config.objective](config)
