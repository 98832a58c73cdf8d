"""Where a pair's reference log-probabilities come from: LoRA's base with the adapter disabled, a precomputed pass of
the initial weights over every pair (cached with the tokenized data), or a frozen copy (objectives/shared.py)."""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from gpt4all_training.config.blocks import ModelSource
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.cache import entry_problem, load_arrays, write_arrays
from gpt4all_training.data.pairs import REFERENCE_COLUMNS, fetch_pairs
from gpt4all_training.model.loading import adapter_base, is_adapter_folder
from gpt4all_training.progress import progress
from gpt4all_training.training.evaluate import eval_batches
from gpt4all_training.training.loss import sequence_logps
from gpt4all_training.training.objectives.protocol import Batch
from gpt4all_training.training.objectives.shared import peft_model


def precomputed(model, batch: Batch) -> torch.Tensor:
    """The reference log-probabilities fetch_pairs brought along from the dataset."""
    return batch["reference_logps"]


def adapter_disabled(model, batch: Batch) -> torch.Tensor:
    """LoRA's reference: the same forward with the adapter switched off, which is the base model."""
    with torch.no_grad(), peft_model(model).disable_adapter():
        return sequence_logps(model, batch)


def reference_kind(config: TrainConfig) -> Optional[str]:
    """Where the reference log-probabilities come from: "adapter" (LoRA: the base with the adapter disabled),
    "precomputed" or "frozen_copy" (full fine-tuning, by `reference`), or None (simpo has no reference)."""
    if config.loss_type == "simpo":
        return None
    return "adapter" if config.lora else config.reference or "precomputed"


# The references that need nothing but the batch and the model being trained; a frozen copy is made from the
# prepared model (frozen_copy).
REFERENCES = {"adapter": adapter_disabled, "precomputed": precomputed}


@torch.no_grad()
def reference_logps(model, dataset, backend, batch_size: int, pad_id: int, split: str) -> np.ndarray:
    """(pairs, 2) float32: each pair's chosen and rejected log-probabilities under `model`, every rank scoring its
    share of each global batch (as validation shares them), then summed across ranks so every rank has them all.
    A "reference (`split`)" bar counts the global batches."""
    was_training = model.training
    model.eval()
    out = torch.zeros(len(dataset), 2, dtype=torch.float32, device=backend.device)
    batches = eval_batches(len(dataset), batch_size, backend.world_size, backend.rank, None)
    with progress(f"reference ({split})", len(batches), backend.is_main_process) as bar:
        for indices, real in batches:
            batch = backend.to_device(fetch_pairs(dataset, indices, pad_id))
            with backend.autocast():
                logps = sequence_logps(model, batch).float()
            if real:
                out[indices] = torch.stack(logps.chunk(2), dim=1)
            backend.step_boundary()
            bar.update(1)
    model.train(was_training)
    return backend.reduce(out).cpu().numpy()  # one rank holds each value, the others zeros: the sum is exact


def model_files(name: str) -> list[tuple[str, int, int]]:
    """(path, size, modification time) of the files a local model is read from (an adapter's base's too); none for
    a Hub id, which its revision names."""
    path = Path(name).expanduser()
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.glob("*") if p.is_file()) if path.is_dir() else []
    found = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    if is_adapter_folder(name):
        found += model_files(adapter_base(name))
    return found


def reference_key(config: ModelSource) -> str:
    """What decides the precomputed log-probabilities besides the tokenized pairs: the model and its files, the
    compute dtype, and the versions of the code that scores them."""
    import transformers

    assert config.model_name is not None  # validate() refuses a config without it
    code = hashlib.sha256()
    for source in (inspect.getfile(sequence_logps), __file__):  # training/loss.py and this module
        code.update(Path(source).read_bytes())
    described = {"model": [config.model_name, config.model_revision, config.gguf_file, model_files(config.model_name)],
                 "dtype": config.dtype, "code": code.hexdigest(),
                 "versions": [torch.__version__, transformers.__version__]}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]


def attach_reference(data, model, backend, config: TrainConfig, pad_id: int, entry: Optional[Path], log) -> None:
    """Add the reference log-probabilities of the initial weights to the train and validation pairs (columns
    REFERENCE_COLUMNS), from the cache entry of the tokenized data when it has them, else computed now and saved
    there. Runs before a resume loads its checkpoint, so `model` still holds the initial weights either way."""
    folder = entry / f"reference-{reference_key(config)}" if entry is not None else None
    cached = folder is not None and entry_problem(folder) is None
    if not backend.any_rank(not cached):  # every rank must take part in a computation, or none
        assert folder is not None  # cached
        arrays = load_arrays(folder)
        log(f"reference log-probabilities: cache hit ({folder})")
    else:
        arrays = {name: reference_logps(model, split, backend, config.batch_size, pad_id, name)
                  for name, split in (("train", data.train), ("validation", data.val))}
        saved = "not saved (the tokenized data is not cached)"
        if backend.is_main_process and folder is not None and entry is not None and entry_problem(entry) is None:
            try:
                write_arrays(folder, arrays)
                saved = f"saved to {folder}"
            except OSError as exc:  # a cache that cannot be written costs the next start a pass, never this run
                saved = f"not saved ({exc.strerror or type(exc).__name__})"
        log(f"reference log-probabilities: computed for {len(data.train)} train and {len(data.val)} validation "
            f"pairs with the initial weights; {saved}")
    data.train, data.val = (with_reference(split, arrays[name]) for split, name in
                            ((data.train, "train"), (data.val, "validation")))


def with_reference(split, logps: np.ndarray):
    for column, values in zip(REFERENCE_COLUMNS, logps.T):
        split = split.add_column(column, values.tolist())
    return split
