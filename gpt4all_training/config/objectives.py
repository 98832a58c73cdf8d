"""The objectives, one entry each in OBJECTIVES: what `objective` offers, the keys each one reads and their defaults,
its loss types, the checks of how its keys combine, and the class that trains it.

A new objective is one entry here plus its own module under training/objectives/ (one class with both faces of
training/objectives/protocol.py). Everything else reads this table: the `objective` and `loss_type` fields' choices
and docs (config/blocks.py, and through them `--help` and the studio's forms), TrainConfig's checks of which keys an
objective reads (`objective_checks`), `objective_for` (training/objectives/) and docs/training.md
(tests/test_objectives.py checks that it lists exactly these objectives). The class is named as "module:Class" and
imported when `objective_for` builds it, so config/ imports nothing above it (tests/test_imports.py) and the table
loads without torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Mapping, Optional, Protocol

from gpt4all_training.config.fields import Check, quoted_choices


class ObjectiveKeys(Protocol):
    """The keys of the training config (config/schemas.py) that the objectives' checks read; a dataclass."""
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    objective: str
    beta: Optional[float]
    loss_type: Optional[str]
    label_smoothing: float
    simpo_gamma: float
    rewards: Optional[list[dict]]
    streaming: bool
    max_steps: Optional[int]

    @property
    def reference(self) -> Optional[str]: ...  # read only: the config's type is the narrower Literal of its choices


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str  # what `objective` takes
    implementation: str  # "module:Class" of the objective, built from the config
    summary: str  # what it trains on and how, for `objective`'s doc
    # Config keys that only the objectives naming them read: under any other objective a value besides the key's
    # default is refused rather than ignored.
    keys: tuple[str, ...] = ()
    # Its keys' values when unset (TRL's), filled in when the config is built, so config.yaml records what a run used.
    defaults: Mapping[str, Any] = field(default_factory=dict)
    loss_types: tuple[str, ...] = ()  # what loss_type takes under it
    refuses: Mapping[str, str] = field(default_factory=dict)  # keys others read that it cannot: why, for the error
    checks: Callable[[ObjectiveKeys], list[Check]] | None = None  # how its keys combine


def default_value(config: Any, key: str) -> Any:
    """The default of the config field `key`."""
    found = next(f for f in dataclasses.fields(config) if f.name == key)
    return found.default_factory() if found.default_factory is not dataclasses.MISSING else found.default


def preference_checks(config: ObjectiveKeys) -> list[Check]:
    return [
        Check("beta", config.beta is None or config.beta > 0, "must be > 0"),
        Check("label_smoothing", config.loss_type != "ipo" or config.label_smoothing == 0,
              "ipo defines no label smoothing; set 0"),
        Check("simpo_gamma", config.loss_type == "simpo" or config.simpo_gamma == default_value(config, "simpo_gamma"),
              "only loss_type simpo reads it; remove it"),
        Check("reference", config.reference is None or config.loss_type != "simpo",
              "simpo is reference-free; leave reference unset"),
    ]


def rollout_checks(config: ObjectiveKeys) -> list[Check]:
    return [
        Check("rewards", bool(config.rewards),
              "objective grpo needs at least one reward, e.g. [{name: exact_match}] (see docs/preference.md)",
              got=False),
        Check("beta", config.beta is None or config.beta >= 0, "must be >= 0 (0: no reference)"),
        Check("reference", config.reference is None or config.reference == "frozen_copy",
              "grpo samples new completions at every step, so nothing can be precomputed; leave reference unset"),
        Check("reference", config.reference is None or (config.beta or 0) > 0,
              "beta 0 has no reference; leave reference unset"),
    ]


def row_checks(config: ObjectiveKeys) -> list[Check]:
    return [Check("max_steps", not config.streaming or config.max_steps is not None,
                  "streaming causal_lm needs max_steps (a stream's length is unknown until it ends)")]


OBJECTIVES = {spec.name: spec for spec in (
    ObjectiveSpec("sft", "gpt4all_training.training.objectives.sft:FineTuning",
                  "prompt/response data, loss on the response."),
    ObjectiveSpec("causal_lm", "gpt4all_training.training.objectives.causal_lm:CausalLM",
                  "raw text joined with EOS into rows of max_length, loss on every token (pretraining, as CodeParrot).",
                  refuses={"packing": "causal_lm rows are already max_length long; set false",
                           "group_by_length": "causal_lm rows all have one length"},
                  checks=row_checks),
    ObjectiveSpec("dpo", "gpt4all_training.training.objectives.dpo.objective:DirectPreference",
                  "prompt/chosen/rejected pairs, preference tuning (see the preference keys).",
                  keys=("beta", "loss_type", "label_smoothing", "simpo_gamma", "sft_weight", "reference"),
                  defaults={"beta": 0.1, "loss_type": "sigmoid"}, loss_types=("sigmoid", "ipo", "simpo"),
                  refuses={"packing": "dpo scores each answer as a sequence of its own; set false",
                           "z_loss": "dpo has no next-token loss to add it to; set 0"},
                  checks=preference_checks),
    ObjectiveSpec("grpo", "gpt4all_training.training.objectives.grpo.objective:GroupRelative",
                  "prompts, completions sampled from the model being trained and scored by rewards (see the "
                  "reinforcement learning keys).",
                  keys=("beta", "loss_type", "reference", "rewards", "num_generations", "max_completion_length",
                        "temperature", "top_p", "epsilon", "epsilon_high", "scale_rewards", "num_iterations",
                        "mask_truncated_completions"),
                  defaults={"beta": 0.0, "loss_type": "dapo"}, loss_types=("grpo", "dr_grpo", "dapo"),
                  refuses={"packing": "grpo scores each completion as a sequence of its own; set false",
                           "z_loss": "grpo has no next-token loss to add it to; set 0"},
                  checks=rollout_checks),
)}

# The choices of `objective` and `loss_type`. A type checker sees plain strings: a Literal cannot be built from a
# table, and the values are checked against the table as a config loads (config/fields.py's `typed`).
if TYPE_CHECKING:
    ObjectiveName = str
    LossType = str
else:
    ObjectiveName = Literal[tuple(OBJECTIVES)]
    LossType = Literal[tuple(dict.fromkeys(kind for spec in OBJECTIVES.values() for kind in spec.loss_types))]


def objective_doc() -> str:
    return " ".join(f"'{spec.name}': {spec.summary}" for spec in OBJECTIVES.values())


def loss_types_allowed() -> str:
    """What loss_type takes, per objective, for its error line."""
    return "; ".join(f"for {spec.name} {quoted_choices(spec.loss_types)}" for spec in OBJECTIVES.values()
                     if spec.loss_types)


def readers(key: str) -> tuple[str, ...]:
    """The objectives that read `key`, when only some do; () when every objective may."""
    return tuple(spec.name for spec in OBJECTIVES.values() if key in spec.keys)


def unread(names: tuple[str, ...]) -> str:
    if len(names) == 1:
        return f"only objective {names[0]} reads it; remove it or set objective: {names[0]}"
    return f"only objectives {', '.join(names[:-1])} and {names[-1]} read it; remove it"


def objective_checks(config: ObjectiveKeys) -> list[Check]:
    """The objective's keys: a key only other objectives read, or one this objective refuses, is refused unless it
    keeps its default; loss_type is one of the objective's; then the objective's own checks."""
    spec = OBJECTIVES[config.objective]
    keys = [f.name for f in dataclasses.fields(config)]
    checks = [Check(key, getattr(config, key) == default_value(config, key), unread(readers(key))) for key in keys
              if readers(key) and spec.name not in readers(key)]
    checks += [Check(key, getattr(config, key) == default_value(config, key), why) for key, why in spec.refuses.items()]
    if spec.loss_types:
        checks.append(Check("loss_type", config.loss_type is None or config.loss_type in spec.loss_types,
                            f"objective {spec.name} takes {quoted_choices(spec.loss_types)}"))
    return checks + (spec.checks(config) if spec.checks is not None else [])
