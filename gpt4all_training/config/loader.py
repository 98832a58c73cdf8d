"""The training config: one typed dataclass, loaded from YAML with `key=value` overrides, validated up front.

Every key gpt4all's configs used is accepted with the same meaning; every key has a default except
`model_name` and `dataset_path`. A mistake gives one `UserError` line that names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from gpt4all_training.errors import UserError

REPORTERS = ("wandb", "tensorboard", "jsonl")
DTYPES = ("float32", "bfloat16", "float16")


def doc(text: str, default: Any = None, factory: Any = None) -> Any:
    """A dataclass field with its documentation attached (shown by `--help` and in the README)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass
class TrainConfig:
    # --- model ---
    model_name: Optional[str] = doc("Hub id, local folder, or a .gguf file of the base model. Required.")
    tokenizer_name: Optional[str] = doc("Tokenizer to load; defaults to model_name.")
    gguf_file: Optional[str] = doc("GGUF file name inside the model_name folder, when the weights are GGUF.")
    model_revision: Optional[str] = doc("Hub revision (branch, tag or commit) of the model.")
    trust_remote_code: bool = doc("Run model code shipped with a Hub repo. Off unless you say so.", False)
    dtype: str = doc("Compute precision: float32, or bfloat16/float16 autocast over fp32 master weights.", "float32")
    gradient_checkpointing: bool = doc("Recompute activations in the backward pass to save memory.", False)
    compile: bool = doc("torch.compile the model: slower first steps (compilation), faster later ones.", False)
    # --- LoRA ---
    lora: bool = doc("Train a LoRA adapter instead of all weights.", False)
    lora_r: int = doc("LoRA rank.", 8)
    lora_alpha: int = doc("LoRA scaling numerator (scale = alpha / r).", 16)
    lora_dropout: float = doc("Dropout on the LoRA input.", 0.05)
    lora_target_modules: Optional[list[str]] = doc("Module names to adapt; unset means PEFT's default for the model.")
    merge_lora: bool = doc("Also save the adapter merged into the base (merged in fp32) under final/merged.", False)
    # --- pretraining (objective: causal_lm) ---
    objective: str = doc("'sft': prompt/response data, loss on the response. 'causal_lm': raw text joined with EOS "
                         "into rows of max_length, loss on every token (pretraining, as CodeParrot).", "sft")
    init: str = doc("'pretrained': load model_name's weights. 'from_config' (causal_lm only): random weights from "
                    "model_config, vocabulary sized to the tokenizer.", "pretrained")
    model_config: Optional[str] = doc("init from_config: a local folder, a model type (gptj, llama, ...) or a Hub "
                                      "id whose config is used; unset: model_name's.")
    model_config_overrides: Optional[dict] = doc("init from_config: fields set on model_config, e.g. "
                                                 "{n_layer: 4, n_embd: 256}.")
    text_field: Optional[str] = doc("causal_lm: the record field holding the text; unset: 'text', else 'content'.")
    shuffle_buffer: int = doc("causal_lm: rows are shuffled through a buffer of this many, seeded per epoch.", 1000)
    z_loss: float = doc("causal_lm: add z_loss x log(Z)^2 per token (mesh-transformer-jax used 1e-4); 0: off.", 0.0)
    # --- data ---
    dataset_path: Optional[str] = doc("A *_clean.jsonl file, a folder of them, or a Hub dataset id. Required.")
    revision: Optional[str] = doc("Hub revision of the dataset; pin it for reproducible data.")
    streaming: bool = doc("causal_lm: read and tokenise records as training consumes them (needs max_steps). "
                          "sft (gpt4all compatibility): tokenise in this process (num_proc=1).", False)
    num_proc: int = doc("Processes for tokenisation; capped at the machine's cores.", 4)
    max_length: int = doc("Longest tokenised example; longer ones are truncated (prompt end kept).", 1024)
    prompt_template: str = doc("'plain' (prompt + newline), 'chat' (the tokenizer's chat template) or 'auto'.", "auto")
    val_fraction: float = doc("Share of the data held out for validation.", 0.05)
    packing: bool = doc("Pack each micro-batch's examples into rows of up to max_length (none split; attention and "
                        "positions restart per example). The steps train on the same examples as without.", False)
    group_by_length: bool = doc("Batch examples of similar length together (sorted within random groups of 16 "
                                "steps), so batches pad less; epochs still shuffle.", False)
    # --- optimisation ---
    batch_size: int = doc("Micro-batch size per process.", 8)
    gradient_accumulation_steps: int = doc("Micro-batches per optimiser step.", 1)
    lr: float = doc("Peak learning rate.", 2.0e-5)
    min_lr: float = doc("Learning rate at the last step (cosine ends here).", 0.0)
    warmup_steps: int = doc("Linear warmup length in optimiser steps.", 100)
    lr_schedule: str = doc("'cosine': warmup, then cosine to min_lr at the last step. 'gpt3' (mesh-transformer-jax): "
                           "warmup, then a half-cosine to end_lr over anneal_steps, then end_lr.", "cosine")
    anneal_steps: Optional[int] = doc("gpt3 schedule: optimiser steps of the half-cosine after warmup (required "
                                      "for gpt3; `plan` suggests one).")
    end_lr: float = doc("gpt3 schedule: the learning rate after annealing, kept until the run ends.", 0.0)
    weight_decay: float = doc("Decoupled weight decay; biases, norms and embeddings are exempt.", 0.0)
    max_grad_norm: Optional[float] = doc("Clip the global gradient norm to this; unset disables clipping.", 1.0)
    num_epochs: int = doc("Passes over the training data.", 1)
    max_steps: Optional[int] = doc("Stop after this many optimiser steps (for short runs).")
    seed: int = doc("Seed for the split, the data order and initialisation.", 42)
    nan_policy: str = doc("A step whose loss is NaN or infinite: 'stop' ends the run with an error naming the step; "
                          "'skip' drops that step's update (gradients zeroed, the step still counts) and counts it "
                          "as skipped_steps in metrics.jsonl and the summary.", "stop")
    ddp_timeout_s: Optional[int] = doc("Several processes: seconds a rank waits in a collective for the others "
                                       "before it stops with an error (a rank that died or hangs); unset: torch's "
                                       "default (NCCL 10 min, gloo 30 min).")
    # --- evaluation, checkpoints, logging ---
    eval_every: Optional[int] = doc("Validate every N optimiser steps (and at the end); unset: only at the end.", 500)
    eval_steps: Optional[int] = doc("At most this many validation batches; unset: all.")
    save_every: Optional[int] = doc("Checkpoint every N optimiser steps; unset: no intermediate checkpoints.", 500)
    keep_last: Optional[int] = doc("Keep the newest N checkpoints; unset keeps all.", 2)
    keep_every: Optional[int] = doc("Also keep, permanently, the checkpoints at multiples of N steps.")
    output_dir: str = doc("Where checkpoints, final/, metrics.jsonl and report.html go.", "ckpts/run")
    checkpoint: Optional[str] = doc("A step_N folder to resume from.")
    resume: Optional[str] = doc("'auto': resume from the newest complete checkpoint in output_dir, or start "
                                "fresh when there is none. Unset: start fresh (checkpoint=PATH still resumes).")
    log_every: int = doc("Log training metrics every N optimiser steps.", 1)
    log_grads_every: Optional[int] = doc("With wandb: log gradient histograms every N steps.", 100)
    log_lr_every: Optional[int] = doc("gpt4all compatibility; the lr is logged with every training row.", 1)
    report_to: list[str] = doc("Any of wandb, tensorboard, jsonl.", factory=lambda: ["jsonl"])
    wandb: bool = doc("gpt4all compatibility: same as adding 'wandb' to report_to.", False)
    wandb_entity: Optional[str] = doc("wandb entity (team or user).")
    wandb_project_name: Optional[str] = doc("wandb project.", "gpt4all-training")
    # --- publishing ---
    push_to_hub: bool = doc("Push final/ to the Hub as save_name when training succeeds.", False)
    save_name: Optional[str] = doc("Hub repo id for push_to_hub.")

    def __post_init__(self) -> None:
        if self.wandb and "wandb" not in self.report_to:
            self.report_to = [*self.report_to, "wandb"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


REQUIRED = ("model_name", "dataset_path")


def config_fields(cls: type = TrainConfig) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the field type `tp`, converting where YAML is ambiguous (`5e-5` is a string in YAML 1.1)."""
    base, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise UserError(f"{key}: must not be empty (expected {_type_name(base)})")
    if base is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{key}: expected true or false, got {shown(value)}")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        # YAML 1.1 reads `1e3` as a string and `1000.0` as a float; both are fine as long as they are whole.
        number = _number(value)
        if number is not None and number.is_integer():
            return int(number)
        raise UserError(f"{key}: expected an integer, got {shown(value)}")
    if base is float:
        number = _number(value)
        if number is None:
            raise UserError(f"{key}: expected a number, got {shown(value)}")
        return number
    if base is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"{key}: expected a string, got {shown(value)}")
    if base is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise UserError(f"{key}: expected a mapping of name: value, got {shown(value)}")
        return dict(value)
    if typing.get_origin(base) is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserError(f"{key}: expected a list of strings, got {shown(value)}")
        return list(value)
    raise TypeError(f"unsupported config type for {key}: {tp}")  # a bug in the dataclass, not user input


def shown(value: Any) -> str:
    """`value` for an error line: repr, cut short (a YAML alias can make a list of millions from a few lines)."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 160
    short.maxlist = short.maxdict = 4
    short.maxlevel = 2
    return short.repr(value)


def _number(value: Any) -> float | None:
    """`value` as a float when it is a number or a numeric string (`5e-5` is a string in YAML 1.1), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def validate(config: TrainConfig) -> TrainConfig:
    """Range checks that types alone cannot express. Raises UserError naming the key."""
    c = config
    for key in REQUIRED:
        if not getattr(c, key) and not (key == "model_name" and c.init == "from_config"):
            raise UserError(f"{key}: missing; set it in the config or on the command line as {key}=...")
    checks = [
        ("lr", c.lr > 0 and math.isfinite(c.lr), "must be > 0"),
        ("min_lr", 0 <= c.min_lr <= c.lr, f"must be between 0 and lr ({c.lr})"),
        ("max_length", c.max_length >= 2, "must be at least 2"),
        ("batch_size", c.batch_size >= 1, "must be at least 1"),
        ("gradient_accumulation_steps", c.gradient_accumulation_steps >= 1, "must be at least 1"),
        ("num_epochs", c.num_epochs >= 1, "must be at least 1"),
        ("warmup_steps", c.warmup_steps >= 0, "must be >= 0"),
        ("lr_schedule", c.lr_schedule in ("cosine", "gpt3"), "must be 'cosine' or 'gpt3'"),
        ("anneal_steps", c.anneal_steps is not None and c.anneal_steps >= 1 if c.lr_schedule == "gpt3"
         else c.anneal_steps is None or c.anneal_steps >= 1, "must be at least 1 (lr_schedule: gpt3 needs it)"),
        ("end_lr", 0 <= c.end_lr <= c.lr, f"must be between 0 and lr ({c.lr})"),
        ("weight_decay", c.weight_decay >= 0, "must be >= 0"),
        ("val_fraction", 0 <= c.val_fraction < 1, "must be in [0, 1)"),
        ("num_proc", c.num_proc >= 1, "must be at least 1"),
        ("lora_r", c.lora_r >= 1, "must be at least 1"),
        ("lora_dropout", 0 <= c.lora_dropout < 1, "must be in [0, 1)"),
        ("dtype", c.dtype in DTYPES, f"must be one of {', '.join(DTYPES)}"),
        ("prompt_template", c.prompt_template in ("auto", "plain", "chat"), "must be auto, plain or chat"),
        ("max_grad_norm", c.max_grad_norm is None or c.max_grad_norm > 0, "must be > 0 (or unset to disable)"),
        ("nan_policy", c.nan_policy in ("stop", "skip"), "must be 'stop' or 'skip'"),
        ("ddp_timeout_s", c.ddp_timeout_s is None or c.ddp_timeout_s >= 1, "must be at least 1 (or unset)"),
        ("max_steps", c.max_steps is None or c.max_steps >= 1, "must be at least 1"),
        ("keep_last", c.keep_last is None or c.keep_last >= 1, "must be at least 1"),
        ("keep_every", c.keep_every is None or c.keep_every >= 1, "must be at least 1 (or unset)"),
        ("resume", c.resume in (None, "auto"), "must be 'auto' or unset; to resume from a folder use checkpoint=PATH"),
        ("eval_steps", c.eval_steps is None or c.eval_steps >= 1, "must be at least 1"),
        ("push_to_hub", not c.push_to_hub or bool(c.save_name), "needs save_name (the Hub repo id)"),
        ("objective", c.objective in ("sft", "causal_lm"), "must be 'sft' or 'causal_lm'"),
        ("init", c.init in ("pretrained", "from_config"), "must be 'pretrained' or 'from_config'"),
        ("init", c.init == "pretrained" or c.objective == "causal_lm", "from_config needs objective: causal_lm"),
        ("init", c.init == "pretrained" or not c.lora, "from_config trains every weight; set lora: false"),
        ("model_config", c.init == "pretrained" or bool(c.model_config or c.model_name),
         "init from_config needs model_config (a folder, a model type such as gptj, or a Hub id)"),
        ("tokenizer_name", c.init == "pretrained" or bool(c.tokenizer_name or c.model_name),
         "init from_config needs tokenizer_name (e.g. a folder written by `gpt4all-training tokenizer`)"),
        ("packing", c.objective == "sft" or not c.packing, "causal_lm rows are already max_length long; set false"),
        ("group_by_length", c.objective == "sft" or not c.group_by_length, "causal_lm rows all have one length"),
        ("max_steps", c.objective == "sft" or not c.streaming or c.max_steps is not None,
         "streaming causal_lm needs max_steps (a stream's length is unknown until it ends)"),
        ("shuffle_buffer", c.shuffle_buffer >= 1, "must be at least 1 (1 keeps the stream's order)"),
        ("z_loss", c.z_loss >= 0 and math.isfinite(c.z_loss), "must be >= 0"),
    ]
    checks.append(("log_every", c.log_every >= 1, "must be at least 1"))
    for key in ("eval_every", "save_every", "log_grads_every", "log_lr_every"):
        value = getattr(c, key)
        checks.append((key, value is None or value >= 1, "must be at least 1 (or unset to disable)"))
    for key, ok, message in checks:
        if not ok:
            raise UserError(f"{key}: {message}, got {getattr(c, key)!r}")
    unknown = [r for r in c.report_to if r not in REPORTERS]
    if unknown:
        raise UserError(f"report_to: unknown tracker {unknown[0]!r}; choose from {', '.join(REPORTERS)}")
    return c


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`key=value` strings from the command line; values are parsed as YAML scalars, then typed by the field."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UserError(f"override {pair!r}: expected key=value, for example lr=1e-4")
        key, raw = pair.split("=", 1)
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config {path}: file not found; pass an existing YAML file to --config")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise UserError(f"config {path}: not valid YAML{where}; check the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config {path}: expected a mapping of key: value at the top level")
    return data


def check_keys(values: dict[str, Any], cls: type, source: str) -> None:
    """Reject the first key `cls` does not have, suggesting the closest valid name."""
    fields = config_fields(cls)
    for key in values:
        if not isinstance(key, str) or key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            name = key if isinstance(key, str) and key.isprintable() and len(key) <= 80 else shown(key)
            raise UserError(f"{name}: unknown key in {source}{hint}")


def build_config(values: dict[str, Any], cls: type = TrainConfig, source: str = "config") -> Any:
    check_keys(values, cls, source)
    hints = typing.get_type_hints(cls)
    return cls(**{key: coerce(key, value, hints[key]) for key, value in values.items()})


def load_config(path: str | Path | None, overrides: list[str] | None = None, cls: type = TrainConfig,
                check: Any = validate) -> Any:
    """Read the YAML at `path` (if any), apply `key=value` overrides, type-check and validate."""
    values = read_yaml(path) if path else {}
    from_command_line = parse_overrides(overrides or [])
    # Check each source on its own, so an unknown key's error says where it was written.
    check_keys(values, cls, str(path))
    check_keys(from_command_line, cls, "the command-line overrides")
    config = build_config({**values, **from_command_line}, cls)
    return check(config) if check else config


def save_config(config: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False), encoding="utf-8")
