"""report.html: the training and validation loss curves and the run's throughput, as one self-contained page."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from gpt4all_training.tracking.tracker import read_metrics


def _polyline(points: list[tuple[float, float]], box: tuple[float, float, float, float], width: int,
              height: int) -> str:
    x0, x1, y0, y1 = box
    sx = (width - 60) / max(x1 - x0, 1e-9)
    sy = (height - 40) / max(y1 - y0, 1e-9)
    return " ".join(f"{50 + (x - x0) * sx:.1f},{height - 25 - (y - y0) * sy:.1f}" for x, y in points)


def loss_chart(rows: list[dict[str, Any]], width: int = 720, height: int = 320) -> str:
    """An inline SVG with train loss (blue) and validation loss (orange) against the optimiser step."""
    # A skipped step (nan_policy: skip) logs a NaN loss: it is counted in the summary, not drawn.
    train = [(r["step"], r["loss"]) for r in rows if math.isfinite(r.get("loss", math.nan))]
    val = [(r["step"], r["val_loss"]) for r in rows if math.isfinite(r.get("val_loss", math.nan))]
    points = train + val
    if not points:
        return "<p>No loss was logged.</p>"
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    box = (min(xs), max(xs), min(ys), max(ys))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
             f'<rect width="{width}" height="{height}" fill="white" stroke="#ccc"/>',
             f'<text x="50" y="15" font-size="12">loss {box[3]:.3f}</text>',
             f'<text x="50" y="{height - 5}" font-size="12">loss {box[2]:.3f} | step {box[0]} .. {box[1]}</text>']
    for series, color in ((train, "#1f77b4"), (val, "#ff7f0e")):
        if series:
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                         f'points="{_polyline(series, box, width, height)}"/>')
    parts.append("</svg>")
    return "".join(parts)


def write_report(output_dir: str | Path, summary: dict[str, Any]) -> Path:
    output_dir = Path(output_dir)
    rows = read_metrics(output_dir / "metrics.jsonl")
    table = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(json.dumps(v))}</td></tr>"
                    for k, v in summary.items())
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>training report</title></head>"
            f"<body style='font-family:sans-serif'><h1>Training report</h1>"
            f"<p><span style='color:#1f77b4'>train loss</span> and "
            f"<span style='color:#ff7f0e'>validation loss</span> by optimiser step</p>{loss_chart(rows)}"
            f"<table>{table}</table></body></html>")
    path = output_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
