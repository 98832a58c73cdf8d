"""`gpt4all-training check --config c.yaml [key=value ...]`: pre-flight checks before a long run.

Each check prints one line: `ok    what: detail`, or `FAIL  what: what to fix`. The checks are the mistakes that
otherwise surface hours into a run, or never: an invalid config, a dataset line without its fields, a tokenizer
from another model (ids past the embedding, or another EOS), a checkpoint folder given as model_name, an
output_dir that cannot take a checkpoint, a tracker that is not installed, a max_length or batch that cannot fit.
Last, a 2-step dry run of the real `train()` on 2 examples, in a temporary output_dir, measures tokens/s and peak
memory. Exit code 0 when everything passes, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import os
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gpt4all_training.backends.precision import concrete_dtype
from gpt4all_training.config.blocks import DataSource, Logging, ModelSource, validate
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.chat import unrendered_conversations
from gpt4all_training.data.records import finetune_records
from gpt4all_training.errors import TrainingError, UserError
from gpt4all_training.model.from_config import resolve_model_config
from gpt4all_training.model.loading import adapter_base, is_adapter_folder, model_source, tokenizer_for
from gpt4all_training.preflight.plan import (
    checkpoint_bytes,
    existing_parent,
    memory_per_gpu,
    model_config_of,
    model_shape,
    size,
)
from gpt4all_training.run_folder import METRICS_FILE, MODEL_DIR
from gpt4all_training.tracking.tracker import read_metrics
from gpt4all_training.training.loop import train
from gpt4all_training.training.objectives import objective_for
from gpt4all_training.training.objectives.protocol import ObjectiveChecks, RecordScan

GIB = 2**30
TRACKER_MODULES = {"wandb": "wandb", "tensorboard": "tensorboard"}
DRY_RUN_EXAMPLES = 2
# Records of a streamed causal_lm dataset that are checked.
STREAM_CHECK_RECORDS = 10_000
# causal_lm's dry run reads records until their text is this many times max_length in characters: two or more rows.
DRY_RUN_TEXT_FACTOR = 8
DRY_RUN_STEPS = 2


@dataclass
class Outcome:
    name: str
    ok: bool
    message: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.name}: {self.message}"


def passed(name: str, message: str) -> Outcome:
    return Outcome(name, True, message)


def failed(name: str, message: str) -> Outcome:
    return Outcome(name, False, message)


def first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


# ---------------------------------------------------------------- config

def check_config(path: Optional[str], overrides: list[str]) -> tuple[Any, list[Outcome]]:
    """The config, typed; validation failures are reported but the other checks still run on it."""
    try:
        config = load_config(path, overrides, check=None)
    except UserError as exc:
        return None, [failed("config", str(exc))]
    try:
        validate(config)
    except UserError as exc:
        return config, [failed("config", str(exc))]
    return config, [passed("config", f"{path} is valid")]


# ---------------------------------------------------------------- dataset

def check_dataset(config: TrainConfig, objective: ObjectiveChecks) -> tuple[Outcome, RecordScan | None]:
    """Every record has the fields training reads; returns what the objective read, with the sample for the dry
    run: the first DRY_RUN_EXAMPLES examples, or for causal_lm the first records with text enough for two rows or
    more."""
    if not config.dataset_path:
        return failed("dataset", "dataset_path is not set"), None
    try:
        scan = objective.scan_records(config, DRY_RUN_EXAMPLES, DRY_RUN_TEXT_FACTOR, STREAM_CHECK_RECORDS)
    except UserError as exc:
        return failed("dataset", str(exc)), None
    if scan.count == 0:
        return failed("dataset", f"dataset_path {config.dataset_path}: no records"), None
    return passed("dataset", f"{config.dataset_path}: {scan.count:,} records, all with {scan.fields}"), scan


# ---------------------------------------------------------------- model and tokenizer

def check_model_name(config: ModelSource) -> Outcome:
    name = config.model_name
    assert name is not None  # run_checks asks only when it is set
    if is_adapter_folder(name):
        base = adapter_base(name)
        try:
            model_source(base)
        except UserError:
            return failed("model_name", f"{name} is a LoRA adapter whose base model {base} is not found; give its "
                                        f"base as model_name, or fix base_model_name_or_path in adapter_config.json")
        return passed("model_name", f"{name} is a LoRA adapter folder; it loads as its base {base} plus the adapter")
    path = Path(name).expanduser()
    if path.is_dir() and not (path / "config.json").is_file() and not config.gguf_file:
        hint = f"; did you mean {path / MODEL_DIR}?" if (path / MODEL_DIR / "config.json").is_file() else ""
        return failed("model_name", f"{name} has no config.json (not a model folder){hint}")
    try:
        model_source(name, config.gguf_file)
    except UserError as exc:
        return failed("model_name", str(exc))
    return passed("model_name", f"{name}")


def token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return set(value) if isinstance(value, (list, tuple)) else {value}


def tokenizer_problems(tokenizer, model_config, max_length: int, from_scratch: bool) -> list[str]:
    """What makes this tokenizer (or max_length) wrong for this model, one sentence each."""
    problems = []
    text = model_config.get_text_config()
    vocab = getattr(text, "vocab_size", None)
    if not from_scratch and vocab is not None and len(tokenizer) > vocab:
        problems.append(f"the tokenizer has {len(tokenizer):,} tokens but the model's vocabulary is {vocab:,}: ids "
                        f"past it index outside the embedding; use the model's own tokenizer (unset tokenizer_name)")
    for kind in ("eos", "bos"):
        model_ids = token_ids(getattr(model_config, f"{kind}_token_id", None))
        token_id = getattr(tokenizer, f"{kind}_token_id")
        if not from_scratch and model_ids and token_id is not None and token_id not in model_ids:
            token = getattr(tokenizer, f"{kind}_token")
            problems.append(f"the tokenizer's {kind.upper()} is id {token_id} ({token!r}) but the model's "
                            f"{kind}_token_id is {sorted(model_ids)[0]}: the tokenizer belongs to another model; use "
                            f"the model's own tokenizer")
    positions = getattr(text, "max_position_embeddings", None)
    if positions and max_length > positions:
        problems.append(f"max_length {max_length} exceeds the model's {positions} positions; set max_length to at "
                        f"most {positions}")
    return problems


def check_tokenizer(config: TrainConfig, tokenizer, model_config) -> Outcome:
    from_scratch = config.init == "from_config"
    problems = tokenizer_problems(tokenizer, model_config, config.max_length, from_scratch)
    if problems:
        return failed("tokenizer", "; ".join(problems))
    if from_scratch:
        return passed("tokenizer", f"{len(tokenizer):,} tokens, EOS {tokenizer.eos_token!r}: the new model's "
                                   f"vocabulary and special tokens")
    return passed("tokenizer", f"{len(tokenizer):,} tokens, EOS {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}) "
                               f"match the model")


# ---------------------------------------------------------------- memory and disk

def check_chat_template(config: DataSource, tokenizer) -> Outcome:
    """The chat template writes every message and tool call of every conversation: a part it leaves out would be
    trained as an answer without it (a tool call as an empty answer)."""
    assert config.dataset_path is not None  # validate() refuses a config without it
    try:
        count, refusal = unrendered_conversations(tokenizer, finetune_records(config.dataset_path))
    except UserError as exc:
        return failed("chat template", str(exc))
    if refusal:
        return failed("chat template", refusal)
    return passed("chat template", f"renders every message and tool call of {count:,} conversations")


def device_memory() -> tuple[float, str]:
    """Bytes of memory a single process trains in: the GPU's, or without one the machine's RAM."""
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory), "GPU"
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")), "RAM"


def memory_problem(config: TrainConfig, estimate, available: float, where: str) -> Optional[str]:
    """A sentence when the estimate (plan.Memory) exceeds `available` bytes, else None."""
    states = estimate.weights + estimate.gradients + estimate.optimizer
    if states > available:
        # ZeRO-3 refuses a frozen copy of the weights (no process holds a whole model to copy): no way out for a run
        # that keeps one.
        way = "use lora: true (the reference is then the base with the adapter off)" if estimate.reference else \
            "use lora: true or DeepSpeed ZeRO-3 across GPUs"
        return (f"the weights, gradients and Adam states alone need {states / GIB:.1f} GiB but the {where} has "
                f"{available / GIB:.1f} GiB; {way}")
    if estimate.total > available:
        return (f"batch_size {config.batch_size} x max_length {config.max_length} needs about "
                f"{estimate.total / GIB:.1f} GiB ({estimate.activations / GIB:.1f} GiB of activations) but the "
                f"{where} has {available / GIB:.1f} GiB; lower batch_size (raise gradient_accumulation_steps to keep "
                f"the global batch) or max_length, or set gradient_checkpointing: true")
    return None


def check_memory(config: TrainConfig, objective: ObjectiveChecks, shape) -> Outcome:

    sequences = objective.rows_per_example * config.batch_size
    estimates = memory_per_gpu(shape, sequences, config.max_length, concrete_dtype(config.dtype), 1,
                               config.gradient_checkpointing, objective.reference_copies)
    mode = "LoRA" if config.lora else "full (DDP)"
    available, where = device_memory()
    problem = memory_problem(config, estimates[mode], available, where)
    if problem:
        return failed("memory", problem)
    what = "LoRA" if config.lora else "full fine-tuning"
    return passed("memory", f"about {size(estimates[mode].total)} of the {where}'s {size(available)} "
                            f"({what}, batch {sequences} x {config.max_length}; `plan` shows the formula)")


def writable_folder(path: Path) -> Optional[str]:
    """None if a file can be created where `path` is (or would be created), else why not."""

    existing = existing_parent(path)
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return f"{existing} is not writable ({exc.strerror or type(exc).__name__})"
    return None


def room_problem(free: float, needed: float) -> Optional[str]:

    if free < needed:
        return (f"{size(free)} free but one checkpoint needs about {size(needed)} (fp32 weights and "
                f"Adam states); free some space or choose another output_dir")
    return None


def check_output_dir(config: TrainConfig, shape) -> Outcome:

    path = Path(config.output_dir)
    problem = writable_folder(path)
    if problem:
        return failed("output_dir", f"{config.output_dir}: {problem}; choose another output_dir")
    if shape is None:
        return passed("output_dir", f"{config.output_dir} is writable (checkpoint size unknown)")
    needed = checkpoint_bytes(shape, config.lora)
    free = shutil.disk_usage(existing_parent(path)).free
    problem = room_problem(free, needed)
    if problem:
        return failed("output_dir", f"{config.output_dir}: {problem}")
    return passed("output_dir", f"{config.output_dir} is writable; {size(free)} free, a checkpoint takes about "
                                f"{size(needed)}")


def check_trackers(config: Logging) -> list[Outcome]:
    outcomes = []
    for tracker in config.report_to:
        module = TRACKER_MODULES.get(tracker)
        if module is None:
            continue
        try:
            importlib.import_module(module)
        except ImportError:
            outcomes.append(failed("report_to", f"{tracker} is requested but not installed; pip install {module}, or "
                                                f"remove it from report_to"))
        else:
            outcomes.append(passed("report_to", f"{tracker} is installed"))
    return outcomes


# ---------------------------------------------------------------- the dry run

def dry_run_config(config: TrainConfig, objective: ObjectiveChecks, data_dir: Path, output_dir: Path):
    """The config on DRY_RUN_EXAMPLES examples for DRY_RUN_STEPS steps: no evaluation, saves, trackers or Hub, and
    the tokenized sample cached in the temporary output_dir, not in a shared cache_dir."""
    data_file = data_dir / objective.dry_run_file
    changes: dict[str, Any] = dict(
        dataset_path=str(data_file), revision=None, output_dir=str(output_dir), cache_dir=None,
        max_steps=DRY_RUN_STEPS, num_epochs=DRY_RUN_STEPS, batch_size=1, gradient_accumulation_steps=1,
        val_fraction=0.0, eval_every=None, save_every=None, report_to=["jsonl"], wandb=False,
        push_to_hub=False, resume=None, checkpoint=None, group_by_length=False, num_proc=1)
    return validate(dataclasses.replace(config, **changes)), data_file


def dry_run(config: TrainConfig, objective: ObjectiveChecks, scan: RecordScan) -> Outcome:
    sample = scan.sample
    if len(sample) < scan.min_sample:
        return failed("dry run", f"needs {DRY_RUN_EXAMPLES} records with text; the dataset has {len(sample)}")
    with tempfile.TemporaryDirectory(prefix="gpt4all-check-") as tmp:
        log = io.StringIO()  # train()'s own output; the outcome line says what matters
        try:
            dry, data_file = dry_run_config(config, objective, Path(tmp), Path(tmp) / "out")
            data_file.write_text("".join(json.dumps(r) + "\n" for r in sample), encoding="utf-8")
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                summary = train(dry)
        except (UserError, TrainingError) as exc:
            return failed("dry run", str(exc))
        except Exception as exc:  # an out-of-memory error or a model that cannot train: say which, in one line
            return failed("dry run", f"{type(exc).__name__}: {first_line(exc)}")
        rows = [r for r in read_metrics(Path(tmp) / "out" / METRICS_FILE) if "loss" in r]
    speed = statistics.median(r["tokens_per_s"] for r in rows)
    memory = f"peak RSS {summary['peak_rss_mb']:,.0f} MiB"
    if "peak_gpu_mb" in summary:
        memory += f", peak GPU {summary['peak_gpu_mb']:,.0f} MiB"
    losses = " -> ".join(f"{r['loss']:.4f}" for r in rows)
    return passed("dry run", f"{summary['steps']} steps on {objective.dry_run_size(summary, sample)} passed "
                             f"(loss {losses}); {speed:,.0f} tokens/s at batch 1, {memory}")


# ---------------------------------------------------------------- all of it

def run_checks(config_path: Optional[str], overrides: list[str], report=print) -> list[Outcome]:
    """Every check, each reported as it finishes. The dry run only runs when everything before it passed."""
    outcomes: list[Outcome] = []

    def record(*new: Outcome) -> None:
        for outcome in new:
            outcomes.append(outcome)
            report(outcome.line())

    config, config_outcomes = check_config(config_path, overrides)
    record(*config_outcomes)
    if config is None:
        return outcomes
    objective = objective_for(config)
    dataset_outcome, scan = check_dataset(config, objective)
    record(dataset_outcome)
    shape = None
    if config.init == "from_config":
        shape = model_checks(config, objective, record, scan)
    elif config.model_name:
        record(check_model_name(config))
        if outcomes[-1].ok:
            shape = model_checks(config, objective, record, scan)
    record(check_output_dir(config, shape))
    record(*check_trackers(config))
    if all(o.ok for o in outcomes) and scan is not None:  # a dataset that passed was scanned
        record(dry_run(config, objective, scan))
    return outcomes


def model_checks(config: TrainConfig, objective: ObjectiveChecks, record, scan: RecordScan | None):
    """Tokenizer, chat template (for conversations) and memory checks (and for init from_config, the config the
    model is built from); returns the model's shape (for the checkpoint size) or None."""

    from_scratch = config.init == "from_config"
    try:
        tokenizer = tokenizer_for(config)
    except UserError as exc:
        record(failed("tokenizer", str(exc)))
        return None
    name = "model_config" if from_scratch else "model"
    try:
        model_config = resolve_model_config(config, tokenizer) if from_scratch else model_config_of(config)
        shape = model_shape(config, model_config)
    except UserError as exc:
        record(failed(name, str(exc)))
        return None
    if from_scratch:
        record(passed(name, f"{model_config.model_type} with {shape.layers} layers, width {shape.hidden}: "
                            f"{shape.parameters:,} parameters, vocabulary {shape.vocab:,} (the tokenizer's)"))
    record(check_tokenizer(config, tokenizer, model_config))
    if scan is not None and scan.conversations:
        record(check_chat_template(config, tokenizer))
    if config.batch_size >= 1 and config.max_length >= 1:
        record(check_memory(config, objective, shape))
    return shape
