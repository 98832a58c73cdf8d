"""The curation rules as pure functions of arrays: which rows each one drops.

Rows are in dataset order (by record index) throughout, so "earlier" means earlier in the dataset.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from gpt4all_training.errors import UserError

PARTITION_SIZE = 1000  # rows per k-means partition on average: a partition's similarities fit in a few MB
BLOCK_ROWS = 2048  # rows of a partition compared at once, so an oversized partition still fits in memory
HISTOGRAM_EDGES = (-1.0, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 1.0)


def exact_duplicates(prompts: list[str], responses: list[str], candidates: np.ndarray) -> np.ndarray:
    """For each candidate row, the earlier candidate row with the same prompt and response (whitespace runs
    collapsed), or -1."""
    first: dict[tuple[str, str], int] = {}
    duplicate_of = np.full(len(prompts), -1, dtype=np.int64)
    for row in np.flatnonzero(candidates):
        key = (" ".join((prompts[row] or "").split()), " ".join((responses[row] or "").split()))
        if key in first:
            duplicate_of[row] = first[key]
        else:
            first[key] = int(row)
    return duplicate_of


@dataclass
class NearDuplicates:
    duplicate_of: np.ndarray  # the earlier kept row each dropped row is a near-duplicate of, else -1
    similarity: np.ndarray  # that row's cosine similarity to it (NaN when kept)
    nearest: np.ndarray  # each candidate's highest similarity to another row of its partition (NaN elsewhere)
    partitions: int


def partition(embeddings: np.ndarray, seed: int) -> np.ndarray:
    """k-means labels with about PARTITION_SIZE rows per partition (one partition for small inputs)."""
    from sklearn.cluster import KMeans

    k = math.ceil(len(embeddings) / PARTITION_SIZE)
    if k <= 1:
        return np.zeros(len(embeddings), dtype=np.int64)
    return KMeans(n_clusters=k, random_state=seed, n_init=1).fit_predict(embeddings).astype(np.int64)


def near_duplicates(sides: Sequence[np.ndarray], candidates: np.ndarray, threshold: float, seed: int
                    ) -> NearDuplicates:
    """SemDeDup: within each k-means partition of the candidate rows, a row whose similarity to an earlier kept row
    reaches `threshold` is dropped as a duplicate of the most similar one. `sides` are unit-length embeddings of the
    rows (a prompt's and a response's, say); two rows are as similar as their least similar side."""
    from tqdm.auto import tqdm

    n = len(sides[0])
    rows = np.flatnonzero(candidates)
    result = NearDuplicates(np.full(n, -1, dtype=np.int64), np.full(n, np.nan), np.full(n, np.nan), 0)
    if len(rows) < 2:
        return result
    labels = partition(np.concatenate([side[rows] for side in sides], axis=1), seed)
    result.partitions = int(labels.max()) + 1
    for p in tqdm(range(result.partitions), desc="near-duplicates", unit="partition", mininterval=1.0):
        members = rows[labels == p]  # ascending: dataset order
        if len(members) < 2:
            continue
        vectors = [side[members] for side in sides]
        pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for start in range(0, len(members), BLOCK_ROWS):
            block = np.minimum.reduce([v[start:start + BLOCK_ROWS] @ v.T for v in vectors])
            own = np.arange(start, start + len(block))
            block[own - start, own] = -np.inf  # a row is not its own duplicate
            result.nearest[members[own]] = block.max(axis=1)
            i, j = np.nonzero(block >= threshold)
            pairs.append((i + start, j, block[i, j]))
        i, j, s = (np.concatenate(parts) for parts in zip(*pairs))
        earlier = j < i
        i, j, s = i[earlier], j[earlier], s[earlier]
        # Greedy in dataset order: a row is dropped only for a kept row, so every group keeps its first member.
        order = np.lexsort((-s, i))
        kept = np.ones(len(members), dtype=bool)
        for a, b, sim in zip(i[order], j[order], s[order]):
            if kept[a] and kept[b]:
                kept[a] = False
                result.duplicate_of[members[a]] = members[b]
                result.similarity[members[a]] = sim
    return result


def similarity_summary(nearest: np.ndarray) -> dict:
    """The distribution a threshold is chosen on: each record's highest similarity to another record of its
    partition, as quantiles and a histogram."""
    values = nearest[np.isfinite(nearest)]
    if values.size == 0:
        return {"records": 0}
    counts, _ = np.histogram(np.clip(values, -1.0, 1.0), bins=HISTOGRAM_EDGES)
    return {"records": int(values.size),
            "quantiles": {q: round(float(np.quantile(values, float(q))), 4)
                          for q in ("0.5", "0.9", "0.95", "0.99", "1.0")},
            "histogram": [{"from": low, "to": high, "records": int(c)}
                          for low, high, c in zip(HISTOGRAM_EDGES, HISTOGRAM_EDGES[1:], counts)]}


def loss_threshold(loss: np.ndarray, quantile: float) -> float:
    return float(np.quantile(loss[np.isfinite(loss)], quantile))


# ---------------------------------------------------------------- rules on any score: --drop "COLUMN>VALUE"

OPERATORS = {">": np.greater, ">=": np.greater_equal, "<": np.less, "<=": np.less_equal}
CONDITION = re.compile(r"\s*(?P<column>[A-Za-z_][\w.]*)\s*(?P<op>>=|<=|>|<)\s*(?P<quantile>[qQ])?"
                       r"(?P<value>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*")
RULE_EXAMPLES = ("write e.g. 'ifd>q0.9' (above the run's 0.9 quantile of ifd), 'loss_change<-1' or "
                 "'agreement<1&loss>q0.8' (both at once), with >, >=, < or <=")


@dataclass(frozen=True)
class Condition:
    """`column OP value`, the value a number or, with `quantile`, that quantile of the column's values."""
    column: str
    op: str
    value: float
    quantile: bool

    @property
    def text(self) -> str:
        return f"{self.column}{self.op}{'q' if self.quantile else ''}{self.value:g}"


def parse_rule(text: str, flag: str = "--drop") -> list[Condition]:
    """A rule's conditions, all of which a record must meet to be dropped: COLUMN OP [q]VALUE, joined by '&'."""
    conditions = []
    for part in text.split("&"):
        match = CONDITION.fullmatch(part)
        if match is None:
            raise UserError(f"{flag} {text!r}: {part.strip()!r} is not COLUMN OP VALUE; {RULE_EXAMPLES}")
        condition = Condition(match["column"], match["op"], float(match["value"]), match["quantile"] is not None)
        if condition.quantile and not 0.0 < condition.value < 1.0:
            raise UserError(f"{flag} {text!r}: q{match['value']} is not a quantile; give one between 0 and 1, e.g. "
                            f"q0.9")
        conditions.append(condition)
    return conditions


def rule_text(conditions: Sequence[Condition]) -> str:
    """The rule written one way (no spaces, 'q' for a quantile): its name in the report and the removed list."""
    return "&".join(condition.text for condition in conditions)


def condition_threshold(values: np.ndarray, condition: Condition) -> float:
    """The value a condition compares with: its number, or its quantile of the finite values."""
    return float(np.quantile(values[np.isfinite(values)], condition.value)) if condition.quantile else condition.value


def rule_mask(columns: dict[str, np.ndarray], conditions: Sequence[Condition], thresholds: Sequence[float]
              ) -> np.ndarray:
    """The rows that meet every condition; a missing value (NaN) meets none."""
    masks = [OPERATORS[c.op](columns[c.column], t) for c, t in zip(conditions, thresholds)]
    return np.logical_and.reduce(masks)


def precision_recall(selected: np.ndarray, bad: np.ndarray) -> tuple[int, Optional[float], Optional[float]]:
    """(known-bad rows selected, their share of the selected rows, their share of the known-bad rows); a share of
    nothing is None."""
    hits = int((selected & bad).sum())
    precision = round(hits / int(selected.sum()), 4) if selected.any() else None
    recall = round(hits / int(bad.sum()), 4) if bad.any() else None
    return hits, precision, recall
