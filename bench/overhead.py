"""The loop's overhead: `python bench/overhead.py --model tiny-gptj`.

"loop" is train() with default settings (plus `--packing` if given). "bare" is the least a training loop can do over
the same batches: the same micro-batches, built before the clock starts, the same model, optimiser and loss
function (token_loss_sum over the step's trained tokens), then forward, backward, optimizer.step, zero_grad, and
nothing else. The difference is what the loop adds: reading and collating the batch from the dataset, token
counting and the cross-rank reduce, gradient clipping, the lr schedule, metrics.jsonl and the progress bar.
Runs alternate, each in a fresh process; it prints medians of trained tokens/s after the model's warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def run_loop(kind: str, steps: int, out: Path, extra: list[str]) -> dict:
    import gpt4all_training.training.loop as loop
    from gpt4all_training.config.loader import load_config

    ends: list[float] = []
    trained: list[float] = []
    train_step = loop.train_step

    def timed_train_step(*args, **kwargs):
        result = train_step(*args, **kwargs)
        ends.append(time.perf_counter())
        trained.append(result["n_trained"])
        return result

    loop.train_step = timed_train_step
    overrides = harness.ours_overrides(kind, harness.model_dir(kind), harness.clean_data(), out, steps)
    loop.train(load_config(None, overrides + ["eval_steps=1"] + extra))
    rate, seconds, measured = harness.steady_rate(ends, trained, harness.MODELS[kind]["warmup"])
    return {"trained_tokens_per_s": rate, "seconds": seconds, "steps": measured, "trained_tokens": sum(trained)}


def run_bare(kind: str, steps: int, out: Path, extra: list[str]) -> dict:
    import torch

    from gpt4all_training.config.loader import load_config
    from gpt4all_training.data.sft import load_data
    from gpt4all_training.batch import trained_token_count
    from gpt4all_training.training.loss import token_loss_sum
    from gpt4all_training.model.loading import load_model, load_tokenizer
    from gpt4all_training.model.lora import apply_lora
    from gpt4all_training.model.parameters import param_groups
    from gpt4all_training.data.batching import batch_fetcher
    from gpt4all_training.data.sampling import StepSampler

    config = load_config(None, harness.ours_overrides(kind, harness.model_dir(kind), harness.clean_data(), out,
                                                      steps) + extra)
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(config.model_name)
    (train_ds, _), _ = load_data(config, tokenizer)
    model = load_model(config.model_name)
    if config.lora:
        model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules,
                           False)
    sampler = StepSampler(len(train_ds), config.batch_size, grad_accum=config.gradient_accumulation_steps,
                          seed=config.seed)
    fetch = batch_fetcher(config.packing, config.max_length)
    steps_batches = [[fetch(train_ds, indices, tokenizer.pad_token_id) for indices in sampler.step_indices(s)]
                     for s in range(steps)]
    optimizer = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.dtype == "bfloat16")
    model.train()
    ends, trained = [], []
    for micro_batches in steps_batches:
        n_trained = sum(trained_token_count(b) for b in micro_batches)
        for batch in micro_batches:
            with autocast:
                loss = token_loss_sum(model, batch) / n_trained
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
        trained.append(n_trained)
    rate, seconds, measured = harness.steady_rate(ends, trained, harness.MODELS[kind]["warmup"])
    return {"trained_tokens_per_s": rate, "seconds": seconds, "steps": measured, "trained_tokens": sum(trained)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(harness.MODELS), default="tiny-gptj")
    parser.add_argument("--steps", type=int, help="optimiser steps per run (default: per model)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--packing", action="store_true", help="both loops with packing: true")
    parser.add_argument("--worker", choices=["loop", "bare"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = args.steps or harness.MODELS[args.model]["steps"]
    extra = ["packing=true"] if args.packing else []
    if args.worker:
        harness.setup_environment()
        result = (run_loop if args.worker == "loop" else run_bare)(args.model, steps, args.out, extra)
        print(json.dumps(result))
        return 0

    harness.setup_environment()
    harness.clean_data()
    harness.model_dir(args.model)
    print(f"# {args.model}{' + packing' if args.packing else ''}: {steps} steps, {args.repeats} repeats; "
          f"{harness.machine()}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    rates: dict[str, list[float]] = {"loop": [], "bare": []}
    for repeat in range(args.repeats):
        for mode in (("loop", "bare") if repeat % 2 == 0 else ("bare", "loop")):
            out = harness.WORK / "runs" / "overhead" / f"{args.model}-{mode}-{repeat}"
            worker_args = ["--worker", mode, "--model", args.model, "--steps", str(steps), "--out", str(out)]
            result = harness.run_worker("overhead.py", worker_args + (["--packing"] if args.packing else []))
            rates[mode].append(result["trained_tokens_per_s"])
            print(f"  repeat {repeat + 1} {mode}: {result['trained_tokens_per_s']:,.0f} trained tok/s", flush=True)
    loop, bare = harness.median(rates["loop"]), harness.median(rates["bare"])
    paired = sorted(1 - l / b for l, b in zip(rates["loop"], rates["bare"]))
    print(f"loop {loop:,.0f} trained tok/s, bare {bare:,.0f} (medians); overhead {1 - loop / bare:.1%} "
          f"(per-repeat pairs: {', '.join(f'{p:.1%}' for p in paired)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
