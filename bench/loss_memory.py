"""Memory of the loss: full logits + cross-entropy against the chunked loss, on SmolLM2-135M (vocabulary 49,152).

`python bench/loss_memory.py` runs one forward + backward of a full fine-tuning step per fresh process, for each of
{plain, chunked} x {float32, bfloat16 autocast}, and reports how far the process's resident memory rose above its
level just before the step (the kernel's peak-RSS counter is reset there via /proc/self/clear_refs), and the step's
time. "plain" is what loss.py did before: logits of the whole batch, `.float()`, F.cross_entropy. The batch is
`--batch` rows of `--length` tokens with every position trained (the worst case, as in pretraining); `--trained`
trains only that fraction of positions (the end of each row), like instruction data with its prompt masked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def plain_token_loss_sum(model, batch):
    import torch.nn.functional as F

    from gpt4all_training.batch import model_inputs

    logits = model(**model_inputs(batch)).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")


def worker(mode: str, dtype: str, batch_size: int, length: int, trained: float) -> dict:
    import torch

    from gpt4all_training.training.loss import token_loss_sum
    from gpt4all_training.model.loading import load_model

    model = load_model(str(harness.smollm2()))
    model.train()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (batch_size, length), generator=generator)
    labels = input_ids.clone()
    labels[:, :length - int(length * trained)] = -100
    batch = {"input_ids": input_ids, "labels": labels}
    loss_fn = token_loss_sum if mode == "chunked" else plain_token_loss_sum
    for param in model.parameters():  # allocate the gradients first: both modes need them, and equally
        param.grad = torch.zeros_like(param)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
    before = rss_mb("VmRSS")
    started = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        loss = loss_fn(model, batch)
    loss.backward()
    seconds = time.perf_counter() - started
    return {"rise_mb": rss_mb("VmHWM") - before, "seconds": seconds, "loss": float(loss)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--trained", type=float, default=1.0, help="fraction of positions trained")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        harness.setup_environment()
        print(json.dumps(worker(*args.worker, args.batch, args.length, args.trained)))
        return 0

    harness.setup_environment()
    harness.smollm2()
    logits_mb = args.batch * args.length * 49152 * 4 / 2**20
    print(f"# SmolLM2-135M, batch {args.batch} x {args.length}, {args.trained:.0%} of positions trained "
          f"(fp32 logits of the batch: {logits_mb:,.0f} MiB); {harness.machine()}; {time.strftime('%Y-%m-%d %H:%M')}",
          flush=True)
    results: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        for dtype in ("float32", "bfloat16"):
            for mode in (("plain", "chunked") if repeat % 2 == 0 else ("chunked", "plain")):
                result = harness.run_worker("loss_memory.py", ["--worker", mode, dtype, "--batch", str(args.batch),
                                                               "--length", str(args.length),
                                                               "--trained", str(args.trained)])
                results.setdefault((mode, dtype), []).append(result)
                print(f"  {mode} {dtype}: +{result['rise_mb']:,.0f} MiB, {result['seconds']:.1f} s, "
                      f"loss {result['loss']:.4f}", flush=True)
    print("| loss | precision | memory rise in the step, MiB (median) | step seconds (median) | loss |")
    print("|---|---|---|---|---|")
    for (mode, dtype), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0] != "plain")):
        print(f"| {mode} | {dtype} | {harness.median([r['rise_mb'] for r in runs]):,.0f} | "
              f"{harness.median([r['seconds'] for r in runs]):.1f} | {runs[0]['loss']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
