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
- the scores the config asks for (analysis/scores.py says what each one is): `response_loss` and `ifd` (`ifd:
  true`), `base_loss` and `loss_change` (`base_model`), `proxy_ifd` (`ifd_model`), `model_answer` and `agreement`
  (`checker`), `verified` (`verifier`), `outlier` (`outliers: true`, the default). Each model scores the rank's
  share in its own pass, one model in memory at a time: model_name, then base_model, then ifd_model.

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

import contextlib
import dataclasses
import gc
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from gpt4all_training.analysis.scores import (answer_agreement, load_checker, outlier_scores, ratio, response_only,
                                              start_token, verify_responses)
from gpt4all_training.backends.accelerate import build_backend
from gpt4all_training.config.schemas import InferenceConfig
from gpt4all_training.config.secrets import redact
from gpt4all_training.batch import IGNORE
from gpt4all_training.data.batching import collate
from gpt4all_training.data.chat import end_of_turn_id, with_conversation_text
from gpt4all_training.data.prompts import resolve_template
from gpt4all_training.data.records import load_records
from gpt4all_training.data.sft import (effective_num_proc, finish_split, refuse_unrendered, split_records,
                                       tokenize_dataset)
from gpt4all_training.errors import UserError
from gpt4all_training.files import atomic_file, atomic_write, created_folder, make_own_folder, remove_own_folder
from gpt4all_training.model.chat_templates import apply_chat_template_option
from gpt4all_training.model.decoding import eos_token_ids
from gpt4all_training.model.loading import check_positions, load_model, load_tokenizer, model_config, tokenizer_for
from gpt4all_training.model.trained import training_run_config
from gpt4all_training.paths import require_dataset
from gpt4all_training.training.loss import nll_sum

SPLITS = ("train", "val")
RESULT_FILE = "inference.parquet"
SUMMARY_FILE = "inference.json"
# Columns data.tokenize_batch adds; they are bookkeeping for training, not fields of the record.
TOKEN_COLUMNS = ("input_ids", "labels", "n_trained", "length", "truncated_prompt", "truncated_response",
                 "drop_reason")
RESULT_COLUMNS = ("split", "loss", "n_tokens", "embedding")
# The optional scores, in the order they are written, each with the config key that asks for it.
SCORE_COLUMNS = {"response_loss": "ifd: true", "ifd": "ifd: true", "base_loss": "base_model",
                 "loss_change": "base_model", "proxy_ifd": "ifd_model", "model_answer": "checker",
                 "agreement": "checker", "verified": "verifier", "outlier": "outliers: true"}
# Every column inference adds to a record's fields.
OUTPUT_COLUMNS = ("index", *RESULT_COLUMNS, *SCORE_COLUMNS)
CHECK_ROWS = 16  # batches decoded per call to the decoder: a share's prompts are never all in memory at once
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
    record_columns = [c for c in combined.column_names if c not in (*TOKEN_COLUMNS, *OUTPUT_COLUMNS)]
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
                    device: torch.device, progress) -> dict[str, Any]:
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


@torch.inference_mode()
def batch_losses(model, batch: dict[str, torch.Tensor]) -> np.ndarray:
    """Each row's mean loss over its trained positions (example_losses), without the hidden states."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return example_losses(out.logits, batch["labels"])[0].cpu().numpy()


def pass_losses(model, n: int, rows_of: Callable[[np.ndarray], Sequence[Optional[dict]]], batch_size: int,
                pad_id: int, device: torch.device, progress) -> np.ndarray:
    """The loss of each of `n` rows, `batch_size` at a time; `rows_of` gives the rows at positions 0..n-1 of the
    share (None for a row with nothing to score, whose loss is NaN)."""
    out = np.full(n, np.nan)
    for start in range(0, n, batch_size):
        chunk = np.arange(start, min(n, start + batch_size))
        rows = rows_of(chunk)
        present = [(k, row) for k, row in enumerate(rows) if row is not None]
        if present:
            batch = {k: v.to(device) for k, v in collate([row for _, row in present], pad_id).items()}
            out[chunk[[k for k, _ in present]]] = batch_losses(model, batch)
        progress.update(len(chunk))
    return out


@contextlib.contextmanager
def about(key: str, name: Optional[str]) -> Iterator[None]:
    """A UserError raised inside names the option whose model it concerns."""
    try:
        yield
    except UserError as error:
        raise UserError(f"{key} {name}: {error}") from None


def score_model(config: InferenceConfig, model, examples: Examples, share: np.ndarray, tokenizer, checker, backend
                ) -> dict[str, Any]:
    """model_name's pass over the share: loss, n_tokens and embedding; the response alone's loss (ifd) and the
    checked greedy answers (checker) when asked for."""
    pad_id = tokenizer.pad_token_id
    with progress_bar(len(share), backend) as progress:
        results = score_positions(model, examples, share, config.batch_size, pad_id, config.pooling,
                                  backend.device, progress)
    if config.ifd:
        start = start_token(tokenizer)
        with progress_bar(len(share), backend, "response alone") as progress:
            results["response_loss"] = pass_losses(
                model, len(share), lambda chunk: [response_only(r, start) for r in examples.rows(share[chunk])],
                config.batch_size, pad_id, backend.device, progress)
    if checker is not None:
        results.update(check_answers(model, tokenizer, examples, share, checker, config, backend))
    return results


def check_answers(model, tokenizer, examples: Examples, share: np.ndarray, checker, config: InferenceConfig,
                  backend) -> dict[str, Any]:
    """The model's greedy answer to each example of the share, and the checker's score of it."""
    chat = resolve_template(config.prompt_template, tokenizer) == "chat" or "messages" in examples.record_columns
    eos = eos_token_ids(model, tokenizer) | ({end_of_turn_id(tokenizer)} if chat else set())
    records = examples.dataset.select_columns(examples.record_columns)
    answers: list[str] = []
    agreement = [np.zeros(0)]
    step = config.batch_size * CHECK_ROWS
    with progress_bar(len(share), backend, "checking answers") as progress:
        for start in range(0, len(share), step):
            chunk = share[start:start + step]
            found, values = answer_agreement(model, tokenizer, examples.rows(chunk), records[chunk.tolist()],
                                             checker, eos, config.checker_max_new_tokens, config.batch_size)
            answers += found
            agreement.append(values)
            progress.update(len(chunk))
    return {"model_answer": answers, "agreement": np.concatenate(agreement)}


def check_base_model(config: InferenceConfig, tokenizer) -> None:
    """base_model must read this run's tokens as the same text (its vocabulary a part of this run's, under the same
    ids) and take max_length: loss_change compares the same tokens under two models."""
    assert config.base_model is not None
    with about("base_model", config.base_model):
        check_positions(model_config(config.base_model, None, None, config.trust_remote_code, "base_model"),
                        config.max_length)
    base = load_tokenizer(config.base_model, None, None, config.trust_remote_code, "base_model").get_vocab()
    ours = tokenizer.get_vocab()
    differs = next((token for token, i in base.items() if ours.get(token) != i), None)
    if differs is not None:
        raise UserError(f"base_model {config.base_model}: its tokenizer gives {differs!r} the id {base[differs]}, this "
                        f"run's tokenizer {ours.get(differs)}; loss_change compares the same tokens under both "
                        f"models, so base_model must be the model that model_name was fine-tuned from")


def score_base(config: InferenceConfig, model, examples: Examples, share: np.ndarray, tokenizer, backend
               ) -> np.ndarray:
    """base_model's loss of the share's tokens."""
    rows = model.get_input_embeddings().num_embeddings
    if rows < len(tokenizer):
        raise UserError(f"base_model {config.base_model}: has {rows} token embeddings, this run's tokenizer "
                        f"{len(tokenizer)} tokens; base_model must be the model that model_name was fine-tuned from")
    with progress_bar(len(share), backend, "base_model") as progress:
        return pass_losses(model, len(share), lambda chunk: examples.rows(share[chunk]), config.batch_size,
                           tokenizer.pad_token_id, backend.device, progress)


def proxy_tokens(config: InferenceConfig, examples: Examples, share: np.ndarray):
    """(ifd_model's tokenizer, the share's records tokenized by it in the share's order), as training would tokenize
    them for that model; before any model loads, so a template it cannot write is an error at once."""
    assert config.ifd_model is not None
    tokenizer = apply_chat_template_option(
        load_tokenizer(config.ifd_model, None, None, config.trust_remote_code, "ifd_model"), config.chat_template)
    records = examples.dataset.select(share.tolist())
    records = records.remove_columns([c for c in TOKEN_COLUMNS if c in records.column_names])
    with about("ifd_model", config.ifd_model):
        check_positions(model_config(config.ifd_model, None, None, config.trust_remote_code, "ifd_model"),
                        config.max_length)
        template = resolve_template(config.prompt_template, tokenizer)
        tokens = tokenize_dataset(records, tokenizer, config.max_length, template,
                                  effective_num_proc(config, len(records)), config.train_turns,
                                  config.train_reasoning)
    return tokenizer, tokens.select_columns(["input_ids", "labels", "drop_reason"])


def score_proxy(config: InferenceConfig, model, proxy, share: np.ndarray, backend) -> np.ndarray:
    """ifd_model's IFD of the share's records on its own tokens (`proxy`: proxy_tokens'); NaN where they leave
    nothing to train on."""
    tokenizer, tokens = proxy

    def rows_of(chunk: np.ndarray) -> list[Optional[dict]]:
        part = tokens[chunk.tolist()]
        return [None if reason else {"input_ids": ids, "labels": labels}
                for ids, labels, reason in zip(part["input_ids"], part["labels"], part["drop_reason"])]

    start = start_token(tokenizer)
    with progress_bar(2 * len(share), backend, "ifd_model") as progress:
        given = pass_losses(model, len(share), rows_of, config.batch_size, tokenizer.pad_token_id, backend.device,
                            progress)
        alone = pass_losses(model, len(share),
                            lambda chunk: [None if r is None else response_only(r, start) for r in rows_of(chunk)],
                            config.batch_size, tokenizer.pad_token_id, backend.device, progress)
    return ratio(given, alone)


def derive_scores(results: dict[str, Any]) -> None:
    """The scores computed from others: ifd from the two losses, loss_change from the two models'."""
    if "response_loss" in results:
        results["ifd"] = ratio(results["loss"], results["response_loss"])
    if "base_loss" in results:
        results["loss_change"] = results["loss"] - results["base_loss"]


# ---------------------------------------------------------------- output

def embedding_array(embeddings: np.ndarray):
    """A float32 (n, d) array as an Arrow fixed-size-list column, without going through Python lists."""
    import pyarrow as pa

    embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(embeddings.reshape(-1)), embeddings.shape[1])


def shard_path(output_dir: Path, rank: int, world_size: int) -> Path:
    return output_dir / "shards" / f"rank-{rank:05d}-of-{world_size:05d}.parquet"


def write_shard(results: dict[str, Any], examples: Examples, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    positions = results["position"]
    columns = {
        "position": pa.array(positions, pa.int64()),
        "split": pa.array([SPLITS[c] for c in examples.split_codes[positions]], pa.string()),
        "index": pa.array(examples.indices[positions], pa.int64()),
        "loss": pa.array(results["loss"].astype(np.float64)),
        "n_tokens": pa.array(results["n_tokens"].astype(np.int64)),
        "embedding": embedding_array(results["embedding"]),
    }
    for name in SCORE_COLUMNS:
        if name in results:
            columns[name] = (pa.array(results[name], pa.string()) if name == "model_answer"
                             else pa.array(np.asarray(results[name], dtype=np.float64)))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)


def merge_shards(examples: Examples, output_dir: Path, world_size: int):
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
    for name in ("index", *RESULT_COLUMNS, *SCORE_COLUMNS):
        if name in shards.column_names:
            table = table.append_column(name, shards.column(name))
    # The records' datasets metadata describes fewer columns than the table now has; drop it.
    return table.replace_schema_metadata(None)


def with_outliers(table, seed: int):
    """`table` with its outlier column, from its embeddings."""
    import pyarrow as pa

    embeddings = table.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    scores = outlier_scores(embeddings.reshape(table.num_rows, -1), seed)
    return table.append_column("outlier", pa.array(scores, pa.float64()))


def write_result(table, output_dir: Path) -> Path:
    import pyarrow.parquet as pq

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


def score_summary(table) -> dict[str, dict[str, Any]]:
    """Per numeric score column: how many examples have it, and its mean and quantiles over them."""
    out: dict[str, dict[str, Any]] = {}
    for name in SCORE_COLUMNS:
        if name not in table.column_names or name == "model_answer":
            continue
        values = table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        finite = values[np.isfinite(values)]
        stats: dict[str, Any] = {"examples": int(finite.size)}
        if finite.size:
            stats.update(mean=round(float(finite.mean()), 4),
                         quantiles={q: round(float(np.quantile(finite, float(q))), 4) for q in ("0.1", "0.5", "0.9")})
        out[name] = stats
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


def progress_bar(total: int, backend, what: str = "inference"):
    from tqdm.auto import tqdm

    desc = what if backend.world_size == 1 else f"{what} (rank 0 of {backend.world_size})"
    return tqdm(total=total, unit="ex", desc=desc, disable=not backend.is_main_process, mininterval=1.0)


def run_inference(config: InferenceConfig) -> Optional[Path]:
    """Score every example on this process's share; the main process returns the merged Parquet's path."""
    assert config.dataset_path is not None and config.model_name is not None  # validate() requires both
    backend = build_backend()  # torchrun's processes: nccl on the local GPU, gloo on CPU; none for one process
    try:
        torch.manual_seed(config.seed)
        check_training_split(config)
        output_dir = Path(config.output_dir)
        created_folder("output_dir", output_dir)
        require_dataset(config.dataset_path)
        tokenizer = tokenizer_for(config)
        check_positions(model_config(config.model_name, config.model_revision, config.gguf_file,
                                     config.trust_remote_code), config.max_length)  # before tokenising
        if config.base_model:
            check_base_model(config, tokenizer)
        # The user's checker runs (is imported) before the data and the models load: its mistakes surface at once.
        log = print if backend.is_main_process else lambda line: None
        checker = load_checker(config.checker, log) if config.checker else None
        verifier = load_checker(config.verifier, log, "verifier") if config.verifier else None
        # The main process fills the datasets cache alone; the others then read it instead of racing to write it.
        with backend.main_process_first():
            if backend.is_main_process:
                remove_own_folder(output_dir / "shards", "output_dir")  # left by a crashed run
                make_own_folder(output_dir / "shards")
                output_dir.mkdir(parents=True, exist_ok=True)
            examples = load_examples(config, tokenizer)

        order = length_sorted_order(examples.lengths, examples.split_codes, examples.indices)
        mine = rank_share(order, backend.rank, backend.world_size)
        proxy = proxy_tokens(config, examples, mine) if config.ifd_model else None
        loading = 0.0  # seconds spent loading models after the clock started: not scoring

        def loaded(name: str, key: str, revision: Optional[str] = None, gguf_file: Optional[str] = None):
            nonlocal loading
            began = time.perf_counter()
            model = load_model(name, revision, gguf_file, config.trust_remote_code, getattr(torch, config.dtype),
                               key)
            loading += time.perf_counter() - began
            return model.to(backend.device).eval()

        model = loaded(config.model_name, "model_name", config.model_revision, config.gguf_file)
        backend.wait_for_everyone()
        started, loading = time.perf_counter(), 0.0
        results = score_model(config, model, examples, mine, tokenizer, checker, backend)
        # One model in memory at a time: the next ones are arguments only, released when their pass returns.
        del model
        if verifier is not None:  # the records alone, no model
            records = examples.dataset.select_columns(examples.record_columns)[mine.tolist()]
            results["verified"] = verify_responses(records, tokenizer, verifier)
        if config.base_model:
            gc.collect()  # the weights of the model before, should they sit in a reference cycle
            results["base_loss"] = score_base(config, loaded(config.base_model, "base_model"), examples, mine,
                                              tokenizer, backend)
        if config.ifd_model:
            gc.collect()
            results["proxy_ifd"] = score_proxy(config, loaded(config.ifd_model, "ifd_model"), proxy, mine, backend)
        derive_scores(results)
        backend.wait_for_everyone()
        elapsed = time.perf_counter() - started - loading
        write_shard(results, examples, shard_path(output_dir, backend.rank, backend.world_size))
        backend.wait_for_everyone()
        if not backend.is_main_process:
            return None
        table = merge_shards(examples, output_dir, backend.world_size)
        if config.outliers:
            table = with_outliers(table, config.seed)
        path = write_result(table, output_dir)
        write_summary(config, backend.world_size, path, elapsed)
        return path
    finally:
        backend.end()


def write_summary(config: InferenceConfig, world_size: int, path: Path, elapsed: float) -> None:
    """inference.json: the config, per-split losses, the scores' distributions and the scoring throughput (every
    model's pass, the loading of the first model not included)."""
    import pyarrow.parquet as pq

    written = pq.read_schema(path).names
    table = pq.read_table(path, columns=["split", "loss", "n_tokens", *(c for c in SCORE_COLUMNS if c in written)])
    rate = table.num_rows / elapsed if elapsed > 0 else math.inf
    summary = {"config": redact(dataclasses.asdict(config)), "world_size": world_size,
               "examples": table.num_rows, "seconds": round(elapsed, 3), "examples_per_second": round(rate, 2),
               "splits": split_summary(table), "scores": score_summary(table)}
    atomic_write(path.parent / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    for name, stats in summary["splits"].items():
        print(f"{name}: {stats['examples']} examples, mean example loss {stats['mean_example_loss']:.4f}, "
              f"token-weighted loss {stats['token_weighted_loss']:.4f}")
    for name, stats in summary["scores"].items():
        if stats["examples"]:
            print(f"{name}: mean {stats['mean']:.4f}, median {stats['quantiles']['0.5']:.4f} over "
                  f"{stats['examples']} examples")
    print(f"{table.num_rows} examples in {elapsed:.2f} s on {world_size} process(es): "
          f"{rate:.1f} examples/s")
    print(f"wrote {path}")
