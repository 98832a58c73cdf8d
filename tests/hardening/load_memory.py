"""`python load_memory.py MODEL_DIR WARMUP_DIR`: peak resident memory that loading MODEL_DIR adds, as a multiple of
its weights' bytes, through modeling.load_model and through the naive way (build with random weights, then
load_state_dict), printed as JSON. Linux only: the peak (VmHWM) is reset through /proc/self/clear_refs before each."""

from __future__ import annotations

import gc
import json
import sys

import torch


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def peak_growth(load) -> tuple[object, int]:
    """(what `load` returns, the peak RSS it added). Every weight is read once after loading, so pages that a lazy
    (memory-mapped) load leaves on disk are counted too."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = status_bytes("VmRSS")
    model = load()
    with torch.no_grad():
        sum(float(p.sum()) for p in model.parameters())
    return model, status_bytes("VmHWM") - before


def naive_load(path: str):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    model.load_state_dict(load_file(f"{path}/model.safetensors"))
    return model


def main() -> None:
    from gpt4all_training.model.loading import load_model

    path, warmup = sys.argv[1:3]
    load_model(warmup)  # imports and first-call set-up are not the model's memory
    model, ours = peak_growth(lambda: load_model(path))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    _, naive = peak_growth(lambda: naive_load(path))
    print(json.dumps({"weight_bytes": weight_bytes, "load_model": ours / weight_bytes, "naive": naive / weight_bytes}))


if __name__ == "__main__":
    main()
