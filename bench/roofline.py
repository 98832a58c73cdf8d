"""This machine's matmul peak, and each training row's achieved FLOP/s as a share of it: `python bench/roofline.py`.

1. The peak. torch.matmul in bfloat16 and in float32, on the shapes a model of SmolLM2-135M's width runs for a
   micro-batch of `--tokens` tokens: the forward of each linear layer (tokens x in @ in x out), its input gradient
   (tokens x out @ out x in) and its weight gradient (out x tokens @ tokens x in), and the same for the output head
   over the vocabulary on one chunk of the chunked loss (CHUNK_ELEMENTS / vocab trained positions); each timed as
   the best of `--repeats` after a warm-up, with the thread count the training rows use (`--threads`, as in
   train_throughput.py). A product that takes over a second is timed once: a CPU without native bf16 (AVX2 only)
   runs bf16 products 10-100x slower than fp32, and repeating them would take many minutes. The peak of a
   precision is its fastest shape.

2. The rows. `--results FILE` reads the JSON that `bench/train_throughput.py --json FILE` writes; each run holds its
   model FLOPs over the measured steps (harness.model_flops, formula below) and the seconds they took. A row's
   achieved FLOP/s is their ratio (median over its runs), shown as a share of the peak of the row's precision.

Model FLOPs of a step (harness.model_flops), counting only work the training needs (no padding, no recomputation):
    full fine-tuning:  6 * N_blocks * T_real + 6 * V * d * T_trained + 12 * L * d_attn * P
    LoRA:              4 * N_blocks * T_real + 4 * V * d * T_trained + 6 * N_lora * T_real + 12 * L * d_attn * P
where N_blocks is the weight count of the decoder layers' linear layers, V * d the output head, T_real the tokens of
examples (padding excluded), T_trained the positions with a loss (only they reach the head: the loss is chunked over
trained positions), L the layers, d_attn the attention width (heads x head dim), and P the causal (query, key) pairs,
sum over examples of n(n + 1) / 2. A forward costs 2 FLOPs per weight per token, the backward 4 (input and weight
gradients); LoRA's frozen weights need no weight gradient (4, not 6), its adapters all three. Attention is 4 * d_attn
per pair forward (scores and values), 12 with its backward.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

DTYPES = ("bfloat16", "float32")


def shapes(tokens: int, dims: dict[str, int]) -> dict[str, tuple[int, int, int]]:
    """name: (m, k, n) of an (m x k) @ (k x n) product: each linear layer's forward, input and weight gradient."""
    from gpt4all_training.training.loss import CHUNK_ELEMENTS

    d, ff, kv, vocab = dims["hidden"], dims["intermediate"], dims["kv_width"], dims["vocab"]
    out = {}
    for name, (rows, inp, outp) in {"q/o proj": (tokens, d, d), "k/v proj": (tokens, d, kv),
                                    "gate/up proj": (tokens, d, ff), "down proj": (tokens, ff, d),
                                    "output head": (CHUNK_ELEMENTS // vocab, d, vocab)}.items():
        out[f"{name} forward"] = (rows, inp, outp)
        out[f"{name} input grad"] = (rows, outp, inp)
        out[f"{name} weight grad"] = (outp, rows, inp)
    return out


def matmul_flops(m: int, k: int, n: int, dtype: str, repeats: int) -> float:
    """FLOP/s of the best of `repeats` timed products, after a warm-up."""
    import torch

    torch.manual_seed(0)
    a = torch.randn(m, k, dtype=getattr(torch, dtype))
    b = torch.randn(k, n, dtype=getattr(torch, dtype))
    started = time.perf_counter()
    torch.matmul(a, b)
    first = time.perf_counter() - started
    if first > 1.0:
        return 2 * m * k * n / first
    runs = max(1, int(0.2 / first))  # ~0.2 s per timing, so small shapes are not all overhead
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(runs):
            torch.matmul(a, b)
        best = min(best, (time.perf_counter() - started) / runs)
    return 2 * m * k * n / best


def peaks(tokens: int, dims: dict[str, int], repeats: int) -> dict[str, dict[str, float]]:
    measured: dict[str, dict[str, float]] = {dtype: {} for dtype in DTYPES}
    for name, (m, k, n) in shapes(tokens, dims).items():
        for dtype in DTYPES:
            measured[dtype][name] = matmul_flops(m, k, n, dtype, repeats)
    return measured


def achieved(results: dict[str, list[dict]]) -> dict[str, tuple[str, float]]:
    """row: (its precision, median achieved model FLOP/s over its runs)."""
    return {row: (runs[0]["dtype"], harness.median([r["model_flops"] / r["measured_seconds"] for r in runs]))
            for row, runs in results.items() if runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="rows of the activations: a micro-batch's tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="threads (OMP_NUM_THREADS), as the training rows")
    parser.add_argument("--results", type=Path, action="append", default=[],
                        help="train_throughput.py --json output (repeatable: one per model)")
    args = parser.parse_args(argv)
    harness.set_threads(args.threads)
    harness.setup_environment()
    print(f"# matmul peak, {args.tokens} tokens, SmolLM2-135M shapes; {harness.machine()}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    dims = harness.model_dims(harness.model_dir("smollm2"))
    measured = peaks(args.tokens, dims, args.repeats)
    print("| product (m x k @ k x n) | " + " | ".join(f"{dtype} GFLOP/s" for dtype in DTYPES) + " |")
    print("|---|" + "---|" * len(DTYPES))
    for name, (m, k, n) in shapes(args.tokens, dims).items():
        print(f"| {name} ({m} x {k} @ {k} x {n}) | "
              + " | ".join(f"{measured[dtype][name] / 1e9:,.1f}" for dtype in DTYPES) + " |")
    peak = {dtype: max(values.values()) for dtype, values in measured.items()}
    print("peak: " + ", ".join(f"{dtype} {value / 1e9:,.1f} GFLOP/s" for dtype, value in peak.items()))
    for path in args.results:
        rows = achieved(json.loads(path.read_text()))
        print(f"\n{path}:\n| run | precision | model GFLOP/s | share of that precision's peak |\n|---|---|---|---|")
        for row, (dtype, flops) in rows.items():
            print(f"| {row} | {dtype} | {flops / 1e9:,.2f} | {flops / peak[dtype]:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
