"""Building the Accelerator for every launch (python, torchrun, accelerate launch with DDP or DeepSpeed; GPU or CPU),
and the few places where DeepSpeed's engine behaves differently from DDP inside a training step.

One source of truth: batch size, accumulation, clipping and precision come from the training config. A DeepSpeed
JSON keeps them "auto" and `fill_deepspeed_config` fills them before `accelerator.prepare`; a value that disagrees
is a one-line UserError naming the file and key, never DeepSpeed's "config values mismatch" traceback. The optimiser
(torch AdamW with our parameter groups, so weight decay reaches it) and the learning-rate schedule (warmup, then
cosine to min_lr) are ours, so a DeepSpeed config must not carry "optimizer" or "scheduler" blocks.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from gpt4all_training.errors import UserError

MIXED_PRECISION = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}
AUTO = "auto"
# Tag of the DeepSpeed engine state inside a checkpoint's deepspeed/ folder.
ENGINE_TAG = "engine"


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def deepspeed_requested() -> bool:
    """Whether the launcher asked for DeepSpeed (`--use_deepspeed` or a DEEPSPEED accelerate config)."""
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")


def build_accelerator(config):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    deepspeed = deepspeed_requested()
    process_group: dict[str, Any] = {}
    if launched_world_size() > 1 and config.ddp_timeout_s:
        # How long a rank waits in a collective for a dead or hung peer. accelerate drops a value equal to its
        # default (600 s), which gloo would replace with 30 min; a microsecond more keeps it.
        process_group["timeout"] = timedelta(seconds=config.ddp_timeout_s, microseconds=1)
    if launched_world_size() > 1 and not torch.cuda.is_available():
        if deepspeed:
            # DeepSpeed would pick a GPU backend; gloo is the CPU one. (cpu=True would quietly turn it into DDP.)
            process_group["backend"] = "gloo"
        else:
            # Without CUDA, `accelerate launch --multi_gpu` starts independent processes; make them one gloo group.
            os.environ["ACCELERATE_USE_CPU"] = "true"
    # DeepSpeed's engine owns accumulation; give accelerate the same count so the two never disagree.
    accumulation = config.gradient_accumulation_steps if deepspeed else 1
    handlers = [InitProcessGroupKwargs(**process_group)] if process_group else []
    accelerator = Accelerator(mixed_precision=MIXED_PRECISION[config.dtype], kwargs_handlers=handlers,
                              gradient_accumulation_steps=accumulation)
    if is_deepspeed(accelerator):
        # DeepSpeed calls collectives that torch deprecates, and the warnings registry is reset often enough that
        # each would print on every step (hundreds of lines a run); nothing a user can act on.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        fill_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, config,
                              accelerator.num_processes, deepspeed_config_source())
    return accelerator


def is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def zero_stage(accelerator) -> int | None:
    if not is_deepspeed(accelerator):
        return None
    return int(accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"].get("stage", 0))


# ---------------------------------------------------------------- the DeepSpeed config

def deepspeed_config_source() -> str:
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    return path if path != "none" else "the DeepSpeed settings of accelerate launch"


def deepspeed_values(config, world_size: int) -> dict[str, Any]:
    """What the training config decides in a DeepSpeed config, by dotted key."""
    return {
        "train_micro_batch_size_per_gpu": config.batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "train_batch_size": config.batch_size * config.gradient_accumulation_steps * world_size,
        # DeepSpeed reads 0 as "no clipping"; left "auto", accelerate would put 1.0 here whatever the config says.
        "gradient_clipping": float(config.max_grad_norm or 0.0),
        "bf16.enabled": config.dtype == "bfloat16",
        "fp16.enabled": config.dtype == "float16",
    }


def _node(tree: dict[str, Any], dotted: str) -> tuple[dict[str, Any], str]:
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    return tree, leaf


def fill_deepspeed_config(ds_config: dict[str, Any], config, world_size: int, source: str) -> dict[str, Any]:
    """Fill the "auto" (or missing) values of `ds_config` in place from the training config; refuse contradictions."""
    reasons = {"optimizer": "the optimiser is AdamW built from lr, weight_decay and the parameter groups",
               "scheduler": "the schedule is warmup then cosine to min_lr, from the training config"}
    for block, reason in reasons.items():
        if block in ds_config:
            raise UserError(f"{source}: remove the \"{block}\" block; {reason}")
    for key, wanted in deepspeed_values(config, world_size).items():
        node, leaf = _node(ds_config, key)
        current = node.get(leaf, AUTO)
        if current == AUTO:
            node[leaf] = wanted
        elif current != wanted:
            raise UserError(f"{source}: {key} is {current!r} but the training config makes it {wanted!r}; "
                            f"set it to \"auto\" (batch_size, gradient_accumulation_steps, max_grad_norm and dtype "
                            f"of the training config decide it)")
    zero = ds_config.setdefault("zero_optimization", {})
    if zero.get("stage") == 3:
        key = "stage3_gather_16bit_weights_on_model_save"
        if zero.get(key, AUTO) not in (AUTO, True):
            raise UserError(f"{source}: zero_optimization.{key} must be true under ZeRO-3: final/ and checkpoints "
                            f"are written from the gathered weights")
        zero[key] = True
    return ds_config


# ---------------------------------------------------------------- building models under ZeRO-3

@contextlib.contextmanager
def whole_model_init(accelerator):
    """Build a model whole in this process, not partitioned at construction by transformers' ZeRO-3 zero.Init: what
    whole_copy needs to merge an adapter into. (Training models are built partitioned, so that no rank holds a whole
    copy.) accelerate's zero3_init_context_manager(enable=False) leaves transformers' switch on, hence this one.
    """
    if zero_stage(accelerator) != 3:
        yield
        return
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(accelerator.state.deepspeed_plugin.dschf)


def whole_copy(accelerator, unwrapped, state_dict: dict[str, torch.Tensor]):
    """`unwrapped` itself, or a whole CPU copy built from the gathered `state_dict` where the in-memory model cannot
    be saved as it is: under ZeRO-3 it holds only this rank's partition, under XLA its tensors live on the XLA
    device. What merging a LoRA adapter into its base needs. Main process only."""
    if zero_stage(accelerator) != 3 and not is_xla(accelerator):
        return unwrapped
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with whole_model_init(accelerator):
        base = AutoModelForCausalLM.from_config(unwrapped.get_base_model().config, dtype=torch.float32)
        copy = get_peft_model(base, unwrapped.peft_config[unwrapped.active_adapter])
    copy.load_state_dict(to_cpu(state_dict))
    return copy


# ---------------------------------------------------------------- inside a training step

def stepping_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimiser that applies the updates, for our lr schedule to drive.

    accelerate wraps ours; ZeRO wraps it again; with CPU offload accelerate swaps in DeepSpeedCPUAdam built over
    the same parameter groups (so weight decay and betas carry over, but a schedule on our object would not).
    """
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


@contextlib.contextmanager
def micro_batch(accelerator, model, last: bool):
    """One micro-batch of an optimiser step. Only the last one synchronises: DDP skips its all-reduce before it
    (no_sync), and DeepSpeed, told through sync_gradients, reaches its accumulation boundary and steps there."""
    accelerator.sync_gradients = last
    try:
        with contextlib.nullcontext() if last else accelerator.no_sync(model):
            yield
    finally:
        accelerator.sync_gradients = True


def backward(accelerator, loss: torch.Tensor) -> None:
    """accelerator.backward of a loss that is already normalised over the whole step.

    accelerate (DDP) divides by its gradient accumulation steps and DeepSpeed's engine by its own; neither division
    may apply here. Under DeepSpeed this backward also runs the engine's step (clip, update, zero) on the last
    micro-batch, which makes optimizer.step() and zero_grad() no-ops there.
    """
    if is_deepspeed(accelerator):
        accelerator.backward(loss, scale_wrt_gas=False)
    else:
        accelerator.backward(loss * accelerator.gradient_accumulation_steps)


# ---------------------------------------------------------------- XLA (a TPU, or PJRT_DEVICE=CPU)

# Filler of each batch key when a batch is widened to its bucket: padding is never attended to by real tokens
# (causal, right-padded) and never trained.
PAD_VALUES = {"labels": -100}
SMALLEST_BUCKET = 64


def is_xla(accelerator) -> bool:
    return accelerator.device.type == "xla"


def bucket_width(width: int) -> int:
    """The padded width of a batch under XLA: the next power of two (at least 64). XLA compiles one graph per input
    shape, so padding to a few fixed widths bounds the compilations (log2 of max_length of them) instead of
    compiling anew for every batch width."""
    return max(SMALLEST_BUCKET, 1 << (width - 1).bit_length())


def device_batch(batch: dict[str, torch.Tensor], accelerator) -> dict[str, torch.Tensor]:
    """`batch` on the accelerator's device; under XLA widened to its bucket first."""
    if is_xla(accelerator):
        width = batch["input_ids"].shape[1]
        extra = bucket_width(width) - width
        batch = {k: torch.nn.functional.pad(v, (0, extra), value=PAD_VALUES.get(k, 0)) if v.dim() == 2 else v
                 for k, v in batch.items()}
    return {k: v.to(accelerator.device) for k, v in batch.items()}


def step_boundary(accelerator) -> None:
    """Under XLA, cut the lazily traced graph here, so each optimiser step (or evaluation batch) is one graph that
    compiles once and replays; elsewhere nothing."""
    if is_xla(accelerator):
        import torch_xla

        torch_xla.sync()


def xla_metrics(accelerator) -> dict[str, int]:
    """{"xla_compilations": graphs compiled so far by this process} under XLA, else {}: a count that keeps growing
    after the first steps means shapes are not static and every step pays for a compilation."""
    if not is_xla(accelerator):
        return {}
    import torch_xla.debug.metrics as metrics

    data = metrics.metric_data("CompileTime")
    return {"xla_compilations": int(data[0]) if data else 0}


def to_cpu(value: Any) -> Any:
    """`value` with every tensor inside its dicts, lists and tuples moved to the CPU (an optimiser's state)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def saveable_state_dict(accelerator, model) -> dict[str, torch.Tensor]:
    """accelerator.get_state_dict (a collective under ZeRO-3: every rank calls it), moved to the CPU under XLA,
    since safetensors cannot write XLA tensors."""
    state_dict = accelerator.get_state_dict(model)
    return to_cpu(state_dict) if is_xla(accelerator) else state_dict


# ---------------------------------------------------------------- checkpoints and the end of a run

def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 checksum of a tensor's bits (position-weighted, wrapping): equal tensors give equal values and a
    changed bit almost surely changes it. Computed in chunks, so a large embedding is never copied whole to int64."""
    flat = tensor.detach().contiguous().flatten()
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    chunk = 1 << 22
    for start in range(0, bits.numel(), chunk):
        part = bits[start:start + chunk].to(torch.int64)
        total += (part * torch.arange(start + 1, start + 1 + part.numel(), device=part.device)).sum()
    return total


def replica_mismatches(accelerator, model) -> int | None:
    """How many parameter tensors differ, bit for bit, from rank 0's copy; None where ranks hold no whole copy of
    the model (a single process, or ZeRO-3). DDP and ZeRO-1/2 keep one copy per rank and rely on identical updates
    to keep them equal; only a checksum per tensor crosses the network. A collective: every rank calls it."""
    if accelerator.num_processes == 1 or zero_stage(accelerator) == 3:
        return None
    sums = torch.stack([fingerprint(p) for p in accelerator.unwrap_model(model).parameters()])
    per_rank = accelerator.gather(sums.to(accelerator.device)).view(accelerator.num_processes, -1)
    return int((per_rank != per_rank[0]).any(dim=0).sum())


def deepspeed_engine(model):
    """The DeepSpeed engine if `model` is one (after accelerator.prepare), else None."""
    engine_class = getattr(sys.modules.get("deepspeed"), "DeepSpeedEngine", None)  # loaded only if in use
    return model if engine_class is not None and isinstance(model, engine_class) else None


def _has_frozen_parameters(engine) -> bool:
    return any(not p.requires_grad for p in engine.module.parameters())


def save_engine_state(engine, folder: Path) -> None:
    """The engine's own checkpoint (ZeRO-partitioned optimiser state, one file per rank). A collective."""
    # A LoRA run's frozen base is the base model on disk; storing it in every checkpoint would only cost space.
    engine.save_checkpoint(str(folder), tag=ENGINE_TAG, exclude_frozen_parameters=_has_frozen_parameters(engine))


def load_engine_state(engine, folder: Path) -> None:
    """Restore what save_engine_state wrote: weights and optimiser state, each rank its own partition."""
    path, _ = engine.load_checkpoint(str(folder), tag=ENGINE_TAG, load_optimizer_states=True,
                                     load_lr_scheduler_states=False,
                                     load_module_strict=not _has_frozen_parameters(engine))
    if path is None:
        raise UserError(f"checkpoint {folder}: the DeepSpeed engine state cannot be read")


def finish(accelerator, exit_code: int = 0) -> None:
    """End the run. Under ZeRO-3 with several processes, leave with `exit_code` and without interpreter teardown
    once everything is written: DeepSpeed's ZeRO-3 hooks sometimes abort it ("terminate called without an active
    exception", exit 1) after a correct save (measured: 5 of 25 runs; 0 of 8 with this exit)."""
    zero3 = zero_stage(accelerator) == 3 and accelerator.num_processes > 1
    accelerator.end_training()
    if zero3:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
