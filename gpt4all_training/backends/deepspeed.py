"""DeepSpeed (ZeRO 1-3) under accelerate: filling its config from the training config, and the places where its engine
behaves differently from DDP.

One source of truth: batch size, accumulation, clipping and precision come from the training config. A DeepSpeed
JSON keeps them "auto" and `fill_deepspeed_config` fills them before `accelerator.prepare`; a value that disagrees
is a one-line UserError naming the file and key, never DeepSpeed's "config values mismatch" traceback. The optimizer
(torch AdamW with our parameter groups, so weight decay reaches it) and the learning-rate schedule (warmup, then
cosine to min_lr) are ours, so a DeepSpeed config must not carry "optimizer" or "scheduler" blocks.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from gpt4all_training.backends.backend import Backend, LaunchSettings, rebuilt_copy
from gpt4all_training.errors import UserError

AUTO = "auto"
# Tag of the DeepSpeed engine state inside a checkpoint's deepspeed/ folder.
ENGINE_TAG = "engine"


# ---------------------------------------------------------------- the DeepSpeed config

def deepspeed_config_source() -> str:
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    return path if path != "none" else "the DeepSpeed settings of accelerate launch"


def deepspeed_values(config: LaunchSettings, world_size: int) -> dict[str, Any]:
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


def fill_deepspeed_config(ds_config: dict[str, Any], config: LaunchSettings, world_size: int,
                          source: str) -> dict[str, Any]:
    """Fill the "auto" (or missing) values of `ds_config` in place from the training config; refuse contradictions."""
    reasons = {"optimizer": "the optimizer is AdamW built from lr, weight_decay and the parameter groups",
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


# ---------------------------------------------------------------- the backend

def zero3_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's whole shape: under ZeRO-3 the tensor is a flat partition and DeepSpeed keeps the shape in
    ds_shape (a parameter added after the model was built, such as a LoRA adapter's, is whole until prepare)."""
    return getattr(param, "ds_shape", param.shape)


def zero3_held_elements(param: torch.Tensor) -> int:
    """The elements of a parameter this rank holds: its partition (ds_tensor) under ZeRO-3, else all of them."""
    return param.ds_tensor.numel() if hasattr(param, "ds_tensor") else param.numel()


def _has_frozen_parameters(engine) -> bool:
    return any(not p.requires_grad for p in engine.module.parameters())


def engine_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    """The dtype a DeepSpeed engine keeps the model's floating parameters in (its config filled)."""
    if ds_config.get("bf16", {}).get("enabled") is True:
        return torch.bfloat16
    return torch.float16 if ds_config.get("fp16", {}).get("enabled") is True else torch.float32


class DeepSpeedBackend(Backend):
    """accelerate's DEEPSPEED: the engine owns accumulation, clipping and the update, and (ZeRO-3) the partitions."""

    supports_nan_skip = False
    supports_grad_norms = False
    engine_saves_state = True
    engine_state_dir = "deepspeed"
    engine_name = "DeepSpeed"

    def __init__(self, accelerator) -> None:
        super().__init__(accelerator)
        plugin = accelerator.state.deepspeed_plugin
        self.zero_stage = int(plugin.deepspeed_config["zero_optimization"].get("stage", 0))
        self.partitions_parameters = self.zero_stage == 3
        self.samples_in_lockstep = self.partitions_parameters and self.world_size > 1
        # A ZeRO-3 head's weight is a partition that only the head's own forward gathers: the loss calls the whole
        # head instead of reading its weight.
        self.chunks_output_head = not self.partitions_parameters
        # The same for a LoRA layer's linear modules: the fused node, which calls none of them, would read partitions.
        self.fuses_lora = not self.partitions_parameters
        # ZeRO-3 partitions a 4-bit base as any parameter when its packed weights are stored in the dtype the engine
        # holds parameters in (it casts every floating one to it), and gathers them byte for byte; each layer's
        # quantization constants stay whole on its module. ZeRO-1/2 keep bitsandbytes' uint8, which no cast touches.
        self.shards_quantized_base = self.partitions_parameters
        if self.partitions_parameters:
            self.quantized_storage = engine_dtype(plugin.deepspeed_config)

    def parameter_shape(self, param: torch.Tensor) -> torch.Size:
        return zero3_shape(param)

    def held_elements(self, param: torch.Tensor) -> int:
        return zero3_held_elements(param)

    @property
    def exit_hard(self) -> bool:
        """Multi-process ZeRO-3: DeepSpeed's hooks sometimes abort interpreter teardown ("terminate called without an
        active exception", exit 1) after a correct save (5 of 25 runs; 0 of 8 when the process leaves with
        os._exit), so the CLI leaves that way once everything is written."""
        return self.partitions_parameters and self.world_size > 1

    def backward(self, loss: torch.Tensor) -> None:
        """DeepSpeed's engine divides by its own accumulation steps unless told not to. On the last micro-batch this
        backward also runs the engine's step (clip, update, zero), which makes optimizer.step() and zero_grad()
        no-ops there."""
        self.accelerator.backward(loss, scale_wrt_gas=False)

    @contextlib.contextmanager
    def whole_model_init(self) -> Iterator[None]:
        """Build a model whole in this process, not partitioned at construction by transformers' ZeRO-3 zero.Init:
        what whole_copy needs to merge an adapter into. (Training models are built partitioned, so that no rank holds
        a whole copy.) accelerate's zero3_init_context_manager(enable=False) leaves transformers' switch on, hence
        this one."""
        if not self.partitions_parameters:
            yield
            return
        from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        try:
            yield
        finally:
            set_hf_deepspeed_config(self.accelerator.state.deepspeed_plugin.dschf)

    def whole_copy(self, unwrapped, state_dict: dict[str, torch.Tensor]):
        """Under ZeRO-3 the in-memory model holds only this rank's partition: a whole CPU copy from `state_dict`."""
        if not self.partitions_parameters:
            return unwrapped
        with self.whole_model_init():
            return rebuilt_copy(unwrapped, state_dict)

    def save_engine_state(self, model, optimizer, folder: Path) -> None:
        """The engine's own checkpoint (ZeRO-partitioned optimizer state, one file per rank). A collective."""
        # A LoRA run's frozen base is the base model on disk; storing it in every checkpoint would only cost space.
        model.save_checkpoint(str(folder), tag=ENGINE_TAG, exclude_frozen_parameters=_has_frozen_parameters(model))

    def load_engine_state(self, model, optimizer, folder: Path) -> None:
        """Restore what save_engine_state wrote: weights and optimizer state (the engine's), each rank its own
        partition."""
        path, _ = model.load_checkpoint(str(folder), tag=ENGINE_TAG, load_optimizer_states=True,
                                        load_lr_scheduler_states=False,
                                        load_module_strict=not _has_frozen_parameters(model))
        if path is None:
            raise UserError(f"checkpoint {folder}: the DeepSpeed engine state cannot be read")

    def engine_pickled_types(self) -> list[type]:
        return deepspeed_pickled_types()


def deepspeed_pickled_types() -> list[type]:
    """The classes DeepSpeed pickles into its checkpoints besides tensors: data holders, whose unpickling runs no
    code a file chooses."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]

