"""Per-example loss, trained-token count and embedding for every example of the training data, on N processes.

`torchrun --nproc_per_node N inference.py --config configs/inference/X.yaml` (or plain `python inference.py ...`).
The train/validation split is rebuilt exactly as training built it (same dataset revision, seed, val_fraction,
max_length and prompt template), so `split` in the output means what it meant during training. A model written by
a training run (its final/ or a step_N/) carries that run's config, and a seed or val_fraction other than its own is
refused.

Per example:
- `loss`: the mean next-token NLL over the trained (response) positions only. gpt4all divided by every position,
  which made long prompts look easy.
- `n_tokens`: how many positions that mean is over.
- `embedding`: the final hidden state at the last real token (`pooling: last`) or its mask-aware mean.

A conversation (a record with `messages`) is scored as training labelled it: `loss` is the mean over the tokens of
its trained assistant turns (every one, or the last with `train_turns: last`), and `embedding` pools over the whole
conversation, every turn of every role (`last`: the state after the final end-of-turn token, which has read all of
it). Its `prompt` and `response` columns, which the map shows, are the turns before the last assistant turn (one
"role: content" line each) and that turn.

Work is split so the result does not depend on the number of processes: the examples are sorted by length once,
rank r takes every W-th of that order, and nothing is dropped or repeated to even the shards out. Each rank writes
a Parquet shard; the main process merges them into `output_dir/inference.parquet`, ordered by (split, index), with
the original record fields. Padding is on the right behind an attention mask, so in fp32 an example's numbers
agree across batchings (and so across world sizes) up to float rounding.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from gpt4all_training.backends.accelerate import build_backend
from gpt4all_training.config.schemas import InferenceConfig
from gpt4all_training.config.secrets import redact
from gpt4all_training.batch import IGNORE
from gpt4all_training.data.batching import collate
from gpt4all_training.data.chat import with_conversation_text
from gpt4all_training.data.prompts import resolve_template
from gpt4all_training.data.records import load_records
from gpt4all_training.data.sft import (effective_num_proc, finish_split, refuse_unrendered, split_records,
                                       tokenize_dataset)
from gpt4all_training.errors import UserError
from gpt4all_training.files import atomic_file, atomic_write, make_own_folder, remove_own_folder
from gpt4all_training.model.loading import check_positions, load_model, model_config, tokenizer_for
from gpt4all_training.model.trained import training_run_config
from gpt4all_training.paths import require_dataset
from gpt4all_training.training.loop import require_writable
from gpt4all_training.training.loss import nll_sum

SPLITS = ("train", "val")
RESULT_FILE = "inference.parquet"
SUMMARY_FILE = "inference.json"
# Columns data.tokenize_batch adds; they are bookkeeping for training, not fields of the record.
TOKEN_COLUMNS = ("input_ids", "labels", "n_trained", "length", "truncated_prompt", "truncated_response",
                 "drop_reason")
RESULT_COLUMNS = ("split", "loss", "n_tokens", "embedding")
# What decides which examples training held out: inference must rebuild the split with the training run's values.
SPLIT_KEYS = ("seed", "val_fraction")


# ---------------------------------------------------------------- per-example maths (pure)

def example_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean NLL over each row's trained positions, number of those positions), in fp32.

    Position t predicts label t+1 (the causal shift). A row with no trained position gets NaN, not 0.
    Rows are done one at a time so only one row's logits are ever copied to fp32.
    """
    targets = labels[:, 1:]
    n_tokens = (targets != IGNORE).sum(dim=1)
    sums = torch.stack([nll_sum(logits[i, :-1].float(), targets[i]) for i in range(logits.shape[0])])
    return sums / n_tokens.to(sums.dtype), n_tokens


def pool_hidden(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """One fp32 vector per row from right-padded hidden states: the last real token's, or the mean of real tokens."""
    mask = attention_mask.to(hidden.device)
    if pooling == "last":
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
    weights = mask.unsqueeze(-1).float()
    return (hidden.float() * weights).sum(dim=1) / weights.sum(dim=1)


def length_sorted_order(lengths: np.ndarray, split_codes: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Positions sorted longest first (a too-large batch fails at once), ties by (split, index): one fixed order."""
    return np.lexsort((indices, split_codes, -np.asarray(lengths)))


def rank_share(order: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Every world_size-th position from `rank`: disjoint, covering, and balanced in length across ranks."""
    return order[rank::world_size]


# ---------------------------------------------------------------- data

@dataclass
class Examples:
    """Both tokenised splits, concatenated (train first), with per-position split codes."""
    dataset: Any  # datasets.Dataset with every column
    tokens: Any  # the same rows, input_ids and labels only (cheaper to fetch)
    split_codes: np.ndarray
    indices: np.ndarray
    lengths: np.ndarray
    record_columns: list[str]

    def rows(self, positions: np.ndarray) -> list[dict]:
        columns = self.tokens[positions.tolist()]
        return [{"input_ids": ids, "labels": labels} for ids, labels in zip(columns["input_ids"], columns["labels"])]


def load_examples(config: InferenceConfig, tokenizer) -> Examples:
    """The training split, rebuilt and tokenised exactly as data.load_data does for training."""
    import datasets

    assert config.dataset_path is not None  # validate() refuses a config without it
    records = load_records(config.dataset_path, config.revision)
    if len(records) == 0:
        raise UserError(f"dataset_path {config.dataset_path}: no records")
    template = resolve_template(config.prompt_template, tokenizer)
    num_proc = effective_num_proc(config, len(records))
    tokenized_splits = [tokenize_dataset(raw, tokenizer, config.max_length, template, num_proc, config.train_turns,
                                         config.train_reasoning)
                        for raw in split_records(records, config.val_fraction, config.seed)]
    refuse_unrendered(tokenized_splits, config.dataset_path)  # as training does: never scored as empty answers
    kept = []
    for name, tokenized in zip(SPLITS, tokenized_splits):
        split, stats = finish_split(tokenized)
        dropped = ", ".join(f"{k} {v}" for k, v in stats.dropped.items()) or "none"
        print(f"{name}: {len(split)} examples to score (dropped: {dropped})", flush=True)
        kept.append(split)
    combined = datasets.concatenate_datasets(kept)
    if len(combined) == 0:
        raise UserError(f"dataset_path {config.dataset_path}: no example has a trainable response")
    if "messages" in combined.column_names:
        combined = with_conversation_text(combined)
    split_codes = np.repeat(np.arange(len(SPLITS), dtype=np.int64), [len(s) for s in kept])
    # A record field named like an output column (a Hub dataset's own "split", say) gives way to the output.
    record_columns = [c for c in combined.column_names if c not in (*TOKEN_COLUMNS, "index", *RESULT_COLUMNS)]
    return Examples(combined, combined.select_columns(["input_ids", "labels"]), split_codes,
                    np.asarray(combined["index"], dtype=np.int64), np.asarray(combined["length"], dtype=np.int64),
                    record_columns)


# ---------------------------------------------------------------- scoring

@torch.inference_mode()
def score_batch(model, batch: dict[str, torch.Tensor], pooling: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(loss, n_tokens, embedding) for one right-padded batch, as NumPy arrays."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True,
                use_cache=False)
    loss, n_tokens = example_losses(out.logits, batch["labels"])
    embedding = pool_hidden(out.hidden_states[-1], batch["attention_mask"], pooling)
    return loss.cpu().numpy(), n_tokens.cpu().numpy(), embedding.cpu().numpy()


def score_positions(model, examples: Examples, positions: np.ndarray, batch_size: int, pad_id: int, pooling: str,
                    device: torch.device, progress) -> dict[str, np.ndarray]:
    # The head's input width is the embedding width; an empty share still needs it for its shard's schema.
    hidden = model.get_output_embeddings().weight.shape[1]
    losses, counts, embeddings = [], [], [np.zeros((0, hidden), np.float32)]
    for start in range(0, len(positions), batch_size):
        chunk = positions[start:start + batch_size]
        # collate pads on the right, which pool_hidden's "last real token" relies on
        batch = {k: v.to(device) for k, v in collate(examples.rows(chunk), pad_id).items()}
        loss, n_tokens, embedding = score_batch(model, batch, pooling)
        losses.append(loss)
        counts.append(n_tokens)
        embeddings.append(embedding)
        progress.update(len(chunk))
    return {
        "position": positions,
        "loss": np.concatenate([np.zeros(0, np.float32), *losses]),
        "n_tokens": np.concatenate([np.zeros(0, np.int64), *counts]),
        "embedding": np.concatenate(embeddings),
    }


# ---------------------------------------------------------------- output

def embedding_array(embeddings: np.ndarray):
    """A float32 (n, d) array as an Arrow fixed-size-list column, without going through Python lists."""
    import pyarrow as pa

    embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(embeddings.reshape(-1)), embeddings.shape[1])


def shard_path(output_dir: Path, rank: int, world_size: int) -> Path:
    return output_dir / "shards" / f"rank-{rank:05d}-of-{world_size:05d}.parquet"


def write_shard(results: dict[str, np.ndarray], examples: Examples, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    positions = results["position"]
    table = pa.table({
        "position": pa.array(positions, pa.int64()),
        "split": pa.array([SPLITS[c] for c in examples.split_codes[positions]], pa.string()),
        "index": pa.array(examples.indices[positions], pa.int64()),
        "loss": pa.array(results["loss"].astype(np.float64)),
        "n_tokens": pa.array(results["n_tokens"].astype(np.int64)),
        "embedding": embedding_array(results["embedding"]),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def merge_shards(examples: Examples, output_dir: Path, world_size: int) -> Path:
    """One table, every kept example exactly once, ordered by (split, index), with the record's own fields."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = pa.concat_tables([pq.read_table(shard_path(output_dir, r, world_size)) for r in range(world_size)])
    positions = shards.column("position").to_numpy()
    if len(positions) != len(examples.split_codes) or len(np.unique(positions)) != len(positions):
        raise RuntimeError(f"shards hold {len(positions)} rows ({len(np.unique(positions))} distinct) for "
                           f"{len(examples.split_codes)} examples")
    # Train precedes val in `examples` and each split is ordered by index after this sort: (split, index) order.
    order = np.lexsort((examples.indices[positions], examples.split_codes[positions]))
    shards = shards.take(pa.array(order))
    table = examples.dataset.select_columns(examples.record_columns).with_format("arrow")[
        shards.column("position").to_pylist()]
    for name in ("index", *RESULT_COLUMNS):
        table = table.append_column(name, shards.column(name))
    # The records' datasets metadata describes fewer columns than the table now has; drop it.
    table = table.replace_schema_metadata(None)
    path = output_dir / RESULT_FILE
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp)
    shutil.rmtree(output_dir / "shards")
    return path


def split_summary(table) -> dict[str, dict[str, float]]:
    """Per split: examples, mean of per-example losses, and the token-weighted loss (training's val_loss)."""
    split = np.asarray(table.column("split").to_pylist())
    loss = table.column("loss").to_numpy()
    n_tokens = table.column("n_tokens").to_numpy()
    out = {}
    for name in SPLITS:
        m = split == name
        if m.any():
            out[name] = {"examples": int(m.sum()), "mean_example_loss": float(loss[m].mean()),
                         "token_weighted_loss": float((loss[m] * n_tokens[m]).sum() / n_tokens[m].sum())}
    return out


# ---------------------------------------------------------------- the run

def check_training_split(config: InferenceConfig) -> None:
    """Refuse, in one line, split settings other than those of the training run that wrote the model (its
    config.yaml in final/ or step_N/): the `split` column would then call training examples validation ones."""
    assert config.model_name is not None  # validate() refuses a config without it
    found = training_run_config(config.model_name)
    if found is None:
        return
    file, run = found
    differ = [key for key in SPLIT_KEYS if key in run and run[key] != getattr(config, key)]
    if differ == ["seed"] and run.get("val_fraction") == config.val_fraction == 0:
        return  # nothing is held out, so the seed splits nothing: every example is a training one either way
    if differ:
        raise UserError(f"model_name {config.model_name}: its training run split the data with "
                        f"{', '.join(f'{k}={run[k]}' for k in differ)} (see {file}), but this config has "
                        f"{', '.join(f'{k}={getattr(config, k)}' for k in differ)}, so the split column would not be "
                        f"the training split; set {' '.join(f'{k}={run[k]}' for k in differ)}")


def progress_bar(total: int, backend):
    from tqdm.auto import tqdm

    desc = "inference" if backend.world_size == 1 else f"inference (rank 0 of {backend.world_size})"
    return tqdm(total=total, unit="ex", desc=desc, disable=not backend.is_main_process, mininterval=1.0)


def run_inference(config: InferenceConfig) -> Optional[Path]:
    """Score every example on this process's share; the main process returns the merged Parquet's path."""
    assert config.dataset_path is not None and config.model_name is not None  # validate() requires both
    backend = build_backend()  # torchrun's processes: nccl on the local GPU, gloo on CPU; none for one process
    try:
        torch.manual_seed(config.seed)
        check_training_split(config)
        output_dir = Path(config.output_dir)
        require_writable(output_dir)
        require_dataset(config.dataset_path)
        tokenizer = tokenizer_for(config)
        check_positions(model_config(config.model_name, config.model_revision, config.gguf_file,
                                     config.trust_remote_code), config.max_length)  # before tokenising
        # The main process fills the datasets cache alone; the others then read it instead of racing to write it.
        with backend.main_process_first():
            if backend.is_main_process:
                remove_own_folder(output_dir / "shards", "output_dir")  # left by a crashed run
                make_own_folder(output_dir / "shards")
                output_dir.mkdir(parents=True, exist_ok=True)
            examples = load_examples(config, tokenizer)
        model = load_model(config.model_name, config.model_revision, config.gguf_file, config.trust_remote_code,
                           dtype=getattr(torch, config.dtype))
        model.to(backend.device).eval()

        order = length_sorted_order(examples.lengths, examples.split_codes, examples.indices)
        mine = rank_share(order, backend.rank, backend.world_size)
        backend.wait_for_everyone()
        started = time.perf_counter()
        with progress_bar(len(mine), backend) as progress:
            results = score_positions(model, examples, mine, config.batch_size, tokenizer.pad_token_id,
                                      config.pooling, backend.device, progress)
        backend.wait_for_everyone()
        elapsed = time.perf_counter() - started
        write_shard(results, examples, shard_path(output_dir, backend.rank, backend.world_size))
        backend.wait_for_everyone()
        if not backend.is_main_process:
            return None
        path = merge_shards(examples, output_dir, backend.world_size)
        write_summary(config, backend.world_size, path, elapsed)
        return path
    finally:
        backend.end()


def write_summary(config: InferenceConfig, world_size: int, path: Path, elapsed: float) -> None:
    """inference.json: the config, per-split losses and the scoring throughput (model loading not included)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["split", "loss", "n_tokens"])
    rate = table.num_rows / elapsed if elapsed > 0 else math.inf
    summary = {"config": redact(dataclasses.asdict(config)), "world_size": world_size,
               "examples": table.num_rows, "seconds": round(elapsed, 3), "examples_per_second": round(rate, 2),
               "splits": split_summary(table)}
    atomic_write(path.parent / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    for name, stats in summary["splits"].items():
        print(f"{name}: {stats['examples']} examples, mean example loss {stats['mean_example_loss']:.4f}, "
              f"token-weighted loss {stats['token_weighted_loss']:.4f}")
    print(f"{table.num_rows} examples in {elapsed:.2f} s on {world_size} process(es): "
          f"{rate:.1f} examples/s")
    print(f"wrote {path}")
