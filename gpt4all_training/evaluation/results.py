"""The results of an evaluation: written as results.json, read back, shown as tables with 95% intervals, compared
with another run item by item.

Besides the harness's results, results.json keeps `per_example`: {task: {"metric,filter": {item: value}}} for every
score that is the mean of its examples' values (acc, acc_norm, exact_match; not perplexity, which the harness
aggregates otherwise), an item being the harness's document id and document hash. They give each score its interval
(intervals.py: Wilson for 0/1 values) and pair two runs on the items both scored.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gpt4all_training.config.secrets import redact
from gpt4all_training.errors import UserError
from gpt4all_training.intervals import Comparison, Interval, mean, paired
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


def per_example(samples: dict[str, list[dict[str, Any]]], results: dict[str, Any]) -> dict[str, dict[str, dict]]:
    """{task: {"metric,filter": {item: value}}} from the harness's logged samples, for the scores that are the mean of
    their examples' values; an item is "doc_id:doc_hash", so two runs pair only on the same document."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for task, examples in samples.items():
        table: dict[str, dict[str, Any]] = {}
        for example in examples:
            item = f"{example['doc_id']}:{example['doc_hash']}"
            for metric in example["metrics"]:
                value = example[metric]
                # NumPy numbers as Python ones, as jsonable writes them.
                table.setdefault(f"{metric},{example['filter']}", {})[item] = value.item() if hasattr(
                    value, "item") and callable(value.item) else value
        reported = results.get(task, {})
        kept = {key: {item: float(v) for item, v in values.items()} for key, values in table.items()
                if all(isinstance(v, (bool, int, float)) for v in values.values())}
        kept = {key: values for key, values in kept.items() if isinstance(reported.get(key), (int, float))
                and math.isclose(sum(values.values()) / len(values), reported[key], rel_tol=1e-9, abs_tol=1e-12)}
        if kept:
            out[task] = kept
    return out


def interval_of(results: dict[str, Any], task: str, key: str) -> Interval | None:
    """The 95% interval of a score from its examples' values, or None where results.json has none for it."""
    values = results.get("per_example", {}).get(task, {}).get(key)
    return mean(list(values.values())) if values else None


def stderr_of(results: dict[str, Any], task: str, key: str) -> float | None:
    """The harness's standard error of a score, where it gives a number."""
    metric, _, filter_name = key.partition(",")
    value = results["results"].get(task, {}).get(f"{metric}_stderr,{filter_name}")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def higher_is_better(results: dict[str, Any], task: str, key: str) -> bool:
    return bool(results.get("higher_is_better", {}).get(task, {}).get(key.partition(",")[0], True))


def comparison_of(before: dict[str, Any], after: dict[str, Any], task: str, key: str) -> Comparison | None:
    """after - before on the items both runs scored, with its interval and verdict; None where either run lacks the
    examples' values or they share no item."""
    old = before.get("per_example", {}).get(task, {}).get(key)
    new = after.get("per_example", {}).get(task, {}).get(key)
    common = sorted(old.keys() & new.keys()) if old and new else []
    if not common:
        return None
    return paired([old[i] for i in common], [new[i] for i in common], higher_is_better(after, task, key))


def report_rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(score, value [95% interval], over what) of each score, as the training report lists them."""
    rows = []
    for task, metrics in sorted(scores(results).items()):
        for key, value in sorted(metrics.items()):
            interval = interval_of(results, task, key)
            rows.append((f"harness/{task}/{key.replace(',none', '').replace(',', '/')}",
                         interval.number() if interval else shown(value),
                         f"{interval.n} examples" if interval else "no interval: not a mean over examples"))
    return rows


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


def with_interval(value: float | None, interval: Interval | None) -> str:
    return interval.number() if interval is not None else shown(value)


def interval_table(results: dict[str, Any]) -> str:
    """Every score with its 95% interval, the number of examples it is over and the harness's standard error."""
    rows = []
    for task, metrics in sorted(scores(results).items()):
        for key, value in sorted(metrics.items()):
            interval = interval_of(results, task, key)
            rows.append([task, key.replace(",", " "), with_interval(value, interval),
                         str(interval.n) if interval else "-", shown(stderr_of(results, task, key))])
    return text_table(["task", "metric", "score [95% interval]", "n", "stderr"], rows)


def comparison_rows(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task and metric of either run: each run's score and interval, and the paired difference (after -
    before on the same items) with its interval and verdict, where both runs kept the examples' values."""
    old, new = scores(before), scores(after)
    rows = []
    for task in sorted(old.keys() | new.keys()):
        for key in sorted(old.get(task, {}).keys() | new.get(task, {}).keys()):
            a, b = old.get(task, {}).get(key), new.get(task, {}).get(key)
            rows.append({"task": task, "metric": key, "before": a, "after": b,
                         "before_interval": interval_of(before, task, key),
                         "after_interval": interval_of(after, task, key),
                         "change": b - a if a is not None and b is not None else None,
                         "paired": comparison_of(before, after, task, key)})
    return rows


def comparison_table(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Every score of either run, before and after with its 95% interval, and the difference (after - before): paired
    on the same items with its interval and verdict where both runs kept the examples' values, else bare."""
    lines = []
    for row in comparison_rows(before, after):
        change = row["paired"].number() if row["paired"] else (
            f"{row['change']:+.4f}" if row["change"] is not None else "-")
        lines.append([row["task"], row["metric"].replace(",", " "), with_interval(row["before"],
                      row["before_interval"]), with_interval(row["after"], row["after_interval"]), change])
    return text_table(["task", "metric", "before [95% interval]", "after [95% interval]",
                       "difference [95% interval]: verdict"], lines)


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = [headers, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)
