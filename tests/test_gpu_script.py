"""bench/gpu.sh --dry-run: the GPU benchmark's code paths at tiny sizes on the CPU, so that a script run once on a
lent GPU machine has not rotted in between. Its results.json is checked against the definitions it states: the
model's size counted here from the Llama layout, tokens/s as tokens over seconds, MFU as achieved over peak (and, with
no GPU to look up, no MFU against a published peak)."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def matmul_parameters(sizes: dict) -> int:
    """N of the MFU formula for a Llama without biases and with an untied LM head: every weight that multiplies
    activations (the input embedding is a lookup)."""
    hidden, layers = sizes["hidden"], sizes["layers"]
    kv_width = sizes["kv_heads"] * hidden // sizes["heads"]
    attention = 2 * hidden * hidden + 2 * hidden * kv_width  # q and o; k and v, grouped
    mlp = 3 * hidden * sizes["intermediate"]  # gate, up, down
    norms = 2 * hidden
    return layers * (attention + mlp + norms) + hidden + sizes["vocab"] * hidden  # final norm, LM head


def lora_parameters(sizes: dict, r: int) -> int:
    """A LoRA adapter of rank r on every linear layer of the decoder (A: r x in, B: out x r)."""
    hidden, ffn = sizes["hidden"], sizes["intermediate"]
    kv_width = sizes["kv_heads"] * hidden // sizes["heads"]
    per_layer = 2 * (hidden + hidden) + 2 * (hidden + kv_width) + 3 * (hidden + ffn)  # q, o; k, v; gate, up, down
    return sizes["layers"] * r * per_layer


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-dry-run")
    # Skipped to save a launch each: the wrapped TRL row (the bfd row's code with another packing_strategy) and the
    # LoRA row without checkpointing (the checkpointed row's code with the flag off; the checkpointed row builds the
    # base both share).
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu.sh"), "--dry-run", "--out", str(out), "--skip",
                           "trl_wrapped,lora8b"],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=420,
                          check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert {"results.json", "results.md", "log.txt"} <= {p.name for p in out.iterdir()}
    return json.loads((out / "results.json").read_text())


def test_model_size_and_flops_per_token(results):
    model = results["model"]
    sizes = model["sizes"]
    n = matmul_parameters(sizes)
    assert model["n_params_flops"] == n
    assert model["n_params"] == n + sizes["vocab"] * sizes["hidden"]
    assert model["flops_per_token"] == 6 * n + 12 * sizes["layers"] * sizes["hidden"] * sizes["seq"]


def test_ours_row_throughput_and_mfu(results):
    sizes, ours = results["model"]["sizes"], results["rows"]["ours"]
    assert ours["status"] == "ok", ours
    assert ours["n_params"] == results["model"]["n_params"]  # the CLI built the model the formula counts
    assert ours["timed_steps"] == sizes["steps"] - sizes["warmup"]
    full_rows = sizes["micro_batch"] * sizes["accumulation"] * sizes["seq"]  # causal_lm rows have no padding
    assert ours["tokens"] == pytest.approx(ours["timed_steps"] * full_rows)
    assert ours["tokens_per_s"] > 0
    assert ours["tokens_per_s"] == pytest.approx(ours["tokens"] / ours["seconds"], rel=1e-9)
    peak = results["matmul"]["peak_flops_per_s"]
    assert peak > 0
    assert ours["achieved_flops_per_s"] == pytest.approx(results["model"]["flops_per_token"] * ours["tokens_per_s"])
    assert ours["mfu"] == pytest.approx(ours["achieved_flops_per_s"] / peak)
    if not torch.cuda.is_available():  # no device name to look up: the published yardstick is left empty
        assert results["published_peak_flops_per_s"] is None and ours["mfu_published"] is None


def test_lora_row(results):
    """The 8B-shaped LoRA row at tiny sizes: LoRA on every linear layer (the trainable count train.py reports is
    the adapter counted here), LoRA's FLOPs per token, throughput and MFU by the same definitions as the 1B row."""
    rows = results["rows"]
    assert rows["lora8b"] == {"status": "error", "error": "not run"}  # --skip
    row = rows["lora8b_gc"]
    assert row["status"] == "ok", row
    sizes = row["sizes"]
    n, n_lora = matmul_parameters(sizes), lora_parameters(sizes, 16)
    assert (row["n_params_flops"], row["n_lora"], row["n_trainable"]) == (n, n_lora, n_lora)
    assert row["n_params"] == n + sizes["vocab"] * sizes["hidden"] + n_lora
    assert row["flops_per_token"] == 4 * n + 6 * n_lora + 12 * sizes["layers"] * sizes["hidden"] * sizes["seq"]
    config = row["config"]  # what train.py was given
    assert (config["lora"], config["gradient_checkpointing"], config["dtype"]) == (True, True, "bfloat16")
    assert row["timed_steps"] == sizes["steps"] - sizes["warmup"]
    assert row["tokens"] == pytest.approx(row["timed_steps"] * sizes["micro_batch"] * sizes["accumulation"]
                                          * sizes["seq"])
    assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"], rel=1e-9)
    assert row["achieved_flops_per_s"] == pytest.approx(row["flops_per_token"] * row["tokens_per_s"])
    assert row["mfu"] == pytest.approx(row["achieved_flops_per_s"] / results["matmul"]["peak_flops_per_s"])
    assert row["peak_memory_mb"] > 0
    if not torch.cuda.is_available():
        assert row["mfu_published"] is None


def test_trl_row_and_cuda_tests(results):
    trl = results["rows"]["trl"]
    if importlib.util.find_spec("trl") is None:
        assert trl == {"status": "skipped", "error": "trl not installed"}
        assert results["ours_over_trl"] is None
    else:
        assert trl["status"] == "ok", trl
        assert trl["tokens_per_s"] == pytest.approx(trl["tokens"] / trl["seconds"], rel=1e-9)
    tests = results["cuda_tests"]
    assert tests["status"] == "ok" and tests["tests"]
    if not torch.cuda.is_available():
        assert tests["skipped"] == len(tests["tests"])
        assert tests["passed"] == tests["failed"] == tests["errors"] == 0


def test_train_throughput_stage(results):
    """The dry run's one bench/train_throughput.py stage (ours packed against TRL packed, on the tiny GPT-J, 3 steps
    of which 2 untimed); the full run's other three such stages are not started."""
    stages = results["smollm2"]
    assert {name: stage["error"] for name, stage in stages.items() if name != "smollm2_lora"} == {
        "smollm2_full": "not run", "smollm2_lora_gc": "not run", "smollm2_full_gc": "not run",
        "smollm2_profile": "not run"}
    stage = stages["smollm2_lora"]
    assert stage["status"] == "ok", stage
    ours = stage["runs"]["ours-packed"][0]
    assert (ours["steps"], ours["measured_steps"]) == (3, 1)
    # On a CPU a packed micro-batch is one row with nothing padded; on a GPU, rows padded to the longest one.
    assert ours["padding_fraction"] == 0.0 if not torch.cuda.is_available() else 0 < ours["padding_fraction"] < 1
    assert ours["trained_tokens_per_s"] > 0
    assert ours["memory_kind"] == ("GPU max allocated" if torch.cuda.is_available() else "peak RSS")
    mfu = stage["mfu"]["ours-packed"]
    achieved = statistics.median(r["model_flops"] / r["measured_seconds"] for r in stage["runs"]["ours-packed"])
    assert mfu["achieved_flops_per_s"] == pytest.approx(achieved) and achieved > 0
    assert mfu["mfu"] == pytest.approx(achieved / results["matmul"]["peak_flops_per_s"])
    if not torch.cuda.is_available():
        assert mfu["mfu_published"] is None
    if importlib.util.find_spec("trl") is None:
        return
    trl = stage["runs"]["trl-packed"][0]
    assert trl["padding_fraction"] == 0.0  # padding-free rows
    ratio = ours["trained_tokens_per_s"] / trl["trained_tokens_per_s"]
    assert f"| ours + packing | {ours['trained_tokens_per_s']:,.0f} " in stage["table"]
    assert f"| {ratio:.2f}x |" in stage["table"]
