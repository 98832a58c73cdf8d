"""What each piece of our training step costs, against a plain transformers (+ PEFT) step on the same examples:
`python bench/step_costs.py --model smollm2 --batch-size 4`.

One process holds two copies of the model (the same weights): a plain one (load_model, PEFT's LoRA for LoRA rows,
torch.autocast, torch AdamW) and ours as train() builds it (the backend's Accelerator, our parameter groups and
schedule). Each round takes the next `--batch-size` examples of our tokenised training split and runs one optimizer
step of every rung on them, the rungs in a rotating order; the first round is a warm-up. A rung differs from the one
above it by one piece, so the differences of their times are what the pieces cost:

  plain               the examples concatenated into dense rows (the fewest of at most max_length, equal width),
                      every position trained, the model's own full-vocabulary loss, backward, clipping, AdamW
  packed-causal       our packed rows without their position ids: causal attention across each row's examples (not
                      what training may do; it separates the padding of the rows from their block mask)
  plain-packed        our packed micro-batch instead (position ids restarting per example, padding to the longest
                      row, prompt positions not trained), the model's own loss: padding and the block mask
  chunked-head        our token loss (the head over trained positions only, in chunks) instead of the model's
  ours                our train_step on our model (the backend's autocast, reduce, clipping, scheduler, metrics)
  ours-fetch          ours, with the micro-batch fetched and collated from the dataset inside the clock
  plain-nodrop        plain with the LoRA adapters' dropout replaced by the identity, as PEFT builds lora_dropout 0
  ours-nodrop         ours likewise: what the dropout masks cost (LoRA rows only)
  plain-bf16base      plain with the frozen weights stored in the compute dtype (the adapters stay fp32), so that
                      autocast has no weight to cast: what casting the frozen base every step costs (LoRA rows)
  ours-bf16base       ours likewise

The clock is the process's CPU time (time.process_time), not the wall clock: on a machine shared with other work a
step's wall time grows with every other process that runs meanwhile, its CPU time much less (what remains is the
caches the others evict); with `--threads 1` it is the work the step does. Read the ratios to `plain` (the median
over rounds of each round's own ratio) and say the load average with them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

RUNGS = ("plain", "packed-causal", "plain-packed", "chunked-head", "ours", "ours-fetch", "plain-nodrop", "ours-nodrop",
         "plain-bf16base", "ours-bf16base")


@contextlib.contextmanager
def no_dropout(model):
    """The LoRA layers' dropout modules replaced by nn.Identity (PEFT's own choice for lora_dropout 0) meanwhile."""
    from torch import nn

    swapped = []
    for module in model.modules():
        for name, dropout in getattr(module, "lora_dropout", {}).items():
            swapped.append((module.lora_dropout, name, dropout))
            module.lora_dropout[name] = nn.Identity()
    try:
        yield
    finally:
        for modules, name, dropout in swapped:
            modules[name] = dropout


@contextlib.contextmanager
def compute_dtype_base(model, dtype):
    """The frozen parameters stored in `dtype` meanwhile (their values rounded: only the speed is measured here)."""
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    for p in frozen:
        p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p in frozen:
            p.data = p.data.float()


def dense(examples: list[list[int]], max_length: int):
    """The examples' tokens, concatenated, as the fewest rows of at most max_length of one width (the remainder
    dropped: at most rows - 1 tokens)."""
    import torch

    stream = [t for ids in examples for t in ids]
    rows = -(-len(stream) // max_length)
    width = len(stream) // rows
    return torch.tensor(stream[:rows * width]).view(rows, width)


class Setup:
    """The two models, their optimizers, the data and the backend, built once."""

    def __init__(self, kind: str, out: Path) -> None:
        import torch

        import gpt4all_training.training.loop as loop
        from gpt4all_training.backends.accelerate import build_backend
        from gpt4all_training.config.loader import load_config
        from gpt4all_training.model.loading import load_model, tokenizer_for
        from gpt4all_training.training.objectives import objective_for

        m = harness.MODELS[kind]
        self.m = m
        path = harness.model_dir(kind)
        overrides = harness.ours_overrides(kind, path, harness.clean_data(), out, 1000)
        self.config = load_config(None, overrides + ["packing=true"])
        self.backend = build_backend(self.config)
        self.objective = objective_for(self.config)
        tokenizer = tokenizer_for(self.config)
        self.pad_id = tokenizer.pad_token_id
        self.data = self.objective.load_data(self.config, tokenizer, lambda *a: None, 1).train
        torch.manual_seed(harness.SEED)
        ours = loop.build_model(self.objective, self.config, tokenizer, self.backend)
        self.ours, self.optimizer, self.scheduler = loop.prepare(ours, self.config, self.backend, 1000)
        self.ours.train()
        plain = load_model(str(path))
        if m["lora"]:
            from peft import LoraConfig, get_peft_model

            plain = get_peft_model(plain, LoraConfig(task_type="CAUSAL_LM", r=m["lora_r"], lora_alpha=m["lora_alpha"],
                                                     lora_dropout=m["lora_dropout"], target_modules=m["lora_targets"]))
        self.plain = plain.train()
        self.params = [p for p in plain.parameters() if p.requires_grad]
        self.plain_optimizer = torch.optim.AdamW(self.params, lr=m["lr"], weight_decay=0.0)
        self.dtype = getattr(torch, m["dtype"])
        self.step = 0

    def plain_step(self, loss_of) -> None:
        import torch

        with torch.autocast("cpu", dtype=self.dtype, enabled=self.m["dtype"] != "float32"):
            loss = loss_of(self.plain)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.plain_optimizer.step()
        self.plain_optimizer.zero_grad(set_to_none=True)

    def ours_step(self, batch) -> None:
        from gpt4all_training.training.step import train_step

        train_step(self.ours, [batch], self.backend, self.optimizer, self.scheduler, self.config.max_grad_norm,
                   self.step, self.objective.loss, count=self.objective.count)
        self.step += 1

    def run(self, rung: str, indices: list[int]) -> float:
        """CPU seconds of this process for one optimizer step of `rung` on the examples `indices`; inputs built
        before the clock starts (but in "ours-fetch")."""
        from gpt4all_training.batch import trained_token_count
        from gpt4all_training.training.loss import token_loss_sum

        batch = self.objective.fetch(self.data, indices, self.pad_id)
        rows = dense(self.data.select(indices)["input_ids"], self.config.max_length)
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "labels", "position_ids")}
        steps = {
            "plain": lambda: self.plain_step(lambda model: model(input_ids=rows, labels=rows).loss),
            "packed-causal": lambda: self.plain_step(
                lambda model: model(input_ids=batch["input_ids"], labels=batch["labels"]).loss),
            "plain-packed": lambda: self.plain_step(lambda model: model(**inputs).loss),
            "chunked-head": lambda: self.plain_step(
                lambda model: token_loss_sum(model, batch) / trained_token_count(batch)),
            "ours": lambda: self.ours_step(batch),
            "ours-fetch": lambda: self.ours_step(self.objective.fetch(self.data, indices, self.pad_id)),
            "plain-nodrop": lambda: self.plain_step(lambda model: model(input_ids=rows, labels=rows).loss),
            "ours-nodrop": lambda: self.ours_step(batch),
            "plain-bf16base": lambda: self.plain_step(lambda model: model(input_ids=rows, labels=rows).loss),
            "ours-bf16base": lambda: self.ours_step(batch),
        }
        model = self.plain if rung.startswith("plain") else self.ours
        context = contextlib.nullcontext()
        if rung.endswith("-nodrop"):
            context = no_dropout(model)
        elif rung.endswith("-bf16base"):
            context = compute_dtype_base(model, self.dtype)
        with context:
            started = time.process_time()
            steps[rung]()
            return time.process_time() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(harness.MODELS), default="smollm2")
    parser.add_argument("--batch-size", type=int, help="examples per step (default: per model)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of every rung, the first a warm-up")
    parser.add_argument("--rungs", default=",".join(RUNGS), help="which rungs, comma-separated")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="precision (default: per model)")
    parser.add_argument("--lora-dropout", type=float, help="the LoRA adapters' dropout (default: per model)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    m = harness.MODELS[args.model]
    for key, value in (("batch_size", args.batch_size), ("dtype", args.dtype), ("lora_dropout", args.lora_dropout)):
        if value is not None:
            m[key] = value
    rungs = [r for r in args.rungs.split(",") if r]
    if set(rungs) - set(RUNGS):
        parser.error(f"unknown rungs {sorted(set(rungs) - set(RUNGS))}; choose from {', '.join(RUNGS)}")
    harness.set_threads(args.threads)
    harness.setup_environment()
    print(f"# {args.model}: {m['batch_size']} examples a step, {m['dtype']}, lora_dropout {m.get('lora_dropout')}, "
          f"{args.rounds} rounds; {harness.machine()}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    setup = Setup(args.model, harness.WORK / "runs" / "step-costs")
    times: dict[str, list[float]] = {r: [] for r in rungs}
    for round_ in range(args.rounds):
        indices = list(range(round_ * m["batch_size"], (round_ + 1) * m["batch_size"]))
        packed = setup.objective.fetch(setup.data, indices, setup.pad_id)["input_ids"].shape
        rows = dense(setup.data.select(indices)["input_ids"], setup.config.max_length).shape
        order = rungs[round_ % len(rungs):] + rungs[:round_ % len(rungs)]
        for rung in order:
            times[rung].append(setup.run(rung, indices))
        print(f"  round {round_ + 1}: " + ", ".join(f"{r} {times[r][-1]:.2f} CPU s" for r in rungs)
              + f" (dense rows {tuple(rows)}, packed {tuple(packed)}; load {os.getloadavg()[0]:.1f})", flush=True)
    base = times[rungs[0]][1:]
    print(f"\n| rung | CPU s/step (median) | x {rungs[0]} (median of rounds) |\n|---|---|---|")
    for rung in rungs:
        ratio = statistics.median(t / b for t, b in zip(times[rung][1:], base))
        print(f"| {rung} | {statistics.median(times[rung][1:]):.2f} | {ratio:.2f} |")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
