"""bench/step_profile.py: where a step's time goes (categories that add up to the step) and what holds its memory
peak; and bench/train_throughput.py --profile, which keeps such a profile for every row it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.autograd.profiler_util import FunctionEvent

from support.models import build_tiny_llama

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import step_profile  # noqa: E402


class Timeline:
    """FunctionEvents laid out by hand (microseconds), nested as the profiler nests them."""

    def __init__(self, step_ends: list[float]) -> None:
        self.events = [FunctionEvent(id=0, name=step_profile.MARKER, thread=1, start_us=t, end_us=t)
                       for t in step_ends]

    def add(self, name: str, start: float, end: float, parent: FunctionEvent | None = None, thread: int = 1):
        e = FunctionEvent(id=len(self.events), name=name, thread=thread, start_us=start, end_us=end)
        if parent is not None:
            e.set_cpu_parent(parent)
            parent.append_cpu_child(e)
        self.events.append(e)
        return e


def test_shares_of_a_known_timeline():
    """Two steps of 100 us, hand-laid: each category gets what the rules give, the overhead is the time outside ops
    (Python, the autograd engine's own frames), and the shares add up to 1."""
    t = Timeline([0, 100, 200])
    linear = t.add("aten::linear", 10, 40)  # 5 us of its own, a cast (6 + the copy inside it, 4), an mm (15)
    cast = t.add("aten::to", 11, 21, linear)
    t.add("aten::copy_", 15, 19, cast)
    t.add("aten::mm", 22, 37, linear)
    sdpa = t.add("aten::scaled_dot_product_attention", 45, 65)  # 20 us, the bmm inside it included
    t.add("aten::bmm", 50, 60, sdpa)
    frame = t.add("autograd::engine::evaluate_function: MulBackward0", 120, 150)  # 20 us of it framework
    t.add("aten::mul", 125, 135, frame)
    optimizer = t.add("Optimizer.step#AdamW.step", 150, 190)  # 40 us, its Python between ops included
    t.add("aten::_foreach_add_", 160, 170, optimizer)
    t.add("aten::view", 195, 197)
    result = step_profile.time_shares(t.events)
    microseconds = {k: round(v * 200, 6) for k, v in result["shares"].items()}
    assert microseconds == {"matmul": 20.0, "cast": 10.0, "elementwise": 10.0, "attention": 20.0, "optimizer": 40.0,
                            "compiled": 0.0, "sync": 0.0, "other": 2.0, "overhead": 98.0}
    assert result["steps"] == 2 and result["step_seconds"] == pytest.approx(100e-6)
    assert result["sum_check"] == pytest.approx(1.0)
    assert result["top_ops"]["cast"] == [("aten::to", 0.03), ("aten::copy_", 0.02)]


def test_sum_check_catches_time_counted_twice():
    """Ops of two threads at the same time: the categories (self times) count both, the union once, so the check
    says so instead of hiding it."""
    t = Timeline([0, 100])
    t.add("aten::mm", 10, 60, thread=1)
    t.add("aten::mm", 10, 60, thread=2)
    result = step_profile.time_shares(t.events)
    assert result["shares"]["matmul"] == pytest.approx(1.0) and result["shares"]["overhead"] == pytest.approx(0.5)
    assert result["sum_check"] == pytest.approx(1.5)


def test_profile_of_a_real_training_loop(tokenizer):
    """A tiny Llama trained in bf16 autocast with AdamW, profiled as the benchmark does: the categories add up to
    the step and agree with the wall clock, the pieces a step must have show, and the memory peak holds exactly
    the model's parameters and AdamW's two moments."""
    model = build_tiny_llama(tokenizer).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, len(tokenizer), (4, 64), generator=torch.Generator().manual_seed(0))
    profile = step_profile.StepProfile(True, warmup=1, steps=5, path=Path(os.devnull))
    ends, losses = [], []
    for count in range(1, 6):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # one host sync a step, which the profile must find (AdamW's own are not)
        ends.append(time.perf_counter())
        profile.step_ended(count)
    timing = profile.result["time"]
    assert timing["steps"] == 3  # steps 2-4; step 5 is the memory step
    assert timing["sum_check"] == pytest.approx(1.0, abs=0.05)
    assert all(share >= 0 for share in timing["shares"].values())
    wall = (ends[3] - ends[0]) / 3
    assert timing["step_seconds"] == pytest.approx(wall, rel=0.1)
    for category in ("matmul", "cast", "elementwise", "attention", "optimizer", "overhead"):
        assert timing["shares"][category] > 0, category
    assert timing["sync_ops_per_step"] == 1
    assert [(site.split("(")[0].rsplit("/", 1)[-1], n) for site, n in profile.result["sync_sites"].items()] == [
        ("test_profile.py", 1)]
    held = profile.result["memory"]["held_by"]
    parameters = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    assert held["parameter"] == pytest.approx(parameters, rel=1e-6)
    assert held["optimizer_state"] == pytest.approx(2 * parameters, rel=0.01)  # exp_avg, exp_avg_sq (+ step)
    assert profile.result["memory"]["peak_mib"] == pytest.approx(sum(held.values()))


@pytest.mark.integration
@pytest.mark.slow
def test_every_row_keeps_its_profile(tmp_path):
    """bench/train_throughput.py --profile on the tiny GPT-J (ours packed and the plain step, 4 steps: 2 warm-up,
    1 timed, 1 for memory): each run's JSON holds its profile, whose categories are non-negative and add up to the
    step within 5%, and the printed "where the time goes" table has a row per run with those figures."""
    out = tmp_path / "runs.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "train_throughput.py"), "--model", "tiny-gptj",
                           "--steps", "4", "--repeats", "1", "--variants", "ours-packed,plain", "--profile",
                           "--skip-eval", "--json", str(out)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads(out.read_text())
    table = done.stdout.split("Where the time goes", 1)[1]
    for variant, label in (("ours-packed", "ours + packing"), ("plain", "plain transformers (+ PEFT) step")):
        (run,) = runs[variant]
        profile = run["profile"]
        shares = profile["time"]["shares"]
        assert set(shares) == set(step_profile.CATEGORIES)
        assert all(share >= 0 for share in shares.values()), shares
        assert sum(shares.values()) == pytest.approx(1.0, abs=0.05)
        assert profile["time"]["steps"] == 1 and profile["memory"]["peak_mib"] > 0
        assert shares["matmul"] > 0 and shares["optimizer"] > 0
        row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
        assert f"| {shares['matmul']:.1%} | {shares['cast']:.1%} | {shares['elementwise']:.1%} |" in row
        assert run["cpu_seconds_per_step"] > 0 and run["real_tokens_per_s"] > 0
    plain = runs["plain"][0]
    assert plain["padding_fraction"] == 0.0  # dense rows
    assert plain["trained_tokens_per_step"] < plain["real_tokens"] / plain["steps"]  # all but each row's first
