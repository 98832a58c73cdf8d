"""Opening a model named by one path, as `eval` and `serve` take it: a Hub id, a model folder, a `.gguf` file, a
LoRA adapter folder (loaded over the base it names), or a training checkpoint `step_N/` (its weights are in
`step_N/model/`, and its tokenizer is the one its run's config.yaml names). Also what identifies the weights that
were opened: their paths and content hashes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from gpt4all_training.errors import UserError
from gpt4all_training.files import sha256_file
from gpt4all_training.model.loading import (adapter_base, describe_quantization, is_adapter_folder, is_checkpoint,
                                            load_model, load_tokenizer, training_run_config)
from gpt4all_training.model.names import resolved_name

# The precisions `eval` and `serve` load weights in (a training config's dtype, for the end-of-training evaluation).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelPaths:
    """What `load_model` and `load_tokenizer` are given for one `--model` path."""
    weights: str
    tokenizer: str
    tokenizer_gguf_file: Optional[str] = None
    tokenizer_revision: Optional[str] = None


def resolve(name: str) -> ModelPaths:
    """The weights and tokenizer `name` stands for; anything that is not a checkpoint is its own tokenizer source
    (load_tokenizer finds an adapter's base itself)."""
    path = Path(name)
    if not is_checkpoint(path):
        return ModelPaths(name, name)
    weights = path / "model"
    if is_adapter_folder(str(weights)) or any((weights / f).is_file() for f in TOKENIZER_FILES):
        return ModelPaths(str(weights), str(weights))
    # A full-model checkpoint holds no tokenizer: it is the one the run trained with.
    _, run = training_run_config(name) or (None, {})
    source = run.get("tokenizer_name") or run.get("model_name")
    if not source:
        raise UserError(f"--model {name}: a checkpoint without a tokenizer, and no config.yaml naming the run's "
                        f"tokenizer_name or model_name beside it")
    return ModelPaths(str(weights), source, run.get("gguf_file"), run.get("model_revision"))


def open_model(name: str, dtype: torch.dtype, device: torch.device):
    """(model in eval mode on `device`, tokenizer) for `name`; see the module docstring for what it may be."""
    paths = resolve(name)
    tokenizer = load_tokenizer(paths.tokenizer, paths.tokenizer_revision, paths.tokenizer_gguf_file, key="--model")
    model = load_model(paths.weights, dtype=dtype, key="--model")
    return model.to(device).eval(), tokenizer


def content_sha256(path: Path) -> str:
    """SHA-256 of a file; for a folder, of the names and hashes of the files directly in it (not its sub-folders,
    so final/ does not include final/merged/)."""
    if path.is_file():
        return sha256_file(path)
    digest = hashlib.sha256()
    for child in sorted(p for p in path.iterdir() if p.is_file()):
        digest.update(f"{child.name}\0{content_sha256(child)}\n".encode())
    return digest.hexdigest()


def source_identity(name: str) -> dict[str, Any]:
    """The path as given and the hash of its content (a packaged model's file, for its short name); a Hub id has no
    local content to hash (its revision is recorded by whoever loads it)."""
    path = Path(resolved_name(name))
    return {"path": name, "sha256": content_sha256(path) if path.exists() else None}


def describe(name: str) -> dict[str, Any]:
    """What was opened for `name`: its weights (an adapter with its base) and, when it comes from elsewhere (a
    checkpoint's run), its tokenizer, each with a content hash."""
    paths = resolve(name)
    weights = source_identity(paths.weights)
    if is_adapter_folder(paths.weights):
        weights["adapter_of"] = source_identity(adapter_base(paths.weights))
        if quantization := describe_quantization(paths.weights):  # loaded over its base quantized the same way
            weights["adapter_of"]["quantization"] = quantization
    described = {"path": name, "weights": weights}
    if paths.tokenizer != paths.weights:
        described["tokenizer"] = source_identity(paths.tokenizer)
    return described
