"""What the map writes: the colour scales (matplotlib colormaps and norms), the static PNG (matplotlib, with a
colour bar and the cluster numbers), and the page (package data: page.html with page.css and page.js inlined, so
the written map is one file that loads nothing from the network).

A colour scale maps each point's value to one of BINS colours once, here; the page only draws the codes, so the
page, its legend and the PNG cannot disagree about a colour.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any, Optional

import numpy as np

from gpt4all_training.analysis.map.runs import Run
from gpt4all_training.files import atomic_file, atomic_write

BINS = 64  # colours per ramp; code BINS is "missing"
MAX_CATEGORIES = 20  # tab20's colours; rarer sources share the last one as "other"
BACKGROUND = "#111111"
MISSING = "#5a5a5a"
# Bright enough on the dark background: the darkest ends of turbo are cut off. High loss, and loss that went up,
# are red in both: red is "look here".
LOSS_COLORMAP = ("turbo", 0.1, 0.95)
CHANGE_COLORMAP = "coolwarm"
PLACEHOLDER = re.compile(r"__(TITLE|CSS|JS|DATA)__")  # in page.html


@dataclass
class ColorScale:
    """Values to colours: a matplotlib norm (value -> [0, 1]) and colormap, and how to draw and label them."""
    title: str
    values: np.ndarray
    norm: Any  # matplotlib.colors.Normalize
    cmap: Any  # matplotlib.colors.Colormap
    magnitude_on_top: bool  # draw the largest |value| last (changes); otherwise the largest value last

    def codes(self) -> np.ndarray:
        """Each value's colour, 0..BINS-1, or BINS where it is missing."""
        position = np.clip(np.ma.filled(self.norm(np.nan_to_num(self.values)), 0.0), 0.0, 1.0)
        codes = np.minimum((position * BINS).astype(np.int64), BINS - 1)
        codes[~np.isfinite(self.values)] = BINS
        return codes

    def colors(self) -> list[str]:
        from matplotlib.colors import to_hex

        return [to_hex(self.cmap((b + 0.5) / BINS)) for b in range(BINS)] + [MISSING]

    def draw_order(self) -> list[int]:
        """Codes from the least to the most notable, so the notable points end on top; missing first."""
        centres = np.asarray(self.norm.inverse((np.arange(BINS) + 0.5) / BINS), dtype=np.float64)
        key = np.abs(centres) if self.magnitude_on_top else centres
        return [BINS, *np.argsort(key, kind="stable").tolist()]

    def ticks(self) -> list[tuple[float, str]]:
        """Round values inside the range, with their positions along the legend's bar."""
        from matplotlib.ticker import MaxNLocator

        low, high = float(self.norm.vmin), float(self.norm.vmax)
        values = [v for v in MaxNLocator(5).tick_values(low, high) if low <= v <= high]
        if getattr(self.norm, "vcenter", None) is not None and 0.0 not in values:
            values = sorted([*values, 0.0])
        return [(round(float(self.norm(v)), 4), f"{v:.3g}") for v in values]

    def page(self) -> dict:
        return {"title": self.title, "code": self.codes().tolist(), "colors": self.colors(),
                "order": self.draw_order(), "ticks": self.ticks()}


def finite_percentiles(values: np.ndarray, low: float, high: float) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 0.0, 1.0
    return float(np.percentile(finite, low)), float(np.percentile(finite, high))


def loss_scale(loss: np.ndarray, title: str = "loss") -> ColorScale:
    """turbo over the 2nd..98th percentile of the losses (or any values): a few outliers do not wash the rest
    out."""
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap, Normalize

    low, high = finite_percentiles(loss, 2, 98)
    if high <= low:
        low, high = low - 0.5, low + 0.5
    name, start, stop = LOSS_COLORMAP
    cmap = ListedColormap(colormaps[name](np.linspace(start, stop, 256)))
    return ColorScale(title, loss, Normalize(low, high), cmap, magnitude_on_top=False)


def change_scale(change: np.ndarray, title: str = "loss change (input - compare)") -> ColorScale:
    """Blue for loss that went down, red for up, over the 2nd..98th percentile of the changes. When both signs
    occur, 0 is the neutral grey in the middle (two slopes, one per sign); when the changes share a sign (say
    fine-tuning lowered every loss), that half of the colormap spans the data's own range, so the points differ in
    colour instead of all sharing one pale shade."""
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap, Normalize, TwoSlopeNorm

    low, high = finite_percentiles(change, 2, 98)
    diverging = colormaps[CHANGE_COLORMAP]
    if low < 0.0 < high:
        return ColorScale(title, change, TwoSlopeNorm(0.0, low, high), diverging, magnitude_on_top=True)
    if high <= low:
        low, high = low - 0.5, low + 0.5
    half = np.linspace(0.0, 0.45, 256) if high <= 0 else np.linspace(0.55, 1.0, 256)
    return ColorScale(title, change, Normalize(low, high), ListedColormap(diverging(half)), magnitude_on_top=True)


def column_scale(name: str, values: np.ndarray) -> ColorScale:
    """A numeric column's scale, titled by its name: the loss change's diverging one for a change (loss_change) and
    for values of both signs, where 0 means something; else the loss's ramp."""
    low, high = finite_percentiles(values, 2, 98)
    if name.endswith("change") or low < 0.0 < high:
        return change_scale(values, name)
    return loss_scale(values, name)


def category_colors(n: int) -> list[str]:
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    tab20 = colormaps["tab20"]
    return [to_hex(tab20(i % tab20.N)) for i in range(n)]


def categories(values: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Category names by frequency (the rarest folded into 'other') and each row's code."""
    counts = Counter(values.tolist())
    names = [name for name, _ in counts.most_common()]
    if len(names) > MAX_CATEGORIES:
        names = names[:MAX_CATEGORIES - 1] + ["other"]
    lookup = {name: i for i, name in enumerate(names)}
    other = len(names) - 1
    return names, np.array([lookup.get(v, other) for v in values.tolist()], dtype=np.int64)


def write_png(xy: np.ndarray, scale: ColorScale, labels: np.ndarray, path: Path, title: str) -> None:
    """The layout coloured by `scale`, notable points on top, with a colour bar and each cluster's number at its
    median position; 1000 x 800 pixels."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a file only
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable

    codes = scale.codes()
    rank = np.empty(BINS + 1, dtype=np.int64)
    rank[scale.draw_order()] = np.arange(BINS + 1)
    order = np.argsort(rank[codes], kind="stable")
    colors = np.array(scale.colors())[codes[order]]
    # Marker area in points^2: large for a few hundred points, about a pixel for 100k, so dense maps stay legible.
    size = float(np.clip(4000.0 / len(xy), 0.3, 30.0))
    fig, ax = plt.subplots(figsize=(10, 8), dpi=100, facecolor=BACKGROUND)
    try:
        ax.set_facecolor(BACKGROUND)
        ax.scatter(xy[order, 0], xy[order, 1], s=size, c=colors, linewidths=0, rasterized=True)
        for c in range(int(labels.max()) + 1):
            where = np.median(xy[labels == c], axis=0)
            ax.text(where[0], where[1], str(c), color="white", fontsize=8, ha="center", va="center",
                    bbox={"facecolor": "black", "alpha": 0.5, "pad": 1, "linewidth": 0})
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.set_aspect("equal")
        ax.set_axis_off()
        ax.set_title(title, color="white", fontsize=11)
        bar = fig.colorbar(ScalarMappable(scale.norm, scale.cmap), ax=ax, fraction=0.04, pad=0.02)
        bar.set_label(scale.title, color="white")
        bar.ax.tick_params(colors="white")
        with atomic_file(path) as tmp:
            fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", facecolor=BACKGROUND)
    finally:
        plt.close(fig)


def truncate(column, limit: int) -> list[str]:
    """Texts cut to `limit` characters with an ellipsis; the page carries these, not the full records."""
    out = []
    for text in column.to_pylist():
        text = text or ""
        out.append(text if len(text) <= limit else text[:limit - 1] + "\u2026")
    return out


def rounded(values: np.ndarray, digits: int) -> list[Optional[float]]:
    return [None if not math.isfinite(v) else v for v in np.round(values.astype(np.float64), digits).tolist()]


def map_title(run: Run) -> str:
    return f"{run.path.parent.name or run.path.name}: {len(run.loss)} examples"


def page_payload(run: Run, xy: np.ndarray, labels: np.ndarray, rows: list[dict], scales: dict[str, ColorScale],
                 change: Optional[np.ndarray], other: Optional[Run], text_chars: int, color: str) -> dict:
    """What the page draws; `scales` holds a colour mode per numeric column (and the loss change), `color` is the
    mode it opens with."""
    sources, source_codes = categories(run.source)
    split_names, split_codes = categories(run.split)
    shown = {name: rounded(values, 4) for name, values in run.numeric.items() if name not in ("loss", "n_tokens")}
    return {
        "title": map_title(run),
        "subtitle": str(run.path) + (f" compared with {other.path}" if other is not None else ""),
        "input": str(run.path),
        "x": rounded(xy[:, 0], 4), "y": rounded(xy[:, 1], 4),
        "loss": rounded(run.loss, 4), "n_tokens": run.n_tokens.tolist(), "index": run.index.tolist(),
        "cluster": labels.tolist(), "source": source_codes.tolist(), "sources": sources,
        "split": split_codes.tolist(), "splits": split_names,
        "prompt": truncate(run.prompt, text_chars), "response": truncate(run.response, text_chars),
        "model_answer": truncate(run.model_answer, text_chars) if run.model_answer is not None else None,
        "values": shown, "color": color,
        "clusters": [{k: r[k] for k in ("cluster", "label", "size", "mean_loss", "mean_loss_change") if k in r}
                     for r in rows],
        "scales": {name: scale.page() for name, scale in scales.items()},
        "categories": category_colors(MAX_CATEGORIES), "background": BACKGROUND,
        "change": rounded(change, 4) if change is not None else None,
    }


def read_page_file(name: str) -> str:
    return files("gpt4all_training.analysis.map").joinpath(name).read_text(encoding="utf-8")


def write_html(payload: dict, path: Path) -> None:
    """page.html with its placeholders filled in one pass, so that text put in is never read as a placeholder."""
    # "<" escaped so that no text in the data can close the <script> element it lives in.
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    parts = {"TITLE": escape_html(payload["title"]), "CSS": read_page_file("page.css").strip(),
             "JS": read_page_file("page.js").strip(), "DATA": data}
    page = PLACEHOLDER.sub(lambda match: parts[match.group(1)], read_page_file("page.html"))
    atomic_write(path, page)


def escape_html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
