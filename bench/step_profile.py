"""Where a training step's time and memory go: `python bench/train_throughput.py --profile` uses this per run.

Time. torch.profiler (record_shapes, profile_memory) runs over the measured steps; a zero-length marker at the end of
every step cuts its timeline into steps (end to end, so a step includes the loop around it: fetching and collating
the next batch, logging). Every instant of a step is given to one category:
  - inside an op, by the table below: a region category (optimizer, attention, compiled) owns everything under its
    event; otherwise the innermost classified op does (a dtype cast that autocast runs inside `aten::linear` is a
    cast, the `aten::copy_` inside that cast a cast too), and an op that no entry names is "other";
  - outside every op and region: "overhead", the host running Python or the framework (the autograd engine, the
    trainer's loop) with no op in progress: the step's wall time minus the union of op intervals over all threads.
The categories are summed from each event's self time, the overhead from the union of intervals: two independent
sums, so `sum_check` (categories + overhead over the step) is 1 only when no time is counted twice or lost.

Host-device syncs. On a GPU, the CUDA runtime's synchronising calls per step (cudaStreamSynchronize, a blocking
cudaMemcpy, ...): the host waits there for the device. On every device, the ops that make it wait when the tensor
is on the device: `_local_scalar_dense` (`.item()`, `float(t)`, `bool(t)`) and `nonzero` (boolean indexing), outside
the optimizer (torch's AdamW reads its step counters, which live on the host, with `.item()`); on a CPU that count
is what would sync on a GPU, and the Python lines that call them are listed (`sync_sites`, from the memory step,
whose stacks are recorded). A `.tolist()` or `.cpu()` of a device tensor syncs on a GPU but runs no such op: only
the CUDA count sees it.

Memory. The run's last step is profiled alone with `with_stack` as well (which torch's memory profiler needs, and
which slows a step too much to time it): the peak of live tensor bytes in that step, split by what holds them
(parameters, optimizer state, gradients, activations, temporaries, inputs, autograd's own buffers) as
torch.profiler's memory profiler classifies them.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

MARKER = "## step end ##"
CATEGORIES = ("matmul", "cast", "elementwise", "attention", "optimizer", "compiled", "sync", "other", "overhead")

# Regions: everything under an event whose name starts with (or, for attention, contains) one of these.
REGIONS = {
    "optimizer": ("Optimizer.step#", "Optimizer.zero_grad#"),
    "compiled": ("Torch-Compiled Region", "## Call CompiledFxGraph", "CompiledFunction"),
}
ATTENTION = ("scaled_dot_product", "ScaledDotProduct", "flash_attention", "efficient_attention", "cudnn_attention",
             "flex_attention", "FlexAttention")
# Ops by name (the namespace and a trailing "_" of in-place variants dropped).
OPS = {
    "matmul": {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "dot", "einsum", "_addmm_activation",
               "_linear_pointwise", "mkldnn_linear", "_int_mm", "_scaled_mm"},
    "cast": {"to", "_to_copy", "type_as", "_autocast_to_reduced_precision", "_autocast_to_full_precision"},
    "elementwise": {  # pointwise maths and reductions: bound by memory bandwidth, not by the matmul units
        "add", "sub", "rsub", "mul", "div", "neg", "exp", "log", "sqrt", "rsqrt", "pow", "abs", "sign", "reciprocal",
        "square", "sin", "cos", "silu", "silu_backward", "gelu", "gelu_backward", "tanh", "tanh_backward", "sigmoid",
        "sigmoid_backward", "relu", "threshold_backward", "where", "fill", "zero", "clamp", "clamp_min", "clamp_max",
        "masked_fill", "bernoulli", "dropout", "native_dropout", "native_dropout_backward", "lerp", "addcmul",
        "addcdiv", "maximum", "minimum", "eq", "ne", "lt", "gt", "le", "ge", "logical_and", "logical_or",
        "logical_not", "bitwise_and", "bitwise_or", "bitwise_not", "sum", "mean", "norm", "linalg_vector_norm",
        "amax", "amin", "max", "min", "logsumexp", "softmax", "_softmax", "_softmax_backward_data", "log_softmax",
        "_log_softmax", "_log_softmax_backward_data", "nll_loss", "nll_loss_forward", "nll_loss_backward",
        "nll_loss_nd", "cross_entropy_loss", "cumsum", "rms_norm", "_fused_rms_norm", "_fused_rms_norm_backward",
        "layer_norm", "native_layer_norm", "native_layer_norm_backward", "clamp_min_", "erf", "exp2", "isfinite",
        "isnan", "mse_loss", "sqr"},
    "sync": {"_local_scalar_dense", "item"},
}
PY_FRAME = re.compile(r"\.py\(\d+\): ")
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")
CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
OP_NAMES = {name: category for category, names in OPS.items() for name in names}


def is_op(name: str) -> bool:
    """A dispatcher op (aten::mm, c10d::allreduce_), not an autograd node or engine frame (MmBackward0,
    autograd::engine::evaluate_function: ..., torch::autograd::AccumulateGrad), which are framework time."""
    return "::" in name and not name.startswith(("autograd::", "torch::autograd::"))


def op_category(name: str) -> str | None:
    base = name.rsplit("::", 1)[-1]
    return OP_NAMES.get(base) or OP_NAMES.get(base.rstrip("_")) or OP_NAMES.get(base.removeprefix("_foreach_"))


def region_category(name: str) -> str | None:
    if any(key in name for key in ATTENTION):
        return "attention"
    for category, prefixes in REGIONS.items():
        if name.startswith(prefixes):
            return category
    return None


class Classifier:
    """The category of each host event's self time: a region above it (the outermost) wins, else the innermost
    classified op at or above it, else "other" when it is inside an op, else None (overhead)."""

    def __init__(self) -> None:
        self.memo: dict[int, str | None] = {}

    def __call__(self, event) -> str | None:
        key = id(event)
        if key in self.memo:
            return self.memo[key]
        chain = []
        node = event
        while node is not None:
            chain.append(node)
            node = node.cpu_parent
        category = None
        for node in reversed(chain):  # outermost first
            region = region_category(node.name)
            if region:
                category = region
                break
        if category is None:
            for node in chain:  # innermost first
                category = op_category(node.name) if is_op(node.name) else None
                if category:
                    break
        if category is None and any(is_op(node.name) for node in chain):
            category = "other"
        self.memo[key] = category
        return category


def overlap(start: float, end: float, window: tuple[float, float]) -> float:
    return max(0.0, min(end, window[1]) - max(start, window[0]))


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def step_windows(events) -> list[tuple[float, float]]:
    """(start, end) in microseconds of each step: from one step-end marker to the next."""
    marks = sorted(e.time_range.start for e in events if e.name == MARKER)
    return list(zip(marks, marks[1:]))


def time_shares(events) -> dict[str, Any]:
    """Per step (mean over the profiled steps): seconds, the share of each category, the sum check, sync counts and
    the largest ops by self time of each category. `events`: the profiler's FunctionEvents."""
    windows = step_windows(events)
    if not windows:
        raise ValueError("the profile holds fewer than two step markers: no whole step was profiled")
    starts = [w[0] for w in windows]
    host = [e for e in events if not e.is_async and e.name != MARKER and e.device_type.name == "CPU"
            and e.name != "[memory]"]
    classify = Classifier()
    seconds: dict[str, float] = defaultdict(float)
    by_op: dict[tuple[str, str], float] = defaultdict(float)
    attributed: list[tuple[float, float]] = []
    syncs, cuda_syncs = 0, 0
    for event in host:
        start, end = event.time_range.start, event.time_range.end
        first = bisect.bisect_right(starts, start) - 1
        inside = [w for w in windows[max(first, 0):] if w[0] < end and w[1] > start]
        if not inside:
            continue
        category = classify(event)
        syncs += event.name in SYNC_OPS and category != "optimizer"
        cuda_syncs += event.name.startswith(CUDA_SYNCS)
        if category is None:
            continue
        parent = event.cpu_parent
        if parent is None or classify(parent) is None:  # the outermost attributed event: its interval counts once
            attributed += [(max(start, w[0]), min(end, w[1])) for w in inside]
        own = sum(overlap(start, end, w) for w in inside)
        children = sum(overlap(c.time_range.start, c.time_range.end, w) for c in event.cpu_children
                       for w in inside)
        self_time = max(own - children, 0.0)
        seconds[category] += self_time
        by_op[category, event.name] += self_time
    total = sum(w[1] - w[0] for w in windows)
    seconds["overhead"] = total - union_length(attributed)
    n = len(windows)
    shares = {c: seconds.get(c, 0.0) / total for c in CATEGORIES}
    top: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for (category, name), value in sorted(by_op.items(), key=lambda kv: -kv[1]):
        if len(top[category]) < 4:
            top[category].append((name, round(value / total, 4)))
    result = {"steps": n, "step_seconds": total / n / 1e6, "shares": shares, "sum_check": sum(shares.values()),
              "sync_ops_per_step": syncs / n, "top_ops": dict(top)}
    if any(e.device_type.name == "CUDA" for e in events):
        result["cuda_syncs_per_step"] = cuda_syncs / n
        kernels = [(e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA"]
        result["device_busy"] = sum(union_length((max(a, w[0]), min(b, w[1])) for a, b in kernels if a < w[1]
                                                 and b > w[0]) for w in windows) / total
    return result


def sync_sites(events) -> dict[str, int]:
    """Per Python line, the sync ops it ran outside the optimizer (the profile must hold stacks): the innermost
    frame outside torch's own modules ("path.py(line): function")."""
    classify = Classifier()
    sites: dict[str, int] = defaultdict(int)
    for event in events:
        if event.name in SYNC_OPS and classify(event) != "optimizer":
            node = event.cpu_parent  # with stacks, Python's calls are events too: "path.py(line): function"
            while node is not None and not (PY_FRAME.search(node.name) and "torch/" not in node.name):
                node = node.cpu_parent
            sites[node.name if node is not None else "(no Python frame)"] += 1
    return dict(sorted(sites.items(), key=lambda kv: -kv[1]))


def memory_peak(profiler, device: str) -> dict[str, Any]:
    """The peak of live tensor bytes on `device` during the profiled window, in MiB, split by what holds them.
    torch's memory profiler is a private module; its categories are what export_memory_timeline plots."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    times, sizes = MemoryProfileTimeline(profiler._memory_profile())._coalesce_timeline(device)
    if not sizes:
        return {"peak_mib": 0.0, "held_by": {}}
    peak = max(sizes, key=sum)
    names = ["unknown" if c is None else c.name.lower() for c in _CATEGORY_TO_INDEX]
    held = {name: peak[i + 1] / 2**20 for i, name in enumerate(names) if peak[i + 1]}
    return {"peak_mib": sum(peak) / 2**20, "held_by": dict(sorted(held.items(), key=lambda kv: -kv[1]))}


class StepProfile:
    """With --profile: time shares over the measured steps (after the warm-up ones), then the last step alone for
    the memory peak. Call `step_ended(count)` after every optimizer step; `result` holds the figures after the
    last; the operator table (self time, largest first) goes to `path`."""

    def __init__(self, enabled: bool, warmup: int, steps: int, path: Path) -> None:
        if enabled and steps < warmup + 2:
            raise ValueError(f"--profile needs at least {warmup + 2} steps: {warmup} warm-up, one or more timed, "
                             f"one for the memory peak")
        self.enabled, self.warmup, self.steps, self.path = enabled, warmup, steps, path
        self.profiler = None
        self.result: dict[str, Any] | None = None
        self.ops_table = ""

    def start(self, memory: bool) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True,
                                               with_stack=memory)
        self.profiler.__enter__()
        self.mark()

    def mark(self) -> None:
        import torch

        with torch.profiler.record_function(MARKER):
            pass

    def step_ended(self, count: int) -> None:
        import torch

        if not self.enabled:
            return
        if self.profiler is not None:
            self.mark()
        if count == self.warmup:
            self.start(memory=False)
        elif count == self.steps - 1:
            self.profiler.__exit__(None, None, None)
            self.result = {"time": time_shares(self.profiler.events())}
            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.ops_table = self.profiler.key_averages().table(sort_by=f"self_{device}_time_total", row_limit=30)
            self.start(memory=True)
        elif count == self.steps:
            self.profiler.__exit__(None, None, None)
            self.result["memory"] = memory_peak(self.profiler, "cuda:0" if torch.cuda.is_available() else "cpu")
            self.result["sync_sites"] = sync_sites(self.profiler.events())
            self.profiler = None
            self.path.write_text(self.report())

    def report(self) -> str:
        """profile.txt: the shares, the largest ops of each category, the memory peak, the sync sites, and
        torch.profiler's operator table of the timed steps."""
        time, memory = self.result["time"], self.result["memory"]
        lines = [f"{time['steps']} steps, {time['step_seconds']:.3f} s a step (profiled); shares: "
                 + ", ".join(f"{c} {time['shares'][c]:.1%}" for c in CATEGORIES) + f"; sum {time['sum_check']:.3f}"]
        for category, ops in time["top_ops"].items():
            lines.append(f"  {category}: " + ", ".join(f"{name} {share:.1%}" for name, share in ops))
        lines.append(f"memory peak (last step): {memory['peak_mib']:,.1f} MiB of tensors: "
                     + ", ".join(f"{k} {v:,.1f}" for k, v in memory["held_by"].items()))
        lines.append(f"sync ops per step: {time['sync_ops_per_step']:.1f}; in the last step, by line: "
                     + ("; ".join(f"{site} x{n}" for site, n in self.result["sync_sites"].items()) or "none"))
        return "\n".join(lines) + "\n\n" + self.ops_table + "\n"


def shares_row(label: str, runs: list[dict[str, Any]]) -> str:
    """A markdown row of the "where the time goes" table: the median over `runs` (each with its "profile")."""
    import statistics

    profiles = [r["profile"] for r in runs if r.get("profile")]
    if not profiles:
        return f"| {label} |" + " - |" * (len(CATEGORIES) + 5)

    def med(get) -> float:
        return statistics.median(get(p) for p in profiles)

    cells = [f"{med(lambda p: p['time']['step_seconds']):.2f}"]
    cells += [f"{med(lambda p, c=c: p['time']['shares'][c]):.1%}" for c in CATEGORIES]
    cells.append(f"{med(lambda p: p['time']['sum_check']):.3f}")
    cells.append(f"{med(lambda p: p['time']['sync_ops_per_step']):.0f}"
                 + (f" ({med(lambda p: p['time']['cuda_syncs_per_step']):.0f})"
                    if "cuda_syncs_per_step" in profiles[0]["time"] else ""))
    memory = profiles[len(profiles) // 2]["memory"]
    held = ", ".join(f"{k} {v:,.0f}" for k, v in list(memory["held_by"].items())[:3])
    cells.append(f"{memory['peak_mib']:,.0f} ({held})")
    cells.append(str(len(profiles)))
    return f"| {label} | " + " | ".join(cells) + " |"


def shares_table(rows: dict[str, list[dict[str, Any]]]) -> str:
    """rows: label -> runs. The "where the time goes" table, one row per label."""
    head = ("| run | s/step (profiled) | " + " | ".join(CATEGORIES) + " | sum | sync ops/step | "
            "peak tensor MiB (largest holders) | runs |")
    lines = [head, "|" + "---|" * (len(CATEGORIES) + 6)]
    lines += [shares_row(label, runs) for label, runs in rows.items()]
    return "\n".join(lines)
