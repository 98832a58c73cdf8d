"""FSDP2 (torch's `fully_shard`): each rank holds a shard of every parameter, gradient and optimizer state, and
gathers a layer's weights only while that layer runs.

It is launched like the other engines, `accelerate launch --config_file configs/accelerate/fsdp2_8gpu.yaml train.py
...`: accelerate turns the file's `fsdp_config` into FSDP_* variables, and `fsdp_settings` reads them. The model is
sharded here, on GPUs and CPUs alike, because accelerate 1.16 enables FSDP only with CUDA (on a CPU its processes
would run DDP, or each alone); one code path then runs in the CPU tests and on GPUs, and accelerate only starts the
processes, places them on devices and autocasts.

- Sharding: one FSDP unit per decoder layer (the model's `_no_split_modules`, or fsdp_transformer_layer_cls_to_wrap),
  then the root (embeddings, final norm, output head).
- Precision: parameters stay fp32 (the master weights) and the backend autocasts, as every other backend does, so a
  run computes what DDP computes; the all-gathers move fp32.
- Gradients are reduce-scattered after every micro-batch, so no rank holds a whole model's gradients (as ZeRO-2).
- Checkpoints: `step_N/fsdp/rank{r}.pt`, each rank's shards of the trainable weights and of the optimizer state as
  plain tensors (loadable with weights_only=True), so no rank ever gathers the optimizer state (twice the fp32
  model for AdamW) and a resume restores the same bytes. `model/` and `final/` are gathered whole on rank 0.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, cast

import torch

from gpt4all_training.backends.backend import Backend, LaunchSettings, rebuilt_copy
from gpt4all_training.errors import UserError
from gpt4all_training.files import load_tensors, save_tensors

WRAP_POLICY = "TRANSFORMER_BASED_WRAP"


def fsdp_requested() -> bool:
    """Whether the launcher asked for FSDP (`distributed_type: FSDP` in the accelerate config, or --use_fsdp)."""
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env("ACCELERATE_USE_FSDP")


@dataclass(frozen=True)
class FsdpSettings:
    """What the accelerate config's fsdp_config decides (the FSDP_* variables accelerate launch sets)."""
    layer_classes: tuple[str, ...]  # empty: the model's _no_split_modules
    reshard_after_forward: bool
    offload_params: bool
    activation_checkpointing: bool


def fsdp_settings(config: LaunchSettings) -> FsdpSettings:
    """The FSDP settings of this launch; a setting this backend cannot honour is a one-line UserError."""
    from accelerate.utils import parse_flag_from_env

    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise UserError(f"fsdp_version: {version} in the accelerate config; set fsdp_version: 2 (torch's fully_shard)")
    policy = os.environ.get("FSDP_AUTO_WRAP_POLICY", WRAP_POLICY)
    if policy != WRAP_POLICY:
        raise UserError(f"fsdp_auto_wrap_policy: {policy} in the accelerate config; set {WRAP_POLICY} (one FSDP "
                        f"unit per decoder layer)")
    if config.dtype == "float16":
        raise UserError("dtype: float16 under FSDP2 would need a gradient scaler that agrees across shards; use "
                        "bfloat16")
    classes = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
    return FsdpSettings(layer_classes=tuple(name.strip() for name in classes.split(",") if name.strip()),
                        reshard_after_forward=parse_flag_from_env("FSDP_RESHARD_AFTER_FORWARD", True),
                        offload_params=parse_flag_from_env("FSDP_OFFLOAD_PARAMS"),
                        activation_checkpointing=parse_flag_from_env("FSDP_ACTIVATION_CHECKPOINTING"))


def transformers_model(model):
    """The transformers model inside a PEFT model (or `model` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (the same storage, under no_grad), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_copy(value: Any) -> Any:
    """`value` with every tensor inside its dicts, lists and tuples replaced by a CPU copy of this rank's shard."""
    if isinstance(value, torch.Tensor):
        return local_part(value.detach()).cpu().clone()
    if isinstance(value, dict):
        return {k: local_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_copy(v) for v in value)
    return value


def sharded_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor restored from its local shard: sharded like `param` when it is shaped like it
    (exp_avg, exp_avg_sq), as it was saved otherwise (the step count)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor) or local.dim() != param.dim():
        return local
    return DTensor.from_local(local.to(local_part(param).device), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


class FsdpBackend(Backend):
    """FSDP2 over the processes accelerate started: DDP's interface, with sharded weights, gradients and optimizer
    state. With one process there is nothing to shard, and it trains as one process does."""

    engine_saves_state = True
    engine_state_dir = "fsdp"
    engine_name = "FSDP2"
    # fully_shard shards only floating tensors: a 4-bit base packs its weights into fp32 (the dtype of every other
    # parameter here), which is sharded and gathered as it is, byte for byte. Each layer's quantization constants
    # stay whole on every rank, on the module, where bitsandbytes finds them again after a gather.
    shards_quantized_base = True
    quantized_storage = torch.float32

    def __init__(self, accelerator, settings: FsdpSettings) -> None:
        super().__init__(accelerator)
        self.settings = settings
        self.partitions_parameters = self.samples_in_lockstep = self.world_size > 1
        # About in-place changes to the model's output, which would skip a hook: the loss only slices and indexes it.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor",
                                category=UserWarning)

    def prepare(self, model, optimizer):
        """Shard `model` (decoder layers, then the root) and point `optimizer`, which has taken no step yet, at the
        sharded parameters that fully_shard puts in place of the originals. Every rank loaded the whole model, so
        each keeps its own shard of the same weights."""
        base = transformers_model(model)
        if self.settings.activation_checkpointing and not base.is_activation_checkpointing:
            base.activation_checkpointing_enable()  # non-reentrant: each layer recomputes inside its FSDP unit
            base.config.use_cache = False
        if not self.partitions_parameters:
            return model, optimizer
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        names = {id(p): name for name, p in model.named_parameters()}
        group_names = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]

        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.settings.offload_params \
            else OffloadPolicy()
        options = {"mesh": init_device_mesh(self.device.type, (self.world_size,)), "offload_policy": offload}
        classes = set(self.settings.layer_classes or getattr(base, "_no_split_modules", None) or ())
        layers = [m for m in model.modules() if type(m).__name__ in classes]
        if not layers:
            raise UserError(f"fsdp_transformer_layer_cls_to_wrap: no module of {type(base).__name__} is a "
                            f"{' or '.join(sorted(classes)) or '(none given)'}; name its decoder layer class")
        layer_names = sorted({type(m).__name__ for m in layers})
        for layer in layers:
            fully_shard(layer, reshard_after_forward=self.settings.reshard_after_forward, **options)
        # The root keeps its weights gathered after the forward (torch's default for it): the loss reads the output
        # head's weight after the model returns, and the backward needs them at once.
        fully_shard(model, **options)

        params = dict(model.named_parameters())
        for group, group_params in zip(optimizer.param_groups, group_names):
            group["params"] = [params[name] for name in group_params]
        notes = [note for note, on in [("parameters offloaded to the CPU", self.settings.offload_params),
                                       ("activation checkpointing", base.is_activation_checkpointing)] if on]
        self.print(f"FSDP2: {len(layers)} {' / '.join(layer_names)} units and the root, sharded over "
                   f"{self.world_size} processes" + "".join(f"; {note}" for note in notes))
        return model, optimizer

    @contextlib.contextmanager
    def micro_batch(self, model, last: bool) -> Iterator[None]:
        """Every micro-batch reduce-scatters its gradients into the shards (nothing to skip, unlike DDP)."""
        yield

    def clip_grad_norm(self, model, max_norm: float | None) -> float:
        """The global gradient norm over every shard (one all-reduce), then clipped to `max_norm`."""
        from torch.distributed.tensor import DTensor

        params = [p for p in model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(total, DTensor):
            total = total.full_tensor()
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total.item()

    def parameter_norms(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The norm of each whole tensor: a collective, since each rank holds a shard."""
        from torch.distributed.tensor import DTensor

        norms = [t.detach().float().norm() for t in tensors]
        return torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).cpu()

    # ---------------------------------------------------------------- saving

    def saveable_state_dict(self, model) -> dict[str, torch.Tensor]:
        """The whole state dict on rank 0, gathered shard by shard to the CPU (empty elsewhere). A collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast(dict[str, torch.Tensor], state)  # a model's state dict: tensors only

    def save_engine_state(self, model, optimizer, folder: Path) -> None:
        """This rank's shards of the trainable weights and of the optimizer state, as plain tensors. A LoRA run's
        frozen base is the base model on disk, so only what training changes is stored."""
        folder.mkdir(exist_ok=True)
        trainable = {name: local_copy(p) for name, p in model.named_parameters() if p.requires_grad}
        save_tensors({"model": trainable, "optimizer": local_copy(optimizer.state_dict())},
                      folder / f"rank{self.rank}.pt")

    def load_engine_state(self, model, optimizer, folder: Path) -> None:
        """Restore this rank's shards from save_engine_state's file of the same rank."""
        written = len(list(folder.glob("rank*.pt")))
        if written != self.world_size:
            raise UserError(f"checkpoint {folder.parent}: written by {written} processes and this run has "
                            f"{self.world_size}; resume FSDP2 with the same number of processes")
        saved = load_tensors(folder / f"rank{self.rank}.pt", map_location="cpu")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, local in saved["model"].items():
                local_part(params[name]).copy_(local)
        ordered = [p for group in optimizer.param_groups for p in group["params"]]  # state_dict's numbering
        state = saved["optimizer"]
        state["state"] = {i: {k: sharded_like(ordered[i], v) for k, v in entry.items()}
                          for i, entry in state["state"].items()}
        optimizer.load_state_dict(state)

    def whole_copy(self, unwrapped, state_dict: dict[str, torch.Tensor]):
        """The in-memory model holds one shard per rank: a whole CPU copy from the gathered `state_dict`."""
        return rebuilt_copy(unwrapped, state_dict) if self.partitions_parameters else unwrapped
