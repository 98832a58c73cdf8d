"""The per-example scores inference writes besides loss and embedding, as pure functions and the passes that compute
them. Every score is a column of inference.parquet that the map can colour by and `curate --drop` can rule on.

- `response_loss` and `ifd`: IFD, Instruction-Following Difficulty (Li et al. 2023, "From Quantity to Quality"), is
  the loss of the response given its prompt (`loss`) over the loss of the response alone (`response_loss`): near 1,
  the prompt hardly helps to predict the answer (an answer unrelated to its question, or one the model knows
  regardless); low, the prompt decides the answer. The response alone is exactly the tokens `loss` averages over
  (every trained token, every trained turn of a conversation, in order), after one start token (the tokenizer's BOS,
  or its EOS, which starts a document where there is no BOS), so both losses predict the same tokens.
- `proxy_ifd`: the same ratio under a small proxy model (Superfiltering, Li et al. 2024), on the records tokenized by
  the proxy's own tokenizer; NaN for a record the proxy's tokens leave nothing to train on.
- `base_loss`, `loss_change`: the same tokens' loss under the model that was fine-tuned, and loss - base_loss.
- `model_answer`, `agreement`: the model's greedy answer to the record's prompt (every token before the last trained
  run of tokens, i.e. the conversation up to its last trained assistant turn), decoded by model/decoding.py, and a
  checker's score of it against the record (a grpo reward's signature: training/objectives/grpo/rewards.py).
- `verified`: a verifier's score of the record's own response, called as a checker is but with that response as the
  completion: no model involved. Where the right answer can be computed from the prompt (a solver, a unit test, a
  reference field), it finds wrong labels however weak the model is.
- `outlier`: scikit-learn's Local Outlier Factor of each embedding's PCA features (the map's), about 1 for an
  example as dense as its neighbours, higher the more isolated it is.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from gpt4all_training.analysis.map.layout import embedding_features
from gpt4all_training.batch import IGNORE
from gpt4all_training.errors import UserError
from gpt4all_training.model.decoding import Sequence, decode_all
from gpt4all_training.training.objectives.grpo.rewards import (Reward, builtin_reward, check_user_reward,
                                                               load_user_reward, score)

OUTLIER_NEIGHBORS = 20  # scikit-learn's default; fewer for smaller runs
Row = dict[str, list[int]]


# ---------------------------------------------------------------- per-example maths (pure)

def response_only(row: Row, start_id: int) -> Row:
    """The trained tokens of `row` alone, after `start_id`, every one of them trained: IFD's denominator."""
    trained = [token for token, label in zip(row["input_ids"], row["labels"]) if label != IGNORE]
    return {"input_ids": [start_id, *trained], "labels": [IGNORE, *trained]}


def start_token(tokenizer) -> int:
    """The token a text starts after: BOS, or EOS where the tokenizer has no BOS (GPT-2's documents start so)."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def last_turn_start(labels: list[int]) -> int:
    """The first position of the last run of trained labels: the model answers from every token before it."""
    end = len(labels)
    while end > 0 and labels[end - 1] == IGNORE:
        end -= 1
    start = end
    while start > 1 and labels[start - 1] != IGNORE:
        start -= 1
    return start


def ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, NaN where either is missing or the denominator is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.asarray(numerator, dtype=np.float64) / np.asarray(denominator, dtype=np.float64)
    out[~np.isfinite(out)] = np.nan
    return out


def outlier_scores(embeddings: np.ndarray, seed: int) -> np.ndarray:
    """Local Outlier Factor (OUTLIER_NEIGHBORS neighbours) of each row's PCA features; NaN for a row with a
    non-finite embedding, and for every row of a run of fewer than 3."""
    from sklearn.neighbors import LocalOutlierFactor

    out = np.full(len(embeddings), np.nan)
    finite = np.isfinite(embeddings).all(axis=1)
    if finite.sum() < 3:
        return out
    features = embedding_features(embeddings[finite], seed)
    found = LocalOutlierFactor(n_neighbors=min(OUTLIER_NEIGHBORS, int(finite.sum()) - 1)).fit(features)
    out[finite] = -found.negative_outlier_factor_
    return out


# ---------------------------------------------------------------- agreement with a checker

def load_checker(entry: dict[str, Any], log: Callable[[str], Any], key: str = "checker") -> Reward:
    """The config's checker (or verifier, `key`), ready to call: a built-in reward comparing with `response` unless
    `field` says otherwise, or the user's function, imported now (before any model loads)."""
    if "name" in entry:
        return builtin_reward({"field": "response", **entry}, 1)
    reward = Reward(entry["function"], 1.0, entry["module"])
    check_user_reward(reward, key)
    load_user_reward(reward, log, key, "called once per batch of records")
    return reward


def verify_responses(records: dict[str, list], tokenizer, verifier: Reward) -> np.ndarray:
    """The verifier's score of each record's own response (`records` holds the fields, one list per field)."""
    if "response" not in records:
        raise UserError(f"verifier: the records have no response field to verify (they have {', '.join(records)})")
    responses = [text or "" for text in records["response"]]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in responses]
    values, problem = score([verifier], records.get("prompt", [None] * len(responses)), responses, ids, records)
    if problem:
        raise UserError(f"verifier: {problem}")
    return values[:, 0]


def answer_agreement(model, tokenizer, rows: list[Row], records: dict[str, list], checker: Reward,
                     eos_ids: Iterable[int], max_new_tokens: int, batch_size: int) -> tuple[list[str], np.ndarray]:
    """(the model's greedy answer to each row's prompt, the checker's score of it against the record); `records`
    holds the rows' record fields, one list per field."""
    sequences = [Sequence(row["input_ids"][:last_turn_start(row["labels"])], max_new_tokens) for row in rows]
    decode_all(model, tokenizer, sequences, eos_ids, batch_size)
    answers = [s.text for s in sequences]
    ids = [s.ids + ([s.eos_id] if s.eos_id is not None else []) for s in sequences]
    values, problem = score([checker], records.get("prompt", [None] * len(rows)), answers, ids, records)
    if problem:
        raise UserError(f"checker: {problem}")
    return answers, values[:, 0]
