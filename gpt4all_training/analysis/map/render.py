"""What the map writes: the colours, the static PNG, and the page (package data: page.html with page.css and page.js
inlined, so the written map is one file that loads nothing from the network)."""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from collections import Counter
from importlib.resources import files
from pathlib import Path
from typing import Optional

import numpy as np

from gpt4all_training.analysis.map.runs import Run

MAX_CATEGORIES = 20  # colours; rarer sources share the last one as "other"
# Colour ramps shared by the page and the PNG, bright enough for a dark background: low loss blue through green to
# high loss red; loss change blue (went down) through grey to red (went up). Red is "look here" in both.
LOSS_STOPS = [(60, 120, 216), (70, 190, 190), (140, 210, 90), (250, 200, 40), (240, 60, 50)]
CHANGE_STOPS = [(5, 113, 176), (146, 197, 222), (200, 200, 200), (244, 165, 130), (202, 0, 32)]
CATEGORY_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
                   (140, 86, 75), (227, 119, 194), (188, 189, 34), (23, 190, 207), (174, 199, 232),
                   (255, 187, 120), (152, 223, 138), (255, 152, 150), (197, 176, 213), (196, 156, 148),
                   (247, 182, 210), (219, 219, 141), (158, 218, 229), (255, 255, 255), (127, 127, 127)]
BACKGROUND = (17, 17, 17)
MISSING = (90, 90, 90)
PLACEHOLDER = re.compile(r"__(TITLE|CSS|JS|DATA)__")  # in page.html


def color_range(values: np.ndarray, symmetric: bool = False) -> tuple[float, float]:
    """2nd..98th percentile of the finite values (symmetric about 0 for changes): outliers do not wash it out."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return (-1.0, 1.0) if symmetric else (0.0, 1.0)
    if symmetric:
        bound = max(float(np.percentile(np.abs(finite), 98)), 1e-6)
        return -bound, bound
    low, high = float(np.percentile(finite, 2)), float(np.percentile(finite, 98))
    return (low, high) if high > low else (low - 0.5, low + 0.5)


def ramp_colors(values: np.ndarray, value_range: tuple[float, float], stops: list[tuple]) -> np.ndarray:
    """(n, 3) uint8 colours along a piecewise-linear ramp; NaN gets the 'missing' grey."""
    stops_array = np.asarray(stops, dtype=np.float64)
    low, high = value_range
    t = np.clip((np.nan_to_num(values, nan=low) - low) / (high - low), 0.0, 1.0) * (len(stops) - 1)
    left = np.minimum(t.astype(np.int64), len(stops) - 2)
    frac = (t - left)[:, None]
    rgb = stops_array[left] * (1 - frac) + stops_array[left + 1] * frac
    rgb[~np.isfinite(values)] = MISSING
    return np.round(rgb).astype(np.uint8)


def rasterize(xy: np.ndarray, rgb: np.ndarray, order: np.ndarray, width: int = 1000, height: int = 800,
              radius: int = 1) -> np.ndarray:
    """Points as (2 radius + 1)-pixel squares on the background, drawn in `order` (later on top)."""
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    pad = 10 + radius
    side = min(width, height) - 2 * pad
    left, top = (width - side) // 2, (height - side) // 2
    px = np.round(left + xy[order, 0] * side).astype(np.int64)
    py = np.round(top + (1.0 - xy[order, 1]) * side).astype(np.int64)
    colors = rgb[order]
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            image[py + dy, px + dx] = colors  # later rows overwrite earlier ones: `order` decides what is on top
    return image


def encode_png(image: np.ndarray) -> bytes:
    """An 8-bit RGB PNG: signature, IHDR, one zlib IDAT of unfiltered rows, IEND."""
    height, width, _ = image.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = np.concatenate([np.zeros((height, 1), np.uint8), image.reshape(height, width * 3)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
            + chunk(b"IEND", b""))


def write_png(xy: np.ndarray, loss: np.ndarray, change: Optional[np.ndarray], path: Path) -> None:
    """The layout coloured by loss, or by loss change when there is one."""
    values, stops, value_range = ((change, CHANGE_STOPS, color_range(change, True)) if change is not None
                                  else (loss, LOSS_STOPS, color_range(loss)))
    # Draw by |value| for changes and by value for loss, so that what matters is on top.
    order = np.argsort(np.nan_to_num(np.abs(values) if change is not None else values, nan=-np.inf), kind="stable")
    path.write_bytes(encode_png(rasterize(xy, ramp_colors(values, value_range, stops), order)))


def categories(values: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Category names by frequency (the rarest folded into 'other') and each row's code."""
    counts = Counter(values.tolist())
    names = [name for name, _ in counts.most_common()]
    if len(names) > MAX_CATEGORIES:
        names = names[:MAX_CATEGORIES - 1] + ["other"]
    lookup = {name: i for i, name in enumerate(names)}
    other = len(names) - 1
    return names, np.array([lookup.get(v, other) for v in values.tolist()], dtype=np.int64)


def truncate(column, limit: int) -> list[str]:
    """Texts cut to `limit` characters with an ellipsis; the page carries these, not the full records."""
    out = []
    for text in column.to_pylist():
        text = text or ""
        out.append(text if len(text) <= limit else text[:limit - 1] + "\u2026")
    return out


def rounded(values: np.ndarray, digits: int) -> list[Optional[float]]:
    return [None if not math.isfinite(v) else v for v in np.round(values.astype(np.float64), digits).tolist()]


def page_payload(run: Run, xy: np.ndarray, labels: np.ndarray, rows: list[dict], change: Optional[np.ndarray],
                 other: Optional[Run], text_chars: int) -> dict:
    sources, source_codes = categories(run.source)
    split_names, split_codes = categories(run.split)
    payload = {
        "title": f"{run.path.parent.name or run.path.name}: {len(run.loss)} examples",
        "subtitle": str(run.path) + (f" compared with {other.path}" if other is not None else ""),
        "x": rounded(xy[:, 0], 4), "y": rounded(xy[:, 1], 4),
        "loss": rounded(run.loss, 4), "n_tokens": run.n_tokens.tolist(), "index": run.index.tolist(),
        "cluster": labels.tolist(), "source": source_codes.tolist(), "sources": sources,
        "split": split_codes.tolist(), "splits": split_names,
        "prompt": truncate(run.prompt, text_chars), "response": truncate(run.response, text_chars),
        "clusters": [{k: r[k] for k in ("cluster", "label", "size", "mean_loss", "mean_loss_change") if k in r}
                     for r in rows],
        "loss_range": color_range(run.loss), "loss_stops": LOSS_STOPS,
        "categories": CATEGORY_COLORS, "missing": MISSING, "background": BACKGROUND,
        "change": None,
    }
    if change is not None:
        payload.update(change=rounded(change, 4), change_range=color_range(change, symmetric=True),
                       change_stops=CHANGE_STOPS)
    return payload


def read_page_file(name: str) -> str:
    return files("gpt4all_training.analysis.map").joinpath(name).read_text(encoding="utf-8")


def write_html(payload: dict, path: Path) -> None:
    """page.html with its placeholders filled in one pass, so that text put in is never read as a placeholder."""
    # "<" escaped so that no text in the data can close the <script> element it lives in.
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    parts = {"TITLE": escape_html(payload["title"]), "CSS": read_page_file("page.css").strip(),
             "JS": read_page_file("page.js").strip(), "DATA": data}
    page = PLACEHOLDER.sub(lambda match: parts[match.group(1)], read_page_file("page.html"))
    path.write_text(page, encoding="utf-8")


def escape_html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")

