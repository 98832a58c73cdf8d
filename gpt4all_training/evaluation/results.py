"""The results of an evaluation: written as results.json, read back, shown as tables, compared with another run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gpt4all_training.config.secrets import redact
from gpt4all_training.errors import UserError
from gpt4all_training.files import atomic_write
from gpt4all_training.readers import read_json

RESULTS_FILE = "results.json"
# Entries of a task's results that are not scores.
NOT_SCORES = ("alias", "name", "sample_len", "sample_count")


def jsonable(value: Any) -> Any:
    """What json cannot write itself, as the harness's own writer treats it: NumPy numbers as numbers, sets as
    lists, anything else (a task's data-loading function) as its str."""
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    if isinstance(value, set):
        return sorted(value, key=str)
    return str(value)


def write_results(results: dict[str, Any], folder: str | Path) -> Path:
    """folder/results.json, replaced atomically; the paths and settings in it with their secrets hidden."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return atomic_write(folder / RESULTS_FILE, json.dumps(redact(results), indent=2, default=jsonable,
                                                          ensure_ascii=False) + "\n")


def read_results(path: str | Path, key: str = "--compare") -> dict[str, Any]:
    file = Path(path)
    if file.is_dir():
        file = file / RESULTS_FILE
    if not file.is_file():
        raise UserError(f"{key}: {file} does not exist")
    results = read_json(file, key)
    if not isinstance(results, dict) or not isinstance(results.get("results"), dict):
        raise UserError(f"{key}: {file} has no 'results'; give a results.json written by `eval`")
    return results


def scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {"metric,filter": value}} without the standard errors, as the harness keys them."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results["results"].items():
        out[task] = {key: float(value) for key, value in metrics.items()
                     if key not in NOT_SCORES and "_stderr," not in key and isinstance(value, (int, float))}
    return out


def tracker_metrics(results: dict[str, Any]) -> dict[str, float]:
    """The scores as flat tracker keys: `harness/<task>/<metric>`, plus `/<filter>` unless the filter is 'none'."""
    flat = {}
    for task, metrics in scores(results).items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            suffix = "" if filter_name in ("", "none") else f"/{filter_name}"
            flat[f"harness/{task}/{metric}{suffix}"] = value
    return flat


def results_table(results: dict[str, Any]) -> str:
    """The harness's own table (what its command prints): tasks, then groups when there are any."""
    from lm_eval.utils import make_table

    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table


def shown(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if math.isfinite(value) and abs(value) < 1e6 else f"{value:.6g}"


def comparison_table(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Every score of either run, before and after, with the difference (after - before) where both have it."""
    old, new = scores(before), scores(after)
    rows = []
    for task in sorted(old.keys() | new.keys()):
        for key in sorted(old.get(task, {}).keys() | new.get(task, {}).keys()):
            a, b = old.get(task, {}).get(key), new.get(task, {}).get(key)
            diff = f"{b - a:+.4f}" if a is not None and b is not None else "-"
            rows.append([task, key.replace(",", " "), shown(a), shown(b), diff])
    return text_table(["task", "metric", "before", "after", "difference"], rows)


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = [headers, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)
