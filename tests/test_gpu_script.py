"""bench/gpu.sh --dry-run: the GPU benchmark's code paths at tiny sizes on the CPU, so that a script run once on a
lent GPU machine has not rotted in between. Its results.json is checked against the definitions it states: the
model's size counted here from the Llama layout, tokens/s as tokens over seconds, MFU as achieved over peak."""

from __future__ import annotations

import importlib.util
import json
import os
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


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-dry-run")
    # The wrapped TRL row is the bfd row's code with another packing_strategy: skipped here to save a launch.
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu.sh"), "--dry-run", "--out", str(out), "--skip",
                           "trl_wrapped"],
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
    assert 0 < ours["padding_fraction"] < 1 and ours["trained_tokens_per_s"] > 0
    assert ours["memory_kind"] == ("GPU max allocated" if torch.cuda.is_available() else "peak RSS")
    if importlib.util.find_spec("trl") is None:
        return
    trl = stage["runs"]["trl-packed"][0]
    assert trl["padding_fraction"] == 0.0  # padding-free rows
    ratio = ours["trained_tokens_per_s"] / trl["trained_tokens_per_s"]
    assert f"| ours + packing | {ours['trained_tokens_per_s']:,.0f} " in stage["table"]
    assert f"| {ratio:.2f}x |" in stage["table"]
