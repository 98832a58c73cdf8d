"""Near-duplicate records for `clean --near-duplicates THRESHOLD`: a record whose text is nearly that of a record kept
before it (estimated Jaccard similarity of their word 3-grams at least THRESHOLD) is dropped as `near_duplicate`.

Found without comparing all pairs: each kept record's MinHash signature goes into a locality-sensitive hashing index
(datasketch's MinHashLSH), which returns the kept records that share a band of the signature with a new one; of those,
the record is a near-duplicate of one whose signatures agree on at least THRESHOLD of their values (the MinHash
estimate of the Jaccard similarity). A pair above the threshold can be missed only when no band matches, which the
index's band layout (datasketch's, for this threshold) makes rare; a pair below it is never dropped. Memory grows with
the kept records (their signatures and the index's buckets, a few hundred bytes each), not with their text.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NUM_PERM = 64  # signature length: the estimate's standard error is about 0.06 at similarity 0.5, 0.04 at 0.9
SHINGLE = 3  # words per shingle
SEED = 1


def record_text(record: dict[str, Any]) -> str:
    """The text two records are compared by: a conversation's messages, a preference pair's prompt and chosen
    answer, a prompt record's prompt, or a prompt and its response."""
    def text(value: Any) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return "\n".join(text(item) for item in value)
        if isinstance(value, dict):
            return text(value.get("content") or "")
        return ""

    if record.get("messages") is not None:
        return text(record["messages"])
    if record.get("chosen") is not None:
        return text(record["prompt"]) + "\n" + text(record["chosen"])
    return text(record.get("prompt")) + "\n" + text(record.get("response"))


def shingles(text: str) -> list[bytes]:
    """The text's lower-cased word 3-grams (the whole text as one when it has fewer words)."""
    words = text.lower().split()
    if len(words) <= SHINGLE:
        return [" ".join(words).encode("utf-8", "surrogatepass")]
    return [" ".join(words[i:i + SHINGLE]).encode("utf-8", "surrogatepass")
            for i in range(len(words) - SHINGLE + 1)]


class NearDuplicates:
    """The kept records' signatures and their index; `first_of_its_kind` asks about one record and keeps it when it
    is not a near-duplicate."""

    def __init__(self, threshold: float) -> None:
        from datasketch import MinHash, MinHashLSH

        self.threshold = threshold
        self.index = MinHashLSH(threshold=threshold, num_perm=NUM_PERM)
        self.empty = MinHash(num_perm=NUM_PERM, seed=SEED)  # its permutations, computed once, copied per record
        self.signatures = np.zeros((1024, NUM_PERM), dtype=np.uint32)  # MinHash values are below 2**32
        self.count = 0

    def first_of_its_kind(self, record: dict[str, Any]) -> bool:
        signature = self.empty.copy()
        signature.update_batch(shingles(record_text(record)))
        values = signature.hashvalues.astype(np.uint32)
        candidates = self.index.query(signature)
        if candidates and np.max(np.mean(self.signatures[candidates] == values, axis=1)) >= self.threshold:
            return False
        if self.count == len(self.signatures):
            self.signatures = np.concatenate([self.signatures, np.zeros_like(self.signatures)])
        self.signatures[self.count] = values
        self.index.insert(self.count, signature)
        self.count += 1
        return True
