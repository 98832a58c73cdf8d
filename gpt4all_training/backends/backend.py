"""The one object through which training, evaluation, checkpoints and inference reach the processes and the device.

`backends.accelerate.build_backend` builds it once from the Accelerator: this class for one process or DDP (GPUs or
CPUs), `DeepSpeedBackend` (backends/deepspeed.py), `FsdpBackend` (backends/fsdp.py) and `XlaBackend`
(backends/xla.py) where those differ. Nothing outside backends/ asks which one it has (tests/test_imports.py
forbids it); it asks what the backend supports (`supports_nan_skip`, `supports_grad_norms`, `engine_saves_state`,
`partitions_parameters`, `samples_in_lockstep`, `chunks_output_head`, `fuses_lora`, `attends_per_example`,
`shards_quantized_base`, `exit_hard`), the storage dtype of a 4-bit base (`quantized_storage`) and how big a
parameter is (`parameter_shape`, `held_elements`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Protocol

import torch

from gpt4all_training.config.secrets import scrub


class LaunchSettings(Protocol):
    """What building the backend reads of the training config: the compute dtype, the batches that DeepSpeed's
    config repeats (batches), its gradient clipping (optimizer) and the collective timeout (faults)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"]
    batch_size: int
    gradient_accumulation_steps: int
    max_grad_norm: Optional[float]
    ddp_timeout_s: Optional[int]


class ProcessRanks(Protocol):
    """Where this process stands among the run's: what the training roles' protocols of the backend start from."""

    @property
    def world_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def is_main_process(self) -> bool: ...


def to_cpu(value: Any) -> Any:
    """`value` with every tensor inside its dicts, lists and tuples moved to the CPU (an optimizer's state)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


class Backend:
    """One process, or DDP over several (accelerate's MULTI_GPU / MULTI_CPU)."""

    # DeepSpeed's engine applies the update inside backward, before the step's loss is known.
    supports_nan_skip = True
    # Gradients exist between backward and the optimizer step (under DeepSpeed the engine has consumed them).
    supports_grad_norms = True
    # The engine writes weights and optimizer state itself, each rank its part, into the checkpoint's
    # `engine_state_dir` (deepspeed/, fsdp/) instead of optimizer.pt; `engine_name` names it in messages.
    engine_saves_state = False
    engine_state_dir = ""
    engine_name = ""
    # ZeRO-3, FSDP2: each rank holds only its partition of every parameter.
    partitions_parameters = False
    # Each forward gathers the parameters (a collective), so while sampling every process must run as many forwards
    # as every other: model/decoding.py's lockstep.
    samples_in_lockstep = False
    # The loss may select the trained positions and project only them through the output head, chunk by chunk
    # (training/loss.py): the head's weight is whole in this process, and a batch may take data-dependent shapes.
    chunks_output_head = True
    # LoRA layers may run model/lora.py's fused node, which reads the base's and the adapter's weights directly
    # instead of calling their modules: every weight must be whole whenever its layer runs.
    fuses_lora = True
    # Whether this backend can partition a quantized (bitsandbytes 4-bit) base across its ranks; where it partitions
    # parameters and cannot, model/build.py refuses a quantized base.
    shards_quantized_base = False
    # The dtype a 4-bit base packs its weights into: bitsandbytes' uint8 where every process holds the whole base.
    quantized_storage = torch.uint8

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator

    # ---------------------------------------------------------------- the processes

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def attends_per_example(self) -> bool:
        """Whether a packed micro-batch is one row attended example by example (model/attention.py): its boundaries
        are read on the host at every layer, which costs nothing on a CPU and a sync on an accelerator."""
        return self.device.type == "cpu"

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    def print(self, *args, **kwargs) -> None:
        """print on the main process only, with any credential from the environment hidden."""
        self.accelerator.print(*(scrub(str(arg)) for arg in args), **kwargs)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction=reduction)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(tensor)

    def wait_for_everyone(self) -> None:
        self.accelerator.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager:
        """The main process runs the block alone first (filling caches); the others then run it."""
        return self.accelerator.main_process_first()

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank; a collective when there are several."""
        return self.any_ranks([flag])[0]

    def any_ranks(self, flags: list[bool]) -> list[bool]:
        """Whether each flag is true on any rank, in one collective when there are several."""
        if self.world_size == 1:
            return flags
        votes = torch.tensor([float(flag) for flag in flags], device=self.device)
        return [vote > 0 for vote in self.reduce(votes).tolist()]

    @property
    def exit_hard(self) -> bool:
        """Whether the process must leave without interpreter teardown once the run is written (see DeepSpeed)."""
        return False

    def end(self) -> None:
        """The end of the run: the process group is taken down. Every rank calls it."""
        self.accelerator.end_training()

    # ---------------------------------------------------------------- the model and optimizer

    def prepare(self, model, optimizer):
        return self.accelerator.prepare(model, optimizer)

    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)

    def stepping_optimizer(self, optimizer) -> torch.optim.Optimizer:
        """The torch optimizer that applies the updates, for our lr schedule to drive.

        accelerate wraps ours; ZeRO wraps it again; with CPU offload accelerate swaps in DeepSpeedCPUAdam built over
        the same parameter groups (so weight decay and betas carry over, but a schedule on our object would not).
        """
        while hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer
        return optimizer

    def parameter_shape(self, param: torch.Tensor) -> torch.Size:
        """The whole parameter's shape, whatever part of it this process holds."""
        return param.shape

    def held_elements(self, param: torch.Tensor) -> int:
        """How many of the parameter's elements this process holds."""
        return param.numel()

    @property
    def scaler(self):
        """fp16's gradient scaler, or None."""
        return getattr(self.accelerator, "scaler", None)

    # ---------------------------------------------------------------- inside a training step

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.accelerator.autocast()

    @contextlib.contextmanager
    def micro_batch(self, model, last: bool) -> Iterator[None]:
        """One micro-batch of an optimizer step. Only the last one synchronizes: DDP skips its all-reduce before it
        (no_sync), and DeepSpeed, told through sync_gradients, reaches its accumulation boundary and steps there."""
        accelerator = self.accelerator
        accelerator.sync_gradients = last
        try:
            with contextlib.nullcontext() if last else accelerator.no_sync(model):
                yield
        finally:
            accelerator.sync_gradients = True

    def backward(self, loss: torch.Tensor) -> None:
        """accelerator.backward of a loss that is already normalized over the whole step: accelerate divides by its
        gradient accumulation steps, which may not apply here."""
        self.accelerator.backward(loss * self.accelerator.gradient_accumulation_steps)

    def clip_grad_norm(self, model, max_norm: float | None) -> float:
        """The global gradient norm, clipped to `max_norm` (None: measured only)."""
        return self.accelerator.clip_grad_norm_(model.parameters(), max_norm or float("inf"))

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`batch` on this process's device."""
        return {k: v.to(self.device) for k, v in batch.items()}

    def parameter_norms(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The norm of each tensor (gradients), as a float32 CPU vector. A collective where tensors are sharded."""
        return torch.stack([t.detach().float().norm() for t in tensors]).cpu()

    def step_boundary(self) -> None:
        """Where one optimizer step (or evaluation batch) ends; only XLA acts on it."""

    def step_metrics(self) -> dict[str, int]:
        """Backend-specific figures for the training row (XLA: its compilations)."""
        return {}

    # ---------------------------------------------------------------- saving

    def saveable_state_dict(self, model) -> dict[str, torch.Tensor]:
        """The model's whole state dict, as safetensors can write it. A collective under ZeRO-3: every rank calls it."""
        return self.accelerator.get_state_dict(model)

    def optimizer_state_dict(self, optimizer) -> dict[str, Any]:
        """What optimizer.pt holds."""
        return optimizer.state_dict()

    def save_engine_state(self, model, optimizer, folder: Path) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no engine state")

    def load_engine_state(self, model, optimizer, folder: Path) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no engine state")

    def engine_pickled_types(self) -> list[type]:
        """The classes besides tensors and plain values that the engine's checkpoint files may hold (what the
        weights-only check of those files allows)."""
        return []

    def whole_copy(self, unwrapped, state_dict: dict[str, torch.Tensor]):
        """A model whose weights are whole and in memory, for merging a LoRA adapter into: `unwrapped` itself here.
        Main process only."""
        return unwrapped


def rebuilt_copy(unwrapped, state_dict: dict[str, torch.Tensor]):
    """A whole fp32 CPU copy of the PEFT model `unwrapped`, built from its gathered `state_dict`: what a backend
    whose in-memory model cannot be merged as it is (partitioned, or on another device) gives whole_copy."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(unwrapped.get_base_model().config, dtype=torch.float32)
    copy = get_peft_model(base, unwrapped.peft_config[unwrapped.active_adapter])
    copy.load_state_dict(to_cpu(state_dict))
    return copy
