"""curate: an inference run to a new dataset, `DIR/<name>_clean.jsonl` (the record fields clean.py wrote, ready for
`dataset_path: DIR`), with `DIR/curate_report.json` (what was read, kept and dropped, by reason, cluster and source,
and, given the known-bad records, the precision and recall of each rule and of the whole) and
`DIR/curate_removed.jsonl` (every dropped record's index, reason, the scores its rule read and, for a duplicate, the
record it repeats). Every file is written to a temporary name and renamed, so a crash never leaves a half-written
dataset."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from gpt4all_training.analysis.curation.embeddings import EMBEDDERS, record_embeddings, unit_rows
from gpt4all_training.analysis.curation.rules import (Condition, condition_threshold, exact_duplicates, loss_threshold,
                                                      near_duplicates, parse_rule, precision_recall, rule_mask,
                                                      rule_text, similarity_summary)
from gpt4all_training.analysis.inference import OUTPUT_COLUMNS, SCORE_COLUMNS
from gpt4all_training.analysis.map.clusters import named_clusters
from gpt4all_training.analysis.map.layout import embedding_features
from gpt4all_training.analysis.map.runs import Run, load_run
from gpt4all_training.data.clean import dataset_row_record
from gpt4all_training.errors import UserError, shown
from gpt4all_training.files import atomic_write
from gpt4all_training.readers import parse_json, read_text

REPORT_FILE = "curate_report.json"
REMOVED_FILE = "curate_removed.jsonl"
EXAMPLES = 3  # example prompts per cluster and per source in the report
EXAMPLE_CHARS = 160
INTEGER = re.compile(r"\d+")
MAX_ID = 2**63 - 1  # an index is an int64


@dataclass
class CurateOptions:
    near_duplicates: Optional[float] = None  # cosine similarity threshold
    embedder: str = "minilm"
    loss_above: Optional[float] = None  # quantile
    loss_below: Optional[float] = None
    include_ids: Optional[str] = None  # files
    exclude_ids: Optional[str] = None
    name: str = "curated"
    seed: int = 0
    drop: list[str] = field(default_factory=list)  # rules on any numeric column: "ifd>q0.9", "a<1&b>q0.8"
    label_column: Optional[str] = None  # a column marking the known-bad records, to score the rules against
    label_ids: Optional[str] = None  # or a file of their ids


def read_ids(path: str, flag: str) -> np.ndarray:
    """Example ids (records' `index`) from the map's download (`{"ids": [...]}`), a JSON list, or integers separated
    by white space or commas."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{flag} {file}: no such file")
    text = read_text(file, flag)
    if text.lstrip().startswith(("[", "{")):
        data = parse_json(text, f"{flag} {file}")
    else:
        data = text.replace(",", " ").split()
    if isinstance(data, dict):
        data = data.get("ids")
    if not isinstance(data, list):
        raise UserError(f'{flag} {file}: expected the map\'s selection file ({{"ids": [...]}}), a JSON list of ids, '
                        f"or one id per line")
    ids = [as_id(v) for v in data]
    if None in ids:
        bad = data[ids.index(None)]
        whole = type(bad) is int or isinstance(bad, str) and INTEGER.fullmatch(bad.lstrip("-"))
        kind = "from 0 to 2^63 - 1" if whole else "whole numbers"
        raise UserError(f"{flag} {file}: ids are the records' index, {kind}; got {shown(bad)}")
    return np.array(ids, dtype=np.int64)


def as_id(value: Any) -> Optional[int]:
    """`value` as a record index (an int64 from 0), or None."""
    if type(value) is int:
        number = value
    elif isinstance(value, str) and INTEGER.fullmatch(value) and len(value) <= len(str(MAX_ID)):
        number = int(value)
    else:
        return None
    return number if 0 <= number <= MAX_ID else None


def check_ids(ids: np.ndarray, index: np.ndarray, flag: str, path: str, run_path: Path) -> None:
    unknown = np.setdiff1d(ids, index)
    if unknown.size:
        raise UserError(f"{flag} {path}: {unknown.size} ids are not examples of {run_path} (e.g. {unknown[0]}); "
                        f"was the selection made on a map of another dataset?")


def check_quantile(value: Optional[float], flag: str) -> None:
    if value is not None and not 0.0 < value < 1.0:
        raise UserError(f"{flag}: a quantile between 0 and 1 (e.g. 0.95), got {value}")


def check_options(options: CurateOptions) -> None:
    if not any((options.near_duplicates is not None, options.loss_above is not None,
                options.loss_below is not None, options.include_ids, options.exclude_ids, options.drop)):
        raise UserError("curate: no rule given; pass --drop, --near-duplicates, --loss-above, --loss-below, "
                        "--include-ids or --exclude-ids")
    texts = [rule_text(parse_rule(text)) for text in options.drop]
    twice = next((text for k, text in enumerate(texts) if text in texts[:k]), None)
    if twice is not None:
        raise UserError(f"--drop {twice!r}: given twice; give each rule once")
    if options.label_column and options.label_ids:
        raise UserError("--label-column and --label-ids both mark the known-bad records; give one")
    check_quantile(options.loss_above, "--loss-above")
    check_quantile(options.loss_below, "--loss-below")
    if options.loss_above is not None and options.loss_below is not None and options.loss_below >= options.loss_above:
        raise UserError(f"--loss-below {options.loss_below} must be below --loss-above {options.loss_above}, or "
                        f"every record would be dropped")
    if options.near_duplicates is not None and not 0.0 < options.near_duplicates <= 1.0:
        raise UserError(f"--near-duplicates: a cosine similarity in (0, 1], e.g. 0.9; got {options.near_duplicates}")
    if options.embedder not in EMBEDDERS:
        raise UserError(f"--embedder {options.embedder!r}: one of {', '.join(EMBEDDERS)}")
    if not re.fullmatch(r"[\w.-]+", options.name):
        raise UserError(f"--name {options.name!r}: letters, digits, '.', '-' and '_' only (it names a file)")


def clipped(text: Optional[str]) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS - 1] + "\u2026"


def removed_by(groups: np.ndarray, reason: np.ndarray, prompts: list[str], key: str,
               labels: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """Per group (cluster or source) with a removed record: its size, what was removed and why, a few prompts."""
    out = []
    for group in sorted(set(groups[reason != ""].tolist())):
        members = groups == group
        removed = np.flatnonzero(members & (reason != ""))
        entry: dict[str, Any] = {key: group}
        if labels is not None:
            entry["label"] = labels[group]
        entry.update(size=int(members.sum()), removed=len(removed),
                     by_reason=dict(Counter(reason[removed].tolist()).most_common()),
                     examples=[clipped(prompts[i]) for i in removed[:EXAMPLES]])
        out.append(entry)
    return sorted(out, key=lambda e: (-e["removed"], e[key]))


@dataclass
class Rows:
    """An inference run's rows in dataset order (by record index): "earlier" in the duplicate rules, and the order
    of the written records. `order[k]` is row k's position in inference.parquet."""
    order: np.ndarray
    index: np.ndarray
    split: np.ndarray
    loss: np.ndarray
    source: np.ndarray
    prompts: list[str]
    responses: list[str]
    embeddings: np.ndarray
    numeric: dict[str, np.ndarray]  # Run.numeric: what --drop rules read

    @classmethod
    def of(cls, run: Run) -> Rows:
        order = np.argsort(run.index, kind="stable")
        if len(np.unique(run.index)) != len(run.index):
            raise UserError(f"{run.path}: the index column repeats values; is this one inference.py output?")
        prompts, responses = run.prompt.to_pylist(), run.response.to_pylist()
        return cls(order, run.index[order], run.split[order], run.loss[order], run.source[order],
                   [prompts[i] for i in order], [responses[i] for i in order], run.embeddings[order],
                   {name: values[order] for name, values in run.numeric.items()})


@dataclass
class Decisions:
    """Per row: why it was dropped ("" when kept) and, for a duplicate, the row it repeats and how closely; per
    reason, in the order the rules ran, the rows its rule found on its own (those an earlier rule dropped too)."""
    reason: np.ndarray
    duplicate_of: np.ndarray
    similarity: np.ndarray
    rules: dict[str, Any] = field(default_factory=dict)
    matched: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def none(cls, n: int) -> Decisions:
        return cls(np.full(n, "", dtype=object), np.full(n, -1, dtype=np.int64), np.full(n, np.nan))

    @property
    def kept(self) -> np.ndarray:
        return self.reason == ""

    def drop(self, mask: np.ndarray, why: str) -> None:
        """Rows of `mask` still kept are dropped for `why`; one dropped earlier keeps its first reason."""
        self.matched[why] = mask
        self.reason[mask & self.kept] = why


def apply_rules(rows: Rows, options: CurateOptions, run_path: Path) -> Decisions:
    decisions = Decisions.none(len(rows.index))
    for flag, ids_file, reason in (("--include-ids", options.include_ids, "not_included"),
                                   ("--exclude-ids", options.exclude_ids, "excluded")):
        if ids_file:
            ids = read_ids(ids_file, flag)
            check_ids(ids, rows.index, flag, ids_file, run_path)
            listed = np.isin(rows.index, ids)
            decisions.drop(~listed if reason == "not_included" else listed, reason)
            decisions.rules[flag[2:].replace("-", "_")] = {"file": ids_file, "ids": int(np.unique(ids).size)}
    for key, quantile in (("loss_above", options.loss_above), ("loss_below", options.loss_below)):
        if quantile is not None:
            if not np.isfinite(rows.loss).any():
                raise UserError(f"{run_path}: no example has a finite loss; the loss rules have nothing to rank")
            threshold = loss_threshold(rows.loss, quantile)
            outside = rows.loss > threshold if key == "loss_above" else rows.loss < threshold
            decisions.drop(outside, "high_loss" if key == "loss_above" else "low_loss")
            decisions.rules[key] = {"quantile": quantile, "loss": round(threshold, 4)}
    for text in options.drop:
        drop_by_rule(rows, decisions, parse_rule(text), text, run_path)
    if options.near_duplicates is not None:
        drop_duplicates(rows, decisions, options)
    return decisions


def drop_by_rule(rows: Rows, decisions: Decisions, conditions: list[Condition], given: str, run_path: Path) -> None:
    """One --drop rule: the rows meeting all its conditions, thresholds taken over every row read."""
    for condition in conditions:
        values = rows.numeric.get(condition.column)
        if values is None:
            how = (f"run inference with {SCORE_COLUMNS[condition.column]} to write it"
                   if condition.column in SCORE_COLUMNS else f"it has {', '.join(rows.numeric)}")
            raise UserError(f"--drop {given!r}: {run_path} has no numeric column {condition.column!r}; {how}")
        if not np.isfinite(values).any():
            raise UserError(f"--drop {given!r}: column {condition.column!r} of {run_path} has no value (every one is "
                            f"missing), so the rule has nothing to compare")
    thresholds = [condition_threshold(rows.numeric[c.column], c) for c in conditions]
    text = rule_text(conditions)
    decisions.drop(rule_mask(rows.numeric, conditions, thresholds), text)
    decisions.rules.setdefault("drop", []).append({
        "rule": text,
        "conditions": [{"column": c.column, "op": c.op, **({"quantile": c.value} if c.quantile else {}),
                        "threshold": round(t, 6)} for c, t in zip(conditions, thresholds)]})


def known_bad(rows: Rows, options: CurateOptions, run_path: Path) -> Optional[tuple[str, np.ndarray]]:
    """(what marks them, the known-bad rows) from --label-column or --label-ids, or None."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if options.label_ids:
        ids = read_ids(options.label_ids, "--label-ids")
        check_ids(ids, rows.index, "--label-ids", options.label_ids, run_path)
        return f"ids {options.label_ids}", np.isin(rows.index, ids)
    if not options.label_column:
        return None
    name = options.label_column
    if name not in pq.read_schema(run_path).names:
        raise UserError(f"--label-column {name}: {run_path} has no such column; the records' own fields are its "
                        f"columns (clean.py keeps only its own fields: mark the records in the data inference reads, "
                        f"or give their ids with --label-ids)")
    column = pq.read_table(run_path, columns=[name]).column(name)
    if not (pa.types.is_boolean(column.type) or pa.types.is_integer(column.type)
            or pa.types.is_floating(column.type)):
        raise UserError(f"--label-column {name}: holds {column.type}; give a column of true/false (or 1/0) that is "
                        f"true for the known-bad records")
    values = column.cast(pa.float64()).to_numpy(zero_copy_only=False)[rows.order]
    return f"column {name}", np.nan_to_num(values) != 0  # a missing label is not a known-bad one


def label_report(decisions: Decisions, source: str, bad: np.ndarray) -> dict[str, Any]:
    """How well what was dropped, and what each rule found on its own, matches the known-bad records."""
    dropped = ~decisions.kept
    hits, precision, recall = precision_recall(dropped, bad)
    by_rule = {}
    for reason, found in decisions.matched.items():
        rule_hits, rule_precision, rule_recall = precision_recall(found, bad)
        by_rule[reason] = {"matched": int(found.sum()), "matched_bad": rule_hits, "precision": rule_precision,
                           "recall": rule_recall}
    return {"from": source, "bad": int(bad.sum()), "dropped": int(dropped.sum()), "dropped_bad": hits,
            "precision": precision, "recall": recall, "by_rule": by_rule}


def drop_duplicates(rows: Rows, decisions: Decisions, options: CurateOptions) -> None:
    """Exact duplicates, then near-duplicates among what is left."""
    assert options.near_duplicates is not None  # asked for only then
    exact = exact_duplicates(rows.prompts, rows.responses, decisions.kept)
    decisions.drop(exact >= 0, "exact_duplicate")
    decisions.duplicate_of[exact >= 0] = exact[exact >= 0]
    candidates = decisions.kept
    if options.embedder == "minilm":
        where = np.flatnonzero(candidates)
        sides = []
        for found in record_embeddings([rows.prompts[i] for i in where], [rows.responses[i] for i in where]):
            side = np.zeros((len(rows.index), found.shape[1]), dtype=np.float32)
            side[where] = found
            sides.append(side)
    else:
        # centred first: the direction every hidden state shares says nothing about a pair
        sides = [unit_rows(rows.embeddings - rows.embeddings.mean(axis=0))]
    near = near_duplicates(sides, candidates, options.near_duplicates, options.seed)
    found = near.duplicate_of >= 0
    decisions.drop(found, "near_duplicate")
    decisions.duplicate_of[found], decisions.similarity[found] = near.duplicate_of[found], near.similarity[found]
    decisions.rules["near_duplicates"] = {"threshold": options.near_duplicates, "embedder": options.embedder,
                                          "partitions": near.partitions,
                                          "nearest_similarity": similarity_summary(near.nearest)}


def removed_lines(rows: Rows, decisions: Decisions, bad: Optional[np.ndarray]) -> Iterable[str]:
    """Each dropped row: its index, split and reason, its loss and the columns the --drop rules read, the row it
    repeats, and whether it is a known-bad one (given them)."""
    read = list(dict.fromkeys(c["column"] for rule in decisions.rules.get("drop", []) for c in rule["conditions"]))
    for row in np.flatnonzero(~decisions.kept):
        entry: dict[str, Any] = {"index": int(rows.index[row]), "split": rows.split[row],
                                 "reason": decisions.reason[row]}
        for name, values in (("loss", rows.loss), *((c, rows.numeric[c]) for c in read if c != "loss")):
            entry[name] = round(float(values[row]), 4) if np.isfinite(values[row]) else None
        if bad is not None:
            entry["bad"] = bool(bad[row])
        if decisions.duplicate_of[row] >= 0:
            entry["duplicate_of"] = int(rows.index[decisions.duplicate_of[row]])
        if np.isfinite(decisions.similarity[row]):
            entry["similarity"] = round(float(decisions.similarity[row]), 4)
        entry["prompt"] = clipped(rows.prompts[row])
        yield json.dumps(entry, ensure_ascii=False)


def curate(input_path: str | Path, output_dir: str | Path, options: CurateOptions) -> dict[str, Any]:
    """Apply the rules (see the package docstring), write the dataset, the removed list and the report; returns
    the report."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_options(options)
    run = load_run(input_path)
    rows = Rows.of(run)
    labelled = known_bad(rows, options, run.path)
    decisions = apply_rules(rows, options, run.path)
    kept = decisions.kept

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    table = pq.read_table(run.path)
    # The record's own fields; inference.py's columns are not part of a record. Read through datasets, which decodes
    # what it stored as JSON text (messages whose keys differ from turn to turn) back into the record's values.
    record_columns = [c for c in table.column_names if c not in OUTPUT_COLUMNS]
    records = datasets.Dataset(table.select(record_columns).take(pa.array(rows.order[kept])))
    lines = (json.dumps(dataset_row_record(r, s), ensure_ascii=False) for r, s in zip(records, rows.source[kept]))
    dataset = output_dir / f"{options.name}_clean.jsonl"
    atomic_write(dataset, (line + "\n" for line in lines))
    bad = labelled[1] if labelled else None
    atomic_write(output_dir / REMOVED_FILE, (line + "\n" for line in removed_lines(rows, decisions, bad)))

    clusters, words = named_clusters(embedding_features(run.embeddings, options.seed), run, seed=options.seed)
    counts = Counter(decisions.reason[~kept].tolist())
    for rule in decisions.rules.get("drop", []):
        rule.update(matched=int(decisions.matched[rule["rule"]].sum()), dropped=counts[rule["rule"]])
    report = {
        "input": str(run.path), "output": str(dataset), "read": len(rows.index), "kept": int(kept.sum()),
        "dropped": {r: counts[r] for r in decisions.matched if counts[r]}, "dropped_total": int((~kept).sum()),
        "rules": decisions.rules,
        **({"label": label_report(decisions, *labelled)} if labelled else {}),
        # Numbered as on the map of this run built with the same --seed and the default --clusters.
        "removed_by_cluster": removed_by(clusters[rows.order], decisions.reason, rows.prompts, "cluster", words),
        "removed_by_source": removed_by(rows.source, decisions.reason, rows.prompts, "source"),
    }
    atomic_write(output_dir / REPORT_FILE, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return report
