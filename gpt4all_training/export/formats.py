"""The export formats, one entry each in FORMATS: what `--format` offers, the weight types each takes, and the module
that writes it.

A new format is one entry here plus its own module with `write(source, folder, request) -> Written` and, where a
model can be refused before its weights load, `check(model_config, dtype)`. Everything else reads this table: the
CLI's `--format` and `--dtype` choices and their help, the validation of a request (`chosen_dtype`), the studio's
export form (`described()`) and docs/export.md (tests/test_export.py checks that it lists exactly these formats).
The writers are named as "module:function" and imported when an export runs, so the table loads without torch.
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from gpt4all_training.errors import UserError

if TYPE_CHECKING:  # torch loads with the writers, not with the table
    from gpt4all_training.export.agreement import Agreement


@dataclass(frozen=True)
class ExportFormat:
    name: str  # what --format takes
    help: str  # what the format is for, in a few words
    dtypes: tuple[str, ...]  # the weight types it writes (--dtype)
    default_dtype: str
    writer: str  # "module:function" that writes the export into a folder
    check: str | None  # "module:function" that refuses a model config before the weights load
    card_tag: str  # the model card's tag, as the Hub files models

    def write(self) -> Callable[[ExportSource, Path, ExportRequest], Written]:
        return pkgutil.resolve_name(self.writer)

    def refuse(self, model_config: Any, dtype: str) -> None:
        """Raise a UserError for a model (by its config) or a type this format cannot write."""
        if self.check:
            pkgutil.resolve_name(self.check)(model_config, dtype)


FORMATS = {spec.name: spec for spec in (
    ExportFormat("hf", "safetensors folder for transformers", ("f32", "f16", "bf16"), "bf16",
                 "gpt4all_training.export.hf:write_hf", None, "safetensors"),
    ExportFormat("gguf", "one file for llama.cpp and GPT4All",
                 ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"), "q8_0",
                 "gpt4all_training.export.gguf:write_export", "gpt4all_training.export.gguf:check_architecture",
                 "gguf"),
)}


def format_named(name: str, key: str = "--format") -> ExportFormat:
    if name not in FORMATS:
        raise UserError(f"{key}: must be {' or '.join(FORMATS)}, got {name!r}")
    return FORMATS[name]


def chosen_dtype(spec: ExportFormat, dtype: str | None) -> str:
    """The weight type an export writes: `dtype`, or the format's default; a type the format does not take is one
    line."""
    if dtype is None:
        return spec.default_dtype
    if dtype not in spec.dtypes:
        raise UserError(f"--dtype {dtype}: --format {spec.name} takes one of {', '.join(spec.dtypes)}")
    return dtype


def all_dtypes() -> tuple[str, ...]:
    """Every format's weight types, each once, in the table's order."""
    return tuple(dict.fromkeys(dtype for spec in FORMATS.values() for dtype in spec.dtypes))


def format_help() -> str:
    return "; ".join(f"{spec.name}: {spec.help}" for spec in FORMATS.values())


def dtype_help() -> str:
    return "weight type; " + "; ".join(f"{spec.name} takes {', '.join(spec.dtypes)} (default {spec.default_dtype})"
                                       for spec in FORMATS.values())


def described() -> list[dict[str, Any]]:
    """The table for a form (the studio's export page): each format's name, help, weight types and default."""
    return [{"name": spec.name, "help": spec.help, "dtypes": list(spec.dtypes), "default_dtype": spec.default_dtype}
            for spec in FORMATS.values()]


# ---------------------------------------------------------------- what a writer is given and gives back

@dataclass
class RunInfo:
    """What the training run left next to the checkpoint: its config, progress and last logged losses."""

    config: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)
    last_logged_step: int | None = None

    @property
    def steps(self) -> int | None:
        return self.state.get("step", self.last_logged_step)


@dataclass
class ExportSource:
    model: Any  # an fp32 AutoModelForCausalLM with any LoRA already merged
    tokenizer: Any
    base_name: str | None  # the model that was fine-tuned, as the run named it
    run: RunInfo
    license: dict[str, str]
    merge_note: str | None = None  # a QLoRA run's: the dequantized base plus the adapter, and the gap measured

    @property
    def base_gguf(self) -> Path | None:
        path = Path(self.base_name) if self.base_name else None
        return path if path and path.suffix == ".gguf" and path.is_file() else None


@dataclass(frozen=True)
class ExportRequest:
    name: str  # the export's name: --to's folder name
    dtype: str
    max_shard_size: str  # hf: the largest weight file


@dataclass
class Written:
    card: list[str] = field(default_factory=list)  # lines the model card ends with
    agreement: Agreement | None = None  # a GGUF's, with the merged model it was written from
