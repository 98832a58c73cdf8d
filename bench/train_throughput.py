"""Training throughput against named baselines, side by side: `python bench/train_throughput.py --model tiny-gptj`.

Every row trains the same model on the same data (the Dolly sample, cleaned; the same 95/5 split), with the same
effective batch (8 examples per optimiser step; micro-batch and accumulation per model in harness.MODELS), the same number of optimiser steps, lr, schedule (cosine, no
warmup), clipping and precision. The rows differ only in what they are named for:

  gpt4all      gpt4all-training's data path inside our loop: their tokenize_inputs re-implemented (prompt cut by
               characters, EOS appended as text and lost to truncation, every example padded to max_length=1024,
               their attention mask), stacked like their DefaultDataCollator.
  ours         this repository with default settings (pad each micro-batch to its longest example).
  ours-packed  packing: true.
  trl          TRL SFTTrainer with its defaults for prompt/completion data (completion-only loss, pad to the
               longest, its fused LM-head loss, gradient checkpointing on, as SFTConfig defaults to).
  extra rows   trl-nogc (TRL with gradient checkpointing off), ours-grouped (group_by_length: true),
               ours-packed-compile (packing + compile: true).

Runs alternate (the order of rows rotates every repeat) and each is a fresh process; the table shows medians.
Trained tokens/s counts the tokens the loss is taken on (response tokens), over the steps after the first
the model's warm-up steps (harness.MODELS). The final eval loss is computed the same way for every row, afterwards: our token-weighted loss of the
saved model on our tokenisation of the validation split, in fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

REQUIRED = ["gpt4all", "ours", "ours-packed", "trl"]
EXTRA = ["trl-nogc", "ours-grouped", "ours-packed-compile"]
LABELS = {
    "gpt4all": "gpt4all-style (pad to 1024)", "ours": "ours (default)", "ours-packed": "ours + packing",
    "trl": "TRL SFTTrainer (defaults)", "trl-nogc": "TRL, grad. checkpointing off",
    "ours-grouped": "ours + group_by_length", "ours-packed-compile": "ours + packing + compile",
}
OURS_EXTRA = {"ours": [], "ours-packed": ["packing=true"], "ours-grouped": ["group_by_length=true"],
              "ours-packed-compile": ["packing=true", "compile=true"], "gpt4all": []}


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


def gpt4all_load_data(config, tokenizer):
    """Stands in for data.load_data in the gpt4all row: their tokenisation, every row max_length long.
    No validation split here: the final eval loss is computed after training, the same way for every row."""
    import numpy as np
    from datasets import Dataset

    from gpt4all_training.data.records import load_records
    from gpt4all_training.data.sft import DataStats, split_records

    train_raw, _ = split_records(load_records(config.dataset_path), config.val_fraction, config.seed)
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

def run_ours(variant: str, kind: str, steps: int, out: Path) -> dict[str, Any]:
    import gpt4all_training.training.loop as loop
    from gpt4all_training.config.loader import load_config

    steps_log: list[tuple[float, float, float, float]] = []
    started: list[float] = []
    train_step = loop.train_step

    def timed_train_step(*args, **kwargs):
        if not started:
            started.append(time.perf_counter())
        result = train_step(*args, **kwargs)
        steps_log.append((time.perf_counter(), result["n_trained"], result["n_real"], result["n_padded"]))
        return result

    loop.train_step = timed_train_step
    if variant == "gpt4all":
        loop.load_data = gpt4all_load_data
        loop.batch_fetcher = lambda packing, max_length: gpt4all_fetch
    overrides = harness.ours_overrides(kind, harness.model_dir(kind), harness.clean_data(), out, steps)
    loop.train(load_config(None, overrides + OURS_EXTRA[variant]))
    peak = harness.peak_rss_mb()
    return summarize(steps_log, started[0], peak, out / "final", harness.MODELS[kind]["warmup"])


def run_trl(variant: str, kind: str, steps: int, out: Path, order_seed: int = harness.SEED) -> dict[str, Any]:
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
    peft_config = None
    if m["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="CAUSAL_LM", r=m["lora_r"], lora_alpha=m["lora_alpha"],
                                 lora_dropout=m["lora_dropout"], target_modules=m["lora_targets"])
    settings = {"output_dir": str(out / "trl"), "per_device_train_batch_size": m["batch_size"],
                "gradient_accumulation_steps": m["accumulation"], "max_steps": steps, "learning_rate": m["lr"],
                "lr_scheduler_type": "cosine", "warmup_steps": 0, "max_grad_norm": 1.0, "weight_decay": 0.0,
                "bf16": m["dtype"] == "bfloat16", "save_strategy": "no", "report_to": "none",
                "seed": order_seed, "use_cpu": True, "disable_tqdm": True}
    if variant == "trl-nogc":
        settings["gradient_checkpointing"] = False
    trainer = SFTTrainer(model=model, args=SFTConfig(**settings), train_dataset=data, processing_class=tokenizer,
                         peft_config=peft_config)

    counts: list[tuple[float, float, float]] = []
    collator = trainer.data_collator

    def counting_collator(examples):
        batch = collator(examples)
        counts.append((float((batch["labels"][:, 1:] != -100).sum()), float(batch["attention_mask"].sum()),
                       float(batch["input_ids"].numel())))
        return batch

    ends: list[float] = []
    started: list[float] = []

    class StepTimes(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            started.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer.data_collator = counting_collator
    trainer.add_callback(StepTimes())
    torch.manual_seed(harness.SEED)
    trainer.train()
    peak = harness.peak_rss_mb()
    trainer.save_model(str(out / "final"))
    per_step = [tuple(sum(c[k] for c in counts[i:i + m["accumulation"]]) for k in range(3))
                for i in range(0, len(counts), m["accumulation"])]  # micro-batches in order, `accumulation` a step
    steps_log = [(t, *c) for t, c in zip(ends, per_step)]
    return summarize(steps_log, started[0], peak, out / "final", m["warmup"])


def summarize(steps_log, started: float, peak_rss: float, final_dir: Path, warmup: int) -> dict[str, Any]:
    times = [s[0] for s in steps_log]
    trained = [s[1] for s in steps_log]
    rate, seconds, measured = harness.steady_rate(times, trained, warmup)
    real = sum(s[2] for s in steps_log)
    padded = sum(s[3] for s in steps_log)
    return {"trained_tokens_per_s": rate, "measured_seconds": seconds, "measured_steps": measured,
            "warmup_seconds": times[warmup - 1] - started, "steps": len(steps_log),
            "trained_tokens": sum(trained), "tokens_processed": padded, "real_tokens": real,
            "padding_fraction": 1 - real / padded, "peak_rss_mb": peak_rss, "eval_loss": final_eval_loss(final_dir)}


def final_eval_loss(final_dir: Path) -> float:
    """The saved model's token-weighted loss on our tokenisation of the validation split, fp32, for every row."""
    from accelerate import Accelerator

    from gpt4all_training.data.records import load_records
    from gpt4all_training.data.sft import finish_split, split_records, tokenize_dataset
    from gpt4all_training.training.evaluate import evaluate_loss
    from gpt4all_training.model.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(str(final_dir))
    model = load_model(str(final_dir))
    _, val_raw = split_records(load_records(str(harness.clean_data())), 0.05, harness.SEED)
    val, _ = finish_split(tokenize_dataset(val_raw, tokenizer, harness.MAX_LENGTH, "plain", None))
    return evaluate_loss(model, val, Accelerator(cpu=True), harness.EVAL_BATCH_SIZE,
                         tokenizer.pad_token_id)["val_loss"]


def worker(variant: str, kind: str, steps: int, out: Path, trl_seed: int) -> None:
    harness.setup_environment()
    if variant.startswith("trl"):
        result = run_trl(variant, kind, steps, out, trl_seed)
    else:
        result = run_ours(variant, kind, steps, out)
    print(json.dumps({"variant": variant, **result}))


# ---------------------------------------------------------------- the side-by-side table

def table(results: dict[str, list[dict[str, Any]]], variants: list[str]) -> str:
    med = {v: {k: harness.median([r[k] for r in results[v]]) for k in results[v][0] if k != "variant"}
           for v in variants if results.get(v)}
    base = med.get("gpt4all")
    trl = med.get("trl")
    head = ("| run | trained tok/s (median) | vs gpt4all | vs TRL | tokens processed | padding | peak RSS MiB | "
            "final eval loss | runs |")
    lines = [head, "|" + "---|" * 9]
    for v in [v for v in variants if v in med]:
        row = med[v]
        tps = row["trained_tokens_per_s"]
        spread = sorted(r["trained_tokens_per_s"] for r in results[v])
        vs_base = f"{tps / base['trained_tokens_per_s']:.2f}x" if base else "-"
        vs_trl = f"{tps / trl['trained_tokens_per_s']:.2f}x" if trl else "-"
        lines.append(f"| {LABELS[v]} | {tps:,.0f} ({spread[0]:,.0f}-{spread[-1]:,.0f}) | {vs_base} | {vs_trl} | "
                     f"{row['tokens_processed']:,.0f} | {row['padding_fraction']:.1%} | {row['peak_rss_mb']:,.0f} | "
                     f"{row['eval_loss']:.4f} | {len(results[v])} |")
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
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = args.steps or harness.MODELS[args.model]["steps"]
    if args.worker:
        worker(args.worker, args.model, steps, args.out, args.trl_seed)
        return 0

    harness.setup_environment()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(LABELS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(LABELS)}")
    harness.clean_data()
    harness.model_dir(args.model)
    m = harness.MODELS[args.model]
    print(f"# {args.model}: {steps} steps x {m['batch_size']} x {m['accumulation']} examples, {args.repeats} repeats; "
          f"{harness.machine()}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        order = variants[repeat % len(variants):] + variants[:repeat % len(variants)]
        for variant in order:
            out = harness.WORK / "runs" / args.model / f"{variant}-{repeat}"
            try:
                result = harness.run_worker("train_throughput.py", ["--worker", variant, "--model", args.model,
                                                                    "--steps", str(steps), "--out", str(out),
                                                                    "--trl-seed", str(args.trl_seed)])
            except RuntimeError as exc:  # one broken row must not lose the others' numbers
                print(f"  repeat {repeat + 1} {variant}: FAILED\n{exc}", flush=True)
                continue
            results[variant].append(result)
            print(f"  repeat {repeat + 1} {variant}: {result['trained_tokens_per_s']:,.0f} trained tok/s, "
                  f"eval loss {result['eval_loss']:.4f}, padding {result['padding_fraction']:.1%}, "
                  f"peak RSS {result['peak_rss_mb']:,.0f} MiB ({result['process_seconds']} s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(table(results, variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
