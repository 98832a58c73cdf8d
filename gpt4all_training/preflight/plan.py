"""`gpt4all-training plan --config c.yaml [--gpus N] [--tokens-per-second X]`: the arithmetic of a run, before it.

Everything is computed from the config and the actual tokenised data, by what the training loop uses: the
objective's data and sampler (training/objectives/), `total_optimizer_steps` for the run's length,
`learning_rate` for the schedule and `pack_rows` for packing (training/counts.py). So the planned steps, examples
and trained tokens are the ones `train.py` then takes, for any number of processes.

Memory is an estimate: exact bytes per parameter for weights, gradients and Adam states, and a published
approximation for activations (the formulas are printed with the numbers).
"""

from __future__ import annotations

import math
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from gpt4all_training.backends.accelerate import launched_world_size
from gpt4all_training.config.blocks import ModelSource
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import UserError
from gpt4all_training.model.from_config import resolve_model_config
from gpt4all_training.model.loading import (TOKENIZER_FILES, adapter_base, is_adapter_folder, model_source,
                                            tokenizer_for)
from gpt4all_training.model.names import is_local
from gpt4all_training.model.lora import apply_lora
from gpt4all_training.model.parameters import count_parameters
from gpt4all_training.model.quantization import (bytes_per_weight, describe_settings, is_quantizing,
                                                 quantization_settings)
from gpt4all_training.run_folder import METRICS_FILE
from gpt4all_training.tracking.tracker import read_metrics
from gpt4all_training.training.counts import DataPlan, TokenCounts
from gpt4all_training.training.loss import CHUNK_ELEMENTS
from gpt4all_training.training.objectives import objective_for
from gpt4all_training.training.objectives.protocol import Objective
from gpt4all_training.training.schedule import learning_rate, schedule_notes, total_optimizer_steps

GIB = 2**30


def size(n_bytes: float) -> str:
    """Bytes for people: GiB from 1 GiB up, MiB below (tiny models would all read 0.00 GiB)."""
    return f"{n_bytes / GIB:.2f} GiB" if n_bytes >= GIB else f"{n_bytes / 2**20:.1f} MiB"

MEMORY_FORMULAS = (
    "memory per GPU = weights + gradients + Adam states + activations (bytes per parameter P, trainable T, N GPUs):\n"
    "  full (DDP): 4P + 4P + 8P (fp32 master weights; autocast's bf16/fp16 copies are transient)\n"
    "  LoRA:       4P + 4T + 8T (the frozen base in fp32)\n"
    "  ZeRO-2:     fp32: 4P + 4P/N + 8P/N;  bf16/fp16: 2P + 2P/N + 12P/N (12 = fp32 master + 2 Adam moments)\n"
    "  ZeRO-3:     fp32: (4P + 4P + 8P)/N;  bf16/fp16: (2P + 2P + 12P)/N (plus one layer gathered at a time)\n"
    "  FSDP2:      (4P + 4P + 8P)/N in any dtype (fp32 master weights, autocast computes; plus one layer gathered)\n"
    "  activations (Korthikanti et al. 2022, micro-batch b, length s = max_length, width h, heads a, L layers,\n"
    "  B bytes per value): L*s*b*h*(34 + 5*a*s/h)*B/2; with gradient checkpointing L*s*b*h*B plus one layer;\n"
    "  plus the loss head's logits chunk (at most 8M fp32 values and their gradient). An upper bound with\n"
    "  flash/SDPA attention, which never stores the a*s*s scores. dpo: b is 2 x batch_size (both answers), and\n"
    "  reference: frozen_copy (and grpo's beta > 0 in full fine-tuning) adds 4P (full and ZeRO-2; ZeRO-3 and FSDP2\n"
    "  refuse it, so no ZeRO-3 or FSDP2 line).")
QUANTIZED_FORMULAS = (
    "quantized base (load_in_4bit / load_in_8bit), Q of the P parameters in its linear layers, stored in q bytes\n"
    "  each (4-bit: 0.5 + one absmax per 64 weights, 1/64 with double quantization + 4/(64*256), else 4/64; 8-bit:\n"
    "  1 + 4/inputs), the rest (embeddings, norms, output head, adapter) in fp32, plus one layer's weight\n"
    "  dequantized in the compute dtype (c bytes) while it runs; LoRA trains T:\n"
    "  1 process, DDP: qQ + 4(P - Q) + c*largest + 4T + 8T\n"
    "  FSDP2:          (qQ + 4(P - Q))/N + c*largest + (4T + 8T)/N (4-bit only: int8 weights are not sharded)\n"
    "  ZeRO-2:         qQ + 4(P - Q) + c*largest + (4T + 8T)/N;  ZeRO-3 (4-bit only): as FSDP2")


# ---------------------------------------------------------------- the model's shape (no weights loaded)

@dataclass
class ModelShape:
    parameters: int
    lora_trainable: Optional[int]  # adapter parameters when config.lora, else None
    layers: int
    hidden: int
    heads: int
    vocab: int
    quantized: int = 0  # weights in the linear layers a quantized base stores in 4 or 8 bits
    quantized_bytes: float = 0.0  # their storage, quantization constants included
    largest_linear: int = 0  # the weights of the largest of those layers


def model_config_of(config: ModelSource):
    """The transformers config of the run's model, without its weights."""
    from transformers import AutoConfig

    assert config.model_name is not None  # validate() refuses a config without it
    name = adapter_base(config.model_name) if is_adapter_folder(config.model_name) else config.model_name
    source, extra = model_source(name, config.gguf_file)
    try:
        return AutoConfig.from_pretrained(source, revision=config.model_revision,
                                          trust_remote_code=config.trust_remote_code, **extra)
    except (OSError, ValueError) as exc:
        raise UserError(f"model_name {config.model_name}: cannot read its config ({str(exc).splitlines()[0]})") \
            from None


def model_shape(config: TrainConfig, model_config=None) -> ModelShape:
    """Parameter counts of the model (and its LoRA adapter) built on the meta device: exact, and instant."""
    import torch
    from transformers import AutoModelForCausalLM

    model_config = model_config if model_config is not None else model_config_of(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=config.trust_remote_code)
        quantized = quantized_layers(model, quantization_settings(config))
        lora = None
        if config.lora:
            model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout,
                               config.lora_target_modules, False)
            lora = count_parameters(model)[0]
    text = model_config.get_text_config()
    return ModelShape(parameters=count_parameters(model)[1], lora_trainable=lora, layers=text.num_hidden_layers,
                      hidden=text.hidden_size, heads=text.num_attention_heads, vocab=text.vocab_size,
                      quantized=sum(n for n, _ in quantized), quantized_bytes=sum(b for _, b in quantized),
                      largest_linear=max((n for n, _ in quantized), default=0))


def quantized_layers(model, settings) -> list[tuple[int, float]]:
    """(weights, bytes) of each linear layer that `settings` quantize, as transformers' bitsandbytes integration
    picks them: every nn.Linear but the output head (and what is tied to it); none when nothing is quantized."""
    from torch import nn
    from transformers.quantizers.base import get_keys_to_not_convert

    if not is_quantizing(settings):
        return []
    kept = set(get_keys_to_not_convert(model))
    return [(module.weight.numel(), module.weight.numel() * bytes_per_weight(settings, module.in_features))
            for name, module in model.named_modules() if isinstance(module, nn.Linear) and name not in kept]


# ---------------------------------------------------------------- memory (pure)

@dataclass
class Memory:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    reference: float = 0.0  # frozen copies of the weights (dpo's reference: frozen_copy)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.reference


def activation_bytes(shape: ModelShape, micro_batch: int, length: int, dtype: str,
                     gradient_checkpointing: bool) -> float:
    s, b, h, a, layers = length, micro_batch, shape.hidden, shape.heads, shape.layers
    value_bytes = 4 if dtype == "float32" else 2
    one_layer = s * b * h * (34 + 5 * a * s / h) * value_bytes / 2
    blocks = layers * s * b * h * value_bytes + one_layer if gradient_checkpointing else layers * one_layer
    head = 2 * 4 * min(s * b * shape.vocab, max(CHUNK_ELEMENTS, shape.vocab))
    return blocks + head


def memory_per_gpu(shape: ModelShape, micro_batch: int, length: int, dtype: str, gpus: int,
                   gradient_checkpointing: bool, reference_copies: int = 0) -> dict[str, Memory]:
    """The estimates of MEMORY_FORMULAS, in bytes, for each way of training; with `reference_copies` frozen fp32
    copies of the weights where a process holds a whole model to copy (full and ZeRO-2; ZeRO-3 and FSDP2 refuse
    them)."""
    P, N = shape.parameters, gpus
    act = activation_bytes(shape, micro_batch, length, dtype, gradient_checkpointing)
    if shape.quantized:
        return quantized_memory(shape, act, dtype, gpus)
    mixed = dtype != "float32"
    reference = 4 * P * reference_copies
    estimates = {"full (DDP)": Memory(4 * P, 4 * P, 8 * P, act, reference)}
    if shape.lora_trainable is not None:
        T = shape.lora_trainable
        estimates["LoRA"] = Memory(4 * P, 4 * T, 8 * T, act)
    if mixed:
        estimates["ZeRO-2"] = Memory(2 * P, 2 * P / N, 12 * P / N, act, reference)
        zero3 = Memory(2 * P / N, 2 * P / N, 12 * P / N, act)
    else:
        estimates["ZeRO-2"] = Memory(4 * P, 4 * P / N, 8 * P / N, act, reference)
        zero3 = Memory(4 * P / N, 4 * P / N, 8 * P / N, act)
    if not reference_copies:  # ZeRO-3 and FSDP2 refuse a frozen copy: no process holds a whole model to copy
        estimates["ZeRO-3"] = zero3
        estimates["FSDP2"] = Memory(4 * P / N, 4 * P / N, 8 * P / N, act)  # backends/fsdp.py shards fp32 weights
    return estimates


def quantized_memory(shape: ModelShape, activations: float, dtype: str, gpus: int) -> dict[str, Memory]:
    """QUANTIZED_FORMULAS, in bytes, for each launch that can train over a quantized base (LoRA only)."""
    P, Q, T, N = shape.parameters, shape.quantized, shape.lora_trainable or 0, gpus
    base = shape.quantized_bytes + 4 * (P - Q)
    dequantized = (4 if dtype == "float32" else 2) * shape.largest_linear
    estimates = {"QLoRA, 1 process or DDP": Memory(base + dequantized, 4 * T, 8 * T, activations)}
    sharded = Memory(base / N + dequantized, 4 * T / N, 8 * T / N, activations)
    if shape.quantized_bytes < Q:  # 4-bit: FSDP2 and ZeRO-3 shard its storage
        estimates["QLoRA, FSDP2"] = sharded
    estimates["QLoRA, ZeRO-2"] = Memory(base + dequantized, 4 * T / N, 8 * T / N, activations)
    if shape.quantized_bytes < Q:
        estimates["QLoRA, ZeRO-3"] = sharded
    return estimates


# ---------------------------------------------------------------- checkpoints

def checkpoint_bytes(shape: ModelShape, lora: bool) -> int:
    """One step_N/ without DeepSpeed: fp32 weights (the adapter's alone under LoRA) and Adam's two fp32 moments."""
    trainable = shape.lora_trainable if lora and shape.lora_trainable is not None else shape.parameters
    saved = trainable if lora else shape.parameters
    return 4 * saved + 8 * trainable


def checkpoint_steps(total_steps: int, save_every: Optional[int]) -> list[int]:
    """The steps the loop saves step_N/ at (never the last step: final/ is written then)."""
    if not save_every:
        return []
    return [s for s in range(save_every, total_steps, save_every)]


def most_kept(saves: list[int], keep_last: Optional[int], keep_every: Optional[int]) -> int:
    """Most checkpoints left on disk after a save's rotation (checkpoint.rotate: the newest `keep_last`, plus the
    multiples of `keep_every`)."""
    kept: list[int] = []
    most = 0
    for step in saves:
        kept.append(step)
        if keep_last is not None:
            recent = kept[-keep_last:]
            kept = [s for s in kept if s in recent or (keep_every and s % keep_every == 0)]
        most = max(most, len(kept))
    return most


# ---------------------------------------------------------------- the plan

@dataclass
class Plan:
    gpus: int
    micro_batch: int
    accumulation: int
    examples_per_step: int
    train_examples: int
    val_examples: int
    epoch_tokens: int
    epoch_trained: int
    steps_per_epoch: int
    dropped_per_epoch: int
    total_steps: int
    run: TokenCounts
    warmup_steps: int
    suggested_warmup: tuple[int, int]
    suggested_anneal: int
    lr_first_last: tuple[float, float]
    checkpoints: int
    kept_at_most: int
    checkpoint_bytes: float
    final_bytes: float
    shape: ModelShape
    memory: dict[str, Memory]
    tokens_per_second: Optional[float] = None
    throughput_source: str = ""
    gpu_memory: Optional[float] = None  # bytes per GPU to check each estimate against
    quantization: str = ""  # '4-bit nf4, double quantization' when the base is quantized
    notes: list[str] = field(default_factory=list)

    @property
    def disk_bytes(self) -> float:
        # A save writes step_N.tmp before rotation deletes the oldest: one more than are ever kept.
        during = (self.kept_at_most + 1) * self.checkpoint_bytes if self.checkpoints else 0
        return max(during, self.kept_at_most * self.checkpoint_bytes + self.final_bytes)

    @property
    def padding_fraction(self) -> float:
        return 1 - self.run.tokens / max(self.run.padded, 1)

    @property
    def packed_padding_fraction(self) -> float:
        return 1 - self.run.packed_real / max(self.run.packed or 1, 1)

    @property
    def seconds(self) -> Optional[float]:
        return self.run.tokens / self.tokens_per_second if self.tokens_per_second else None

    def describe(self) -> str:
        r = self.run
        sampled = "" if r.packed_sampled * self.micro_batch >= r.examples else \
            f" (measured on the first {r.packed_sampled:,} micro-batches)"
        lines = [
            "data",
            f"  train: {self.train_examples:,} examples, {self.epoch_tokens:,} tokens, {self.epoch_trained:,} trained "
            f"tokens per epoch; validation: {self.val_examples:,} examples",
            f"  this run: {r.examples:,} examples, {r.tokens:,} tokens, {r.trained:,} trained tokens",
            f"  padding fraction: {self.padding_fraction:.4f} without packing, "
            f"{self.packed_padding_fraction:.4f} with packing on a GPU{sampled} (none on a CPU: one row a micro-batch)",
            "steps",
            f"  micro-batch {self.micro_batch} x {self.gpus} GPU(s) x accumulation {self.accumulation} = global batch "
            f"{self.examples_per_step} examples",
            f"  {self.steps_per_epoch:,} optimiser steps per epoch ({self.dropped_per_epoch} examples dropped per "
            f"epoch: the last partial step); {self.total_steps:,} optimiser steps in total",
            f"  warmup_steps {self.warmup_steps} ({100 * self.warmup_steps / max(self.total_steps, 1):.1f}% of "
            f"total); suggested {self.suggested_warmup[0]}-{self.suggested_warmup[1]} (5-10%)",
            f"  anneal_steps for lr_schedule gpt3: {self.suggested_anneal} (reaches end_lr at the last step)",
            f"  lr: {self.lr_first_last[0]:.3g} at step 1, {self.lr_first_last[1]:.3g} at the last step",
            "checkpoints",
            f"  {self.checkpoints} written, at most {self.kept_at_most} kept at once, "
            f"{size(self.checkpoint_bytes)} each (weights + Adam states); final/ {size(self.final_bytes)}; disk "
            f"needed: {size(self.disk_bytes)}",
        ]
        lines.extend(memory_lines(self.shape, self.memory, self.quantization, self.gpu_memory))
        lines.append("time")
        if self.seconds is None:
            lines.append("  unknown: pass --tokens-per-second, or run `gpt4all-training check` (it measures one)")
        else:
            lines.append(f"  {self.seconds / 3600:.2f} h for {r.tokens:,} tokens at {self.tokens_per_second:,.0f} "
                         f"tokens/s ({self.throughput_source})")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


def memory_lines(shape: ModelShape, memory: dict[str, Memory], quantization: str,
                 gpu_memory: Optional[float]) -> list[str]:
    """The "memory per GPU" section: the model's shape, each way of training's estimate (and whether it fits in
    `gpu_memory` bytes, when given), and the formulas."""
    lines = ["memory per GPU (estimates)",
             f"  model: {shape.parameters:,} parameters"
             + (f", LoRA trains {shape.lora_trainable:,}" if shape.lora_trainable is not None else "")
             + f"; {shape.layers} layers, width {shape.hidden}, {shape.heads} heads, vocabulary {shape.vocab:,}"]
    if quantization:
        lines.append(f"  base: {shape.quantized:,} weights in {quantization} ({size(shape.quantized_bytes)}), the "
                     f"rest in fp32")
    for name, m in memory.items():
        fits = "" if gpu_memory is None else \
            f"; {'fits' if m.total <= gpu_memory else 'does not fit'} in {size(gpu_memory)}"
        lines.append(f"  {name:<11} {size(m.total):>11} = weights {size(m.weights)} + gradients "
                     f"{size(m.gradients)} + Adam {size(m.optimizer)} + activations {size(m.activations)}"
                     + (f" + reference {size(m.reference)}" if m.reference else "") + fits)
    formulas = QUANTIZED_FORMULAS if quantization else MEMORY_FORMULAS
    lines.extend("  " + line for line in formulas.splitlines())
    return lines


@dataclass
class ConfigOnlyPlan:
    """What plans from the model's config.json alone (`--config-only`, or a model folder that holds only its
    config): the model's shape, the memory per GPU and the size of a checkpoint; the data is not read, so no steps,
    tokens or time."""
    gpus: int
    micro_batch: int
    max_length: int
    checkpoint_bytes: float
    final_bytes: float
    shape: ModelShape
    memory: dict[str, Memory]
    gpu_memory: Optional[float] = None
    quantization: str = ""
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"from the model's config alone: micro-batch {self.micro_batch} of up to {self.max_length} tokens "
                 f"x {self.gpus} GPU(s); the data is not read (no steps, tokens or time)",
                 "checkpoints",
                 f"  {size(self.checkpoint_bytes)} each (weights + Adam states); final/ {size(self.final_bytes)}",
                 *memory_lines(self.shape, self.memory, self.quantization, self.gpu_memory)]
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


def measured_tokens_per_second(output_dir: str) -> Optional[float]:
    """The median tokens_per_s an earlier run logged in output_dir/metrics.jsonl, if there is one."""
    values = [row["tokens_per_s"] for row in read_metrics(Path(output_dir) / METRICS_FILE)
              if isinstance(row.get("tokens_per_s"), (int, float))]
    return statistics.median(values) if values else None


def plan_data(config: TrainConfig, objective: Objective, tokenizer, gpus: int) -> DataPlan:
    """The run's data, sampler and length exactly as train() builds them for `gpus` processes, counted by the
    objective."""
    data = objective.load_data(config, tokenizer, lambda line: None, launched_world_size())
    sampler = objective.sampler(config, data, gpus, 0)
    total_steps = total_optimizer_steps(sampler.steps_per_epoch, config.num_epochs, config.max_steps)
    return objective.plan_counts(config, data, sampler, total_steps)


def make_plan(config: TrainConfig, gpus: int = 1, tokens_per_second: Optional[float] = None,
              gpu_memory_gib: Optional[float] = None, config_only: bool = False) -> Plan | ConfigOnlyPlan:
    """The plan of a run of `config` on `gpus` processes; with `config_only` (or a model folder holding a config and
    no tokenizer) from the model's config alone, reading neither tokenizer nor data."""
    if gpus < 1:
        raise UserError(f"--gpus: must be at least 1, got {gpus}")
    if gpu_memory_gib is not None and gpu_memory_gib <= 0:
        raise UserError(f"--gpu-memory: must be more than 0 GiB, got {gpu_memory_gib:g}")
    notes = []
    if not config_only and holds_config_alone(config):
        config_only = True
        notes.append(f"model_name {config.model_name} holds a config and no tokenizer, so the data is not read; set "
                     f"tokenizer_name to a tokenizer on this machine to plan the steps, tokens and time too")
    require_here(config, config_only)
    objective = objective_for(config)
    # from_config sizes the vocabulary to the tokenizer, which the run trains from scratch: it is read even then
    tokenizer = tokenizer_for(config) if not config_only or config.init == "from_config" else None
    if config.init == "from_config":
        shape = model_shape(config, resolve_model_config(config, tokenizer))
    else:
        shape = model_shape(config)
    # final/ holds the adapter only under LoRA (lora_trainable is counted then)
    saved = shape.lora_trainable if shape.lora_trainable is not None else shape.parameters
    final_bytes = 4 * saved + (4 * shape.parameters if config.lora and config.merge_lora else 0)
    memory = memory_per_gpu(shape, objective.rows_per_example * config.batch_size, config.max_length, config.dtype,
                            gpus, config.gradient_checkpointing, objective.reference_copies)
    gpu_memory = gpu_memory_gib * GIB if gpu_memory_gib is not None else None
    quantization = describe_settings(quantization_settings(config)) if shape.quantized else ""
    if config_only:
        return ConfigOnlyPlan(gpus=gpus, micro_batch=config.batch_size, max_length=config.max_length,
                              checkpoint_bytes=checkpoint_bytes(shape, config.lora), final_bytes=final_bytes,
                              shape=shape, memory=memory, gpu_memory=gpu_memory, quantization=quantization,
                              notes=notes)
    data = plan_data(config, objective, tokenizer, gpus)
    total_steps = data.total_steps
    saves = checkpoint_steps(total_steps, config.save_every)

    source = "given"
    if tokens_per_second is None:
        tokens_per_second = measured_tokens_per_second(config.output_dir)
        source = f"median measured in {config.output_dir}/metrics.jsonl"
    notes.extend(data.notes)
    if tokens_per_second is not None and source == "given" and gpus > 1:
        notes.append("--tokens-per-second is the whole run's throughput (all GPUs together, as train logs it)")
    free = shutil.disk_usage(existing_parent(Path(config.output_dir))).free
    notes.append(f"{size(free)} free where output_dir is")
    notes.extend(schedule_notes(config, total_steps))  # train prints the same lines at its start
    return Plan(
        gpus=gpus, micro_batch=config.batch_size, accumulation=config.gradient_accumulation_steps,
        examples_per_step=data.examples_per_step, train_examples=data.train_examples, val_examples=data.val_examples,
        epoch_tokens=data.epoch_tokens, epoch_trained=data.epoch_trained, steps_per_epoch=data.steps_per_epoch,
        dropped_per_epoch=data.dropped_per_epoch, total_steps=total_steps, run=data.run,
        warmup_steps=config.warmup_steps,
        suggested_warmup=(math.ceil(0.05 * total_steps), math.ceil(0.10 * total_steps)),
        suggested_anneal=max(1, total_steps - 1 - config.warmup_steps),
        lr_first_last=(learning_rate(0, config, total_steps), learning_rate(total_steps - 1, config, total_steps)),
        checkpoints=len(saves), kept_at_most=most_kept(saves, config.keep_last, config.keep_every),
        checkpoint_bytes=checkpoint_bytes(shape, config.lora), final_bytes=final_bytes, shape=shape,
        memory=memory, tokens_per_second=tokens_per_second, throughput_source=source, notes=notes,
        gpu_memory=gpu_memory, quantization=quantization)


def holds_config_alone(config: ModelSource) -> bool:
    """Whether model_name is a folder with a config.json and no tokenizer, tokenizer_name unset: what plan is given
    to estimate a model that is not on this machine from its config."""
    if config.tokenizer_name is not None or config.model_name is None or config.gguf_file:
        return False
    folder = Path(config.model_name).expanduser()
    return (folder / "config.json").is_file() and not is_adapter_folder(config.model_name) \
        and not any((folder / name).is_file() for name in TOKENIZER_FILES)


def require_here(config: TrainConfig, config_only: bool) -> None:
    """Refuse at once, in one line that says how to plan without it, a Hub model (or tokenizer) that is neither in
    the Hugging Face cache nor reachable: the libraries would retry for minutes before failing."""
    names = []
    if config.init != "from_config" and config.model_name is not None:
        model = adapter_base(config.model_name) if is_adapter_folder(config.model_name) else config.model_name
        names.append(("model_name", model, config.gguf_file or "config.json"))
    if config.tokenizer_name is not None and not config_only:
        names.append(("tokenizer_name", config.tokenizer_name, "tokenizer_config.json"))
    for key, name, file in names:
        if is_local(name):
            continue
        reason = hub_unreachable(name, config.model_revision, file)
        if reason is None:
            continue
        if key == "model_name":
            raise UserError(f"model_name {name}: not on this machine (not in the Hugging Face cache) and the Hub "
                            f"cannot be reached ({reason}); plan needs only the model's config.json: save it in a "
                            f"folder and set model_name to that folder (its memory is planned from the config alone, "
                            f"as --config-only does; with tokenizer_name set to a tokenizer here the data too)")
        raise UserError(f"tokenizer_name {name}: not on this machine (not in the Hugging Face cache) and the Hub "
                        f"cannot be reached ({reason}); set tokenizer_name to a tokenizer folder here, or add "
                        f"--config-only to plan the memory without the data")


def hub_unreachable(repo: str, revision: Optional[str], file: str) -> Optional[str]:
    """Why `file` of the Hub repository `repo` can be read neither from the cache nor from the Hub, or None when it
    can (or when the Hub answered at all: a wrong id or a gated model is reported by the loading that follows). One
    request, without the retries the libraries make."""
    import httpx2  # huggingface_hub's HTTP client, whose errors say the Hub did not answer
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(try_to_load_from_cache(repo, file, revision=revision), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        get_hf_file_metadata(hf_hub_url(repo, file, revision=revision), timeout=10)
    except httpx2.TransportError as exc:  # no answer: no network, no name resolution, a timeout
        return (str(exc).splitlines() or [type(exc).__name__])[0][:200]
    except HfHubHTTPError:  # an answer: the loading that follows reports a wrong id or a gated model
        pass
    return None


def existing_parent(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where a folder not made yet will be made)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path
