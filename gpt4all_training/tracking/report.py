"""report.html: the run's curves, drawn by matplotlib, and its summary, as one self-contained page.

Each panel is an inline SVG with its text kept as text (`svg.fonttype: none`), so tick labels, legends and titles
are searchable and readable in the DOM, and every drawn series carries an id (`train-loss`, `validation-loss`, ...).
Panels: the training loss (raw and smoothed) with the validation loss (markers, so one evaluation still shows),
for preference tuning the rewards and the reward accuracy (training and validation), for grpo the completions'
rewards (each reward's too), the groups without signal, clipping, KL, entropy and completion lengths; learning rate,
gradient norm, tokens per second, step time (batches, grpo's decoding, the update), padding fraction and peak memory;
a panel whose metric was never logged is left out. Below the panels, the scores with their 95% intervals
(intervals.py): a preference run's held-out reward accuracy (Wilson, over its validation pairs) and, once
`eval_tasks` has scored final/, every harness score of eval/results.json; then the run's summary.
"""

from __future__ import annotations

import html
import io
import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

from gpt4all_training.files import atomic_write
from gpt4all_training.intervals import proportion
from gpt4all_training.run_folder import METRICS_FILE, REPORT_FILE
from gpt4all_training.tracking.tracker import read_metrics

# (panel id, title, y label, [(metric, legend label)], log scale when the values span more than 100x)
PANELS = [
    ("rewards", "Rewards (mean over pairs)", "reward", [("rewards/chosen", "chosen"), ("rewards/rejected", "rejected"),
                                                       ("rewards/margins", "margin"),
                                                       ("val_rewards/margins", "validation margin")], False),
    ("reward-accuracy", "Reward accuracy", "fraction of pairs, chosen above rejected",
     [("rewards/accuracies", "train"), ("val_rewards/accuracies", "validation")], False),
    ("completion-signal", "Groups without signal, clipping, truncation", "fraction",
     [("frac_reward_zero_std", "groups with all-equal rewards"), ("clip_ratio/region_mean", "tokens clipped"),
      ("completions/clipped_ratio", "completions cut at max length")], False),
    ("kl-entropy", "KL to the reference, entropy", "nats per completion token",
     [("kl", "KL"), ("entropy", "entropy")], False),
    ("completion-length", "Completion length", "tokens",
     [("completions/mean_length", "mean"), ("completions/min_length", "min"), ("completions/max_length", "max")],
     False),
    ("lr", "Learning rate", "lr", [("lr", "learning rate")], False),
    ("grad-norm", "Gradient norm (before clipping)", "norm", [("grad_norm", "gradient norm")], True),
    ("throughput", "Throughput", "tokens/s", [("tokens_per_s", "tokens/s"),
                                              ("trained_tokens_per_s", "trained tokens/s")], False),
    ("step-time", "Step time", "seconds per logged window",
     [("batch_seconds", "batches (grpo: sampling, rewards)"), ("generation_seconds", "decoding completions"),
      ("update_seconds", "update")], False),
    ("padding", "Padding", "fraction of positions", [("padding_fraction", "padding fraction")], False),
    ("memory", "Peak memory", "MiB", [("peak_rss_mb", "host RSS"), ("peak_gpu_mb", "GPU allocated")], False),
]
SMOOTHED_FROM = 10  # logged steps; fewer are all visible as they are
COLORS = {"train": "#1f77b4", "smoothed": "#0b3c66", "validation": "#ff7f0e"}
PAGE_STYLE = ("body{font-family:sans-serif;margin:16px;color:#222}figure{margin:0}figure svg{width:100%;height:auto}"
              ".panels{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:12px}"
              "table{border-collapse:collapse;margin-top:12px}th,td{padding:2px 10px;border-bottom:1px solid #ddd;"
              "text-align:left}td{font-variant-numeric:tabular-nums}")


def readable(value: Any) -> str:
    """A value as people read it: integers whole, large floats without decimals, other floats to 4 significant
    digits, text as it is, anything else as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, int) or not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of every row with a finite `key`: a skipped step (nan_policy: skip) logs NaN, not drawn."""
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def smoothed(values: list[float]) -> list[float]:
    """An exponential moving average over about a tenth of the points (pandas' ewm, bias-corrected at the start)."""
    import pandas as pd

    return pd.Series(values).ewm(span=max(2, len(values) // 10)).mean().tolist()


def new_axes(title: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a file only
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=100)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.ticklabel_format(axis="y", useOffset=False, style="sci", scilimits=(-3, 5))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, also for a one-step run
    return fig, ax


def to_svg(fig, panel: str) -> str:
    """The figure as an inline <svg> element: text as text, no date, ids unique to the panel."""
    import matplotlib.pyplot as plt
    from matplotlib import rc_context

    buffer = io.StringIO()
    # hashsalt: matplotlib derives clip-path ids from it; two inline SVGs sharing an id would share a clip.
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": panel}):
        fig.tight_layout()
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def loss_panel(rows: list[dict[str, Any]]) -> Optional[str]:
    steps, loss = series(rows, "loss")
    val_steps, val_loss = series(rows, "val_loss")
    if not steps and not val_steps:
        return None
    fig, ax = new_axes("Loss", "loss (per trained token; dpo: per pair)")
    if steps:
        ax.plot(steps, loss, color=COLORS["train"], alpha=0.35, linewidth=1, marker="." if len(steps) < 50 else None,
                label="train loss", gid="train-loss")
        if len(steps) >= SMOOTHED_FROM:
            ax.plot(steps, smoothed(loss), color=COLORS["smoothed"], linewidth=2, label="train loss (smoothed)",
                    gid="train-loss-smoothed")
    if val_steps:
        ax.plot(val_steps, val_loss, color=COLORS["validation"], marker="o", markersize=6, linewidth=1.5,
                label="validation loss", gid="validation-loss")
    ax.legend(loc="upper right", fontsize=9)
    return to_svg(fig, "loss")


def metric_panel(rows: list[dict[str, Any]], panel: str, title: str, ylabel: str,
                 metrics: list[tuple[str, str]], log_when_wide: bool) -> Optional[str]:
    drawn = [(key, label, *series(rows, key)) for key, label in metrics]
    drawn = [d for d in drawn if d[2]]
    if not drawn:
        return None
    fig, ax = new_axes(title, ylabel)
    for key, label, steps, values in drawn:
        # markers too: a metric logged once is one point, which a line alone would not show
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, linewidth=1.5, label=label,
                gid=key.replace("_", "-").replace("/", "-"))
    values = [v for d in drawn for v in d[3]]
    if log_when_wide and min(values) > 0 and max(values) / min(values) > 100:
        ax.set_yscale("log")
    ax.legend(loc="best", fontsize=9)
    return to_svg(fig, panel)


def completion_reward_panel(rows: list[dict[str, Any]]) -> Optional[str]:
    """grpo's rewards: the weighted sum, each reward's mean (rewards/<name>/mean, named in the run's config) and the
    validation's greedy completions'."""
    names = dict.fromkeys(k for row in rows for k in row if k.startswith("rewards/") and k.endswith("/mean"))
    metrics = [("reward", "reward (weighted sum)"), *[(k, k.split("/")[1]) for k in names],
               ("val_reward", "validation (greedy)")]
    return metric_panel(rows, "completion-rewards", "Rewards (mean over completions)", "reward", metrics, False)


def figure(panel: str, svg: str) -> str:
    return f"<figure class='panel' id='panel-{panel}'>{svg}</figure>"


def score_rows(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(score, value [95% interval], over what) of the run's own held-out scores."""
    accuracy, pairs = summary.get("val_rewards/accuracies"), summary.get("val_pairs")
    if isinstance(accuracy, (int, float)) and math.isfinite(accuracy) and pairs:
        # Each validation pair is ranked right or not: the accuracy is a proportion of val_pairs.
        return [("val_rewards/accuracies", proportion(round(accuracy * pairs), pairs).number(),
                 f"{pairs} validation pairs")]
    return []


def write_report(output_dir: str | Path, summary: dict[str, Any],
                 harness_rows: Sequence[tuple[str, str, str]] = ()) -> Path:
    """report.html: the panels of metrics.jsonl, the held-out scores with their intervals (the run's own, then
    `harness_rows` from an evaluation of final/) and the summary."""
    output_dir = Path(output_dir)
    rows = read_metrics(output_dir / METRICS_FILE)
    panels = []
    if (svg := loss_panel(rows)) is not None:
        panels.append(figure("loss", svg))
    if (svg := completion_reward_panel(rows)) is not None:
        panels.append(figure("completion-rewards", svg))
    for panel, title, ylabel, metrics, log_when_wide in PANELS:
        if (svg := metric_panel(rows, panel, title, ylabel, metrics, log_when_wide)) is not None:
            panels.append(figure(panel, svg))
    body = (f"<div class='panels'>{''.join(panels)}</div>" if panels else "<p>No loss was logged.</p>")
    table = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(readable(v))}</td></tr>"
                    for k, v in summary.items())
    held_out = [*score_rows(summary), *harness_rows]
    intervals = "" if not held_out else (
        "<h2>Scores with 95% intervals</h2><table id='scores'><tr><th>score</th><th>value [95% interval]</th>"
        "<th>over</th></tr>" + "".join(f"<tr><th>{html.escape(name)}</th><td>{html.escape(value)}</td>"
                                       f"<td>{html.escape(over)}</td></tr>" for name, value, over in held_out)
        + "</table>")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>training report</title>"
            f"<style>{PAGE_STYLE}</style></head><body><h1>Training report</h1>{body}{intervals}"
            f"<h2>Summary</h2><table>{table}</table></body></html>")
    return atomic_write(output_dir / REPORT_FILE, page)
