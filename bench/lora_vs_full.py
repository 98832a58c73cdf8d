"""LoRA against full fine-tuning on the same tokens, side by side: `python bench/lora_vs_full.py`.

LoRA needs about two thirds of full fine-tuning's FLOPs a token (the frozen base gets input gradients, no weight
gradients), so its step should process about 1.5x the tokens a second. Each repeat runs, in a rotating order and each
in a fresh process, train_throughput.py's workers for SmolLM2-135M with packing on: LoRA (model/lora.py's fused
layers), LoRA through PEFT's own layers, full fine-tuning, and TRL's packed LoRA row (for memory). The rows train
the same data for the same steps at the same precision. Printed: real tokens/s (totals over totals of every
repeat's timed steps), LoRA over full, and each row's median peak RSS against TRL's. `--scale 4` runs issue 45's
own setting: TRL at 4 packed rows of 512 tokens a step (its batch 4 x max_length 512), ours at about as many tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from step_profile import shares_table  # noqa: E402

ROWS = {"lora": ("smollm2", "ours-packed"), "lora-peft": ("smollm2", "ours-packed-peft-lora"),
        "full": ("smollm2-full", "ours-packed"), "trl-lora": ("smollm2", "trl-packed")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=22, help="optimiser steps a run (the first 2 untimed)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each row, alternating")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument("--scale", type=int, default=1,
                        help="examples per micro-batch (3) and TRL's packed rows of 512 tokens (1), times this")
    parser.add_argument("--json", type=Path, help="also write every run's numbers here")
    parser.add_argument("--profile", action="store_true",
                        help="also profile each run's timed steps (bench/step_profile.py) and print where a step's "
                             "time and memory go, row against row; profiled runs are slower: time them without")
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    if set(rows) - set(ROWS):
        parser.error(f"unknown rows {sorted(set(rows) - set(ROWS))}; choose from {', '.join(ROWS)}")
    harness.setup_environment()
    harness.set_threads(args.threads)
    harness.clean_data()
    for kind in {ROWS[r][0] for r in rows}:
        harness.model_dir(kind)
    print(f"# SmolLM2-135M, {args.steps} steps, {3 * args.scale} examples a step (TRL: {args.scale} packed rows of 512 "
          f"tokens), {args.dtype}, {args.threads} threads, LoRA dropout "
          f"{args.lora_dropout}, {args.repeats} repeats; {harness.machine()}; {time.strftime('%Y-%m-%d %H:%M')}",
          flush=True)
    results: dict[str, list[dict]] = {r: [] for r in rows}
    for repeat in range(args.repeats):
        for row in rows[repeat % len(rows):] + rows[:repeat % len(rows)]:
            kind, variant = ROWS[row]
            out = harness.WORK / "runs" / "lora_vs_full" / f"{row}-{repeat}"
            shutil.rmtree(out, ignore_errors=True)
            result = harness.run_worker("train_throughput.py", [
                "--worker", variant, "--model", kind, "--steps", str(args.steps), "--out", str(out),
                "--dtype", args.dtype, "--threads", str(args.threads), "--scale", str(args.scale), "--lora-dropout", str(args.lora_dropout),
                "--skip-eval", *(["--profile"] if args.profile else [])])
            results[row].append(result)
            print(f"  repeat {repeat + 1} {row}: {result['real_tokens_per_s']:,.1f} real tok/s, "
                  f"{result['cpu_seconds_per_step']:.2f} CPU s/step, peak {result['peak_memory_mb']:,.0f} MiB",
                  flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    print(table(results))
    if args.profile:
        print("\nWhere the time goes (shares of a profiled step):")
        print(shares_table({row: runs for row, runs in results.items() if runs}))
    return 0


def real_rate(runs: list[dict]) -> float:
    """Totals over totals: every repeat's timed real tokens over their seconds."""
    return (sum(r["real_tokens_per_s"] * r["measured_seconds"] for r in runs)
            / sum(r["measured_seconds"] for r in runs))


def table(results: dict[str, list[dict]]) -> str:
    done = {row: runs for row, runs in results.items() if runs}
    rates = {row: real_rate(runs) for row, runs in done.items()}
    memory = {row: harness.median([r["peak_memory_mb"] for r in runs]) for row, runs in done.items()}
    lines = ["| row | real tok/s (runs) | vs full | CPU s/step | peak RSS MiB | RSS vs TRL LoRA |", "|---|---|---|---|---|---|"]
    for row, runs in done.items():
        spread = sorted(r["real_tokens_per_s"] for r in runs)
        versus_full = f"{rates[row] / rates['full']:.2f}x" if "full" in rates else "-"
        versus_trl = f"{memory[row] / memory['trl-lora']:.0%}" if "trl-lora" in memory else "-"
        cpu = harness.median([r["cpu_seconds_per_step"] for r in runs])
        lines.append(f"| {row} | {rates[row]:,.1f} ({spread[0]:,.1f}-{spread[-1]:,.1f}) | {versus_full} | {cpu:.2f} | "
                     f"{memory[row]:,.0f} | {versus_trl} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
