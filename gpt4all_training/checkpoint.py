"""What a checkpoint holds, and writing it so a crash never leaves a half checkpoint that gets loaded.

`output_dir/step_N/` holds `model/` (the full model or the adapter, safetensors), `optimizer.pt`, `scheduler.pt`,
`rng/rank{r}.pt`, `state.json` (step, epoch, position, trained tokens), `config.yaml`, and last the `COMPLETE`
marker, which lists every file's SHA-256. It is written as `step_N.tmp/`, fsynced, then renamed; a folder without a
valid marker is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import UserError

MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step_(\d+)$")


# ---------------------------------------------------------------- RNG

def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, as plain tensors and lists (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state = {
        "python": [list(random.getstate()[1]), random.getstate()[0], random.getstate()[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    words, version, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    name, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- files

def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_marker(folder: Path) -> None:
    files = {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}
    (folder / MARKER).write_text(json.dumps({"files": files}, indent=1), encoding="utf-8")


def verify(folder: Path) -> str | None:
    """None if `folder` is a complete, intact checkpoint; otherwise why not."""
    marker = folder / MARKER
    if not marker.is_file():
        return "no completion marker (the save was interrupted)"
    try:
        files = json.loads(marker.read_text(encoding="utf-8"))["files"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
        return "unreadable completion marker"
    for name, digest in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256(path) != digest:
            return f"{name} does not match its checksum (corrupted or truncated)"
    return None


def checkpoint_dirs(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) for every step_N folder, oldest first (complete or not)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found)


def latest_checkpoint(output_dir: str | Path, log=print) -> Path | None:
    """The newest checkpoint that verifies; incomplete or corrupted ones are reported and skipped."""
    for _, folder in reversed(checkpoint_dirs(output_dir)):
        problem = verify(folder)
        if problem is None:
            return folder
        log(f"skipping checkpoint {folder}: {problem}")
    return None


def rotate(output_dir: str | Path, keep_last: int | None, keep_every: int | None = None) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (and those at multiples of `keep_every`)."""
    if keep_last is None:
        return
    complete = [(s, p) for s, p in checkpoint_dirs(output_dir) if (p / MARKER).is_file()]
    for step, folder in complete[:-keep_last]:
        if keep_every and step % keep_every == 0:
            continue
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- save / load

def save_checkpoint(folder: Path, accelerator, model, optimizer, scheduler, state: dict[str, Any],
                    config_yaml: str) -> Path:
    """Write the checkpoint atomically. A collective: every rank calls it."""
    tmp = folder.with_name(folder.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards: every rank must call it
    torch.save(rng_state(), tmp / "rng" / f"rank{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(tmp / "model", state_dict=state_dict, safe_serialization=True)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=1), encoding="utf-8")
        (tmp / "config.yaml").write_text(config_yaml, encoding="utf-8")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_marker(tmp)
        fsync_tree(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        fd = os.open(folder.parent, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    accelerator.wait_for_everyone()
    return folder


def load_model_weights(model, model_dir: Path) -> None:
    """Load saved weights (full model or adapter) into an already built model, in place."""
    from safetensors.torch import load_file

    adapter_file = model_dir / "adapter_model.safetensors"
    if adapter_file.is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(adapter_file)))
        return
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise UserError(f"checkpoint {model_dir}: no safetensors weights")
    state_dict = {}
    for shard in shards:
        state_dict.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    # A tied output embedding is saved once, under the input embedding's name; anything else missing is a mismatch.
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise UserError(f"checkpoint {model_dir}: weights do not fit this model (e.g. {(missing or unexpected)[0]})")


def load_checkpoint(folder: Path, accelerator, model, optimizer, scheduler) -> dict[str, Any]:
    """Restore model, optimiser, scheduler and this rank's RNG from a verified checkpoint; return its state."""
    problem = verify(folder)
    if problem is not None:
        raise UserError(f"checkpoint {folder}: {problem}; pick another step_N folder")
    load_model_weights(accelerator.unwrap_model(model), folder / "model")
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True, map_location="cpu"))
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    rng_file = folder / "rng" / f"rank{accelerator.process_index}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return json.loads((folder / "state.json").read_text(encoding="utf-8"))
