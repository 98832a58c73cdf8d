"""Raw text for pretraining (`objective: causal_lm`): rows cut from the records, their statistics, the two row stores.

Records come from data/records.py, one at a time or as a whole dataset.

Rows, as CodeParrot's ConstantLengthDataset made them: each training record's tokens plus EOS are joined into one
sequence, cut into rows of exactly `max_length` tokens, with every token trained. Unlike CodeParrot:
- the rows of each pass (epoch) go through a shuffle buffer of `shuffle_buffer` rows, seeded by (seed, epoch);
- the position is a function of the optimizer step: step s trains global rows s*G .. s*G+G-1 (G = batch_size x
  processes x gradient_accumulation_steps) of the run's row sequence, each rank taking its share of every
  micro-batch (data/sampling.py, as for examples). So resuming at step s is exact, and a global step holds the same
  rows for every world size;
- what is dropped is counted: the tail of each pass (fewer than max_length tokens) and the rows of its last partial
  step, reported with the data's statistics.
Validation holds out every round(1/val_fraction)-th record (never trained on), cut into rows the same way.

Two loaders give the same rows in the same order for the same seed:
- `streaming: false` loads and tokenises the records up front with `datasets` (parallel, cached), keeps the token
  sequence in memory, and finds any step's rows directly: a resume costs nothing;
- `streaming: true` reads and tokenises records as training consumes them (for corpora larger than memory). The
  length of a pass is unknown before it ends, so it needs max_steps, and it repeats the stream as often as that
  takes. A checkpoint keeps the stream's position (StreamedRows.state_dict): a resume reads on from the next record,
  and continues exactly; a checkpoint without it (or a jump backwards) replays the stream from its start.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from dataclasses import asdict, dataclass
from itertools import count, islice
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

import numpy as np
import torch

from gpt4all_training.data.batching import row_labels
from gpt4all_training.data.records import iter_texts, load_table, local_text_files, text_column
from gpt4all_training.data.sampling import epoch_seed
from gpt4all_training.data.settings import RawTextSettings
from gpt4all_training.data.sft import effective_num_proc
from gpt4all_training.errors import UserError

T = TypeVar("T")


# ---------------------------------------------------------------- rows and their order (pure)

def held_out(number: int, val_every: int) -> bool:
    """Whether record `number` belongs to validation: every `val_every`-th record, from the first."""
    return val_every > 0 and number % val_every == 0


def validation_stride(val_fraction: float) -> int:
    return max(2, round(1 / val_fraction)) if val_fraction > 0 else 0


class ShuffleBuffer:
    """A seeded shuffle buffer: once `size` items are held, each new item replaces a random one, which comes out.

    The order depends only on the number of items and the RNG, so it is the same whether the items come from a
    stream or from memory. Size 1 keeps the input order. Its items and RNG are its whole state.
    """

    def __init__(self, size: int, rng: random.Random) -> None:
        self.size, self.rng = size, rng
        self.items: list = []

    def push(self, item: T) -> Optional[T]:
        """The item that comes out as `item` goes in; None while the buffer fills."""
        if len(self.items) < self.size:
            self.items.append(item)
            return None
        slot = self.rng.randrange(self.size)
        out, self.items[slot] = self.items[slot], item
        return out

    def drain(self) -> list:
        """What is left, shuffled, in the order it comes out; the buffer is then empty."""
        self.rng.shuffle(self.items)
        items, self.items = self.items, []
        return items


def buffer_shuffle(items: Iterable[T], size: int, rng: random.Random) -> Iterator[T]:
    """`items` through a ShuffleBuffer."""
    buffer = ShuffleBuffer(size, rng)
    for item in items:
        out = buffer.push(item)
        if out is not None:
            yield out
    yield from buffer.drain()


def epoch_rng(seed: int, epoch: int) -> random.Random:
    return random.Random(epoch_seed(seed, epoch))


class RowCutter:
    """Joins token lists, each followed by EOS, and cuts rows of exactly `max_length` tokens."""

    def __init__(self, max_length: int, eos_id: int) -> None:
        self.max_length, self.eos_id = max_length, eos_id
        self.pending: list[int] = []

    def add(self, ids: list[int]) -> list[list[int]]:
        if not ids:
            return []  # an empty text adds nothing, not even an EOS
        self.pending.extend(ids)
        self.pending.append(self.eos_id)
        cut = len(self.pending) // self.max_length * self.max_length
        rows = [self.pending[i:i + self.max_length] for i in range(0, cut, self.max_length)]
        del self.pending[:cut]
        return rows

    @property
    def tail(self) -> int:
        """Tokens left over: dropped at the end of a pass."""
        return len(self.pending)


def joined_tokens(token_lists: Iterable[list[int]], eos_id: int) -> np.ndarray:
    """Every non-empty token list followed by EOS, as one int32 array (what RowCutter cuts, all at once)."""
    pieces = []
    for ids in token_lists:
        if ids:
            pieces.append(np.asarray(ids, dtype=np.int32))
            pieces.append(np.asarray([eos_id], dtype=np.int32))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


# ---------------------------------------------------------------- statistics

@dataclass
class PretrainStats:
    records: int = 0
    held_out: int = 0
    empty: int = 0
    tokens: int = 0  # of the training records, EOS included
    rows: int = 0  # per pass
    tail_tokens: int = 0  # per pass: fewer than max_length, dropped
    rows_per_step: int = 0
    streamed: bool = False

    @property
    def steps(self) -> int:
        return self.rows // self.rows_per_step if self.rows_per_step else 0

    @property
    def dropped_rows(self) -> int:
        """Rows of a pass's last partial step, dropped so that every step has G rows on every world size."""
        return self.rows - self.steps * self.rows_per_step if self.rows_per_step else 0

    def describe(self, name: str) -> str:
        if name != "train":
            return f"{name}: {self.rows:,} rows ({self.tokens:,} tokens) cut from the held-out records"
        if self.streamed and not self.records:
            return "train: streamed; each pass's rows and dropped tail are logged when it ends"
        text = (f"train: {self.records:,} records ({self.held_out:,} held out, {self.empty:,} empty), "
                f"{self.tokens:,} tokens with EOS -> {self.rows:,} rows per pass; dropped per pass: a tail of "
                f"{self.tail_tokens:,} tokens")
        if self.rows_per_step:
            text += (f" and {self.dropped_rows:,} rows of the last partial step ({self.steps:,} steps of "
                     f"{self.rows_per_step} rows)")
        return text


# ---------------------------------------------------------------- the two loaders

class MaterializedRows:
    """`streaming: false`: the joined token sequence in memory; any global row found directly."""

    streaming = False

    def __init__(self, tokens: np.ndarray, max_length: int, seed: int, shuffle_buffer: int,
                 stats: PretrainStats, log: Callable[[str], Any] = print) -> None:
        self.tokens, self.max_length, self.seed, self.shuffle_buffer = tokens, max_length, seed, shuffle_buffer
        self.n_rows = len(tokens) // max_length
        self.stats, self.log = stats, log
        stats.rows, stats.tail_tokens = self.n_rows, len(tokens) % max_length
        self._order: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        return self.n_rows

    def fingerprint(self) -> str:
        """SHA-256 of the joined training tokens: what a resumed run compares to know it trains on the same data."""
        return hashlib.sha256(self.tokens.tobytes()).hexdigest()

    def configure(self, rows_per_step: int) -> Optional[int]:
        """Steps per pass at G = `rows_per_step`."""
        self.stats.rows_per_step = rows_per_step
        if self.stats.steps == 0:
            raise UserError(f"dataset_path: one optimiser step needs {rows_per_step} rows of {self.max_length} "
                            f"tokens but the data makes {self.n_rows}; lower batch_size, gradient_accumulation_steps "
                            f"or max_length")
        self.log(f"rows per pass: {self.n_rows:,} = {self.stats.steps:,} steps of {rows_per_step} rows; the last "
                 f"partial step's {self.stats.dropped_rows} rows are dropped, and a tail of "
                 f"{self.stats.tail_tokens} tokens")
        return self.stats.steps

    def epoch_order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(buffer_shuffle(range(self.n_rows), self.shuffle_buffer, epoch_rng(self.seed, epoch)))
            self._order = (epoch, order)
        return self._order[1]

    def rows(self, ids: list[int]) -> np.ndarray:
        used = self.stats.steps * self.stats.rows_per_step
        out = np.empty((len(ids), self.max_length), dtype=np.int32)
        for k, global_id in enumerate(ids):
            epoch, position = divmod(global_id, used)
            row = self.epoch_order(epoch)[position]
            out[k] = self.tokens[row * self.max_length:(row + 1) * self.max_length]
        return out


class StreamedRows:
    """`streaming: true`: rows cut from records as they are read; the run's row sequence is produced in order.

    The position in the stream is explicit state, what state_dict() returns and a checkpoint keeps: the pass, the
    records read in it, the cutter's leftover tokens, the rows cut but not yet through the shuffle buffer, the
    buffer with its RNG, and the rows of the step being collected. A resume restores it and reads on from the next
    record (the ones before it are skipped unparsed), so nothing is tokenised twice.
    """

    streaming = True

    def __init__(self, texts: Callable[[int], Iterator[tuple[int, str]]], tokenizer, max_length: int, seed: int,
                 shuffle_buffer: int, val_every: int, log: Callable[[str], Any] = print) -> None:
        self.texts, self.tokenizer, self.max_length = texts, tokenizer, max_length
        self.seed, self.shuffle_buffer, self.val_every, self.log = seed, shuffle_buffer, val_every, log
        self.stats = PretrainStats(streamed=True)  # of the last finished pass
        self.rows_read = 0  # training rows cut so far (all passes): what len() reports until a pass has ended
        self.restart()

    def __len__(self) -> int:
        return self.stats.rows if self.stats.records else self.rows_read

    def configure(self, rows_per_step: int) -> Optional[int]:
        self.stats.rows_per_step = self.pass_stats.rows_per_step = rows_per_step
        return None  # unknown until a pass ends

    # --- the position

    def restart(self) -> None:
        """Back to the first row of the run."""
        self.start_pass(0)
        self.ready: deque[list[int]] = deque()  # the current step's rows not yet handed out
        self.next_id = 0  # the global id of ready's first row

    def start_pass(self, epoch: int) -> None:
        self.epoch = epoch
        self.pass_stats = PretrainStats(streamed=True, rows_per_step=self.stats.rows_per_step)
        self.cutter = RowCutter(self.max_length, self.tokenizer.eos_token_id)
        self.cut: deque[list[int]] = deque()  # rows cut, not yet through the shuffle buffer
        self.shuffle = ShuffleBuffer(self.shuffle_buffer, epoch_rng(self.seed, epoch))
        self.drained: Optional[deque[list[int]]] = None  # once the pass's records are read: the buffer's last rows
        self.held: list[list[int]] = []  # rows of the step being collected
        self.source: Optional[Iterator[tuple[int, str]]] = None  # opened at pass_stats.records when needed

    def state_dict(self) -> dict[str, Any]:
        """The position at the end of the current step (rows left in `ready` are other ranks' share of it), the
        same on every rank. Plain values and int32 tensors, loadable with weights_only=True."""
        def table(rows) -> torch.Tensor:
            return torch.tensor(list(rows), dtype=torch.int32).reshape(-1, self.max_length)

        draining = self.drained is not None
        return {"next_id": self.next_id + len(self.ready), "epoch": self.epoch, "pass": asdict(self.pass_stats),
                "last_pass": asdict(self.stats), "rows_read": self.rows_read,
                "cutter": torch.tensor(self.cutter.pending, dtype=torch.int32), "cut": table(self.cut),
                "buffer": table(self.drained if draining else self.shuffle.items), "draining": draining,
                "rng": self.shuffle.rng.getstate(), "held": table(self.held)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start_pass(state["epoch"])
        self.pass_stats, self.stats = PretrainStats(**state["pass"]), PretrainStats(**state["last_pass"])
        self.rows_read = state["rows_read"]
        self.cutter.pending = state["cutter"].tolist()
        self.cut = deque(state["cut"].tolist())
        if state["draining"]:
            self.drained = deque(state["buffer"].tolist())
        else:
            self.shuffle.items = state["buffer"].tolist()
        self.shuffle.rng.setstate(state["rng"])
        self.held = state["held"].tolist()
        self.ready, self.next_id = deque(), state["next_id"]

    def read_pass(self) -> PretrainStats:
        """The statistics of one whole pass, read from the start (rows are cut and counted, not kept); the position
        is back at the run's first row afterwards. What `plan` counts a stream with."""
        self.restart()
        while self.cut_row() is not None:
            self.cut.clear()
        stats = self.pass_stats
        self.restart()
        return stats

    # --- producing rows: cut, shuffled, gathered into steps

    def cut_row(self) -> Optional[list[int]]:
        """The next row cut from this pass's records, or None when they are all read."""
        while not self.cut:
            if self.source is None:
                self.source = self.texts(self.pass_stats.records)
            batch = list(islice(self.source, TOKENIZE_BATCH))
            stats = self.pass_stats
            if not batch:
                stats.tail_tokens = self.cutter.tail
                return None
            stats.records += len(batch)
            train_texts = [text for number, text in batch if not held_out(number, self.val_every)]
            stats.held_out += len(batch) - len(train_texts)
            for ids in tokenize(self.tokenizer, train_texts):
                stats.empty += not ids
                stats.tokens += len(ids) + 1 if ids else 0
                rows = self.cutter.add(ids)
                stats.rows += len(rows)
                self.rows_read += len(rows)
                self.cut.extend(rows)
        return self.cut.popleft()

    def shuffled_row(self) -> Optional[list[int]]:
        """The next row out of the shuffle buffer (buffer_shuffle, one row at a time); None at the end of the pass."""
        while self.drained is None:
            row = self.cut_row()
            if row is None:
                self.drained = deque(self.shuffle.drain())
            elif (out := self.shuffle.push(row)) is not None:
                return out
        return self.drained.popleft() if self.drained else None

    def next_step(self) -> None:
        """Gather the next step's rows into `ready`. A pass's last partial step is dropped; the next pass begins."""
        step_rows = self.pass_stats.rows_per_step
        while len(self.held) < step_rows:
            row = self.shuffled_row()
            if row is not None:
                self.held.append(row)
                continue
            stats = self.pass_stats
            if stats.steps == 0:
                raise UserError(f"dataset_path: one optimiser step needs {step_rows} rows of {self.max_length} tokens "
                                f"but a pass over the data makes {stats.rows}; lower batch_size, "
                                f"gradient_accumulation_steps or max_length")
            self.stats = stats
            self.log(f"pass {self.epoch + 1} over the stream ended: " + stats.describe("train").removeprefix("train: "))
            self.start_pass(self.epoch + 1)
        self.ready.extend(self.held)
        self.held = []

    def rows(self, ids: list[int]) -> list[list[int]]:
        """Rows by global id, ascending. A row behind the position restarts the run's sequence from the beginning."""
        out = []
        for global_id in ids:
            if global_id < self.next_id:
                self.restart()
            while self.next_id <= global_id:
                if not self.ready:
                    self.next_step()
                row = self.ready.popleft()
                self.next_id += 1
            out.append(row)
        return out


TOKENIZE_BATCH = 256


def batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    # verbose=False: a record longer than the tokenizer's model_max_length is expected here; it is cut into rows.
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


# ---------------------------------------------------------------- loading

def _tokenize_records(batch, indices, tokenizer, column: str, val_every: int) -> dict[str, list]:
    texts = [t or "" for t in batch[column]]
    return {"input_ids": tokenize(tokenizer, texts), "held_out": [held_out(i, val_every) for i in indices]}


def tokenized_records(config: RawTextSettings, tokenizer, val_every: int):
    """`streaming: false`: every record tokenised by datasets.map (cached, parallel), in stored order."""
    assert config.dataset_path is not None  # validate() refuses a config without it
    files = local_text_files(config.dataset_path)
    ds = load_table(config.dataset_path, config.revision, None if files is None else [str(f) for f in files],
                    "fix or remove the line")
    column = text_column(ds, config.dataset_path, config.text_field)
    return ds.map(_tokenize_records, batched=True, batch_size=TOKENIZE_BATCH, with_indices=True,
                  remove_columns=ds.column_names, num_proc=effective_num_proc(config, len(ds)),
                  fn_kwargs={"tokenizer": tokenizer, "column": column, "val_every": val_every}, desc="tokenizing")


def validation_rows(token_lists: Iterable[list[int]], max_length: int, eos_id: int, limit: int) -> list[list[int]]:
    cutter, rows = RowCutter(max_length, eos_id), []
    for ids in token_lists:
        rows.extend(cutter.add(ids))
        if len(rows) >= limit:
            break
    return rows[:limit]


def validation_dataset(rows: list[list[int]]):
    import datasets

    labels = [row_labels(row) for row in rows]
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "labels": datasets.List(datasets.Value("int64"))})
    return datasets.Dataset.from_dict({"input_ids": rows, "labels": labels}, features=features)


# Validation rows kept when eval_steps does not bound them: held-out records past this are read by neither split.
MAX_VALIDATION_ROWS = 1024


def load_pretrain_data(config: RawTextSettings, tokenizer, log: Callable[[str], Any] = print, *, world_size: int):
    """Same shape as sft.load_data: ((train rows, validation dataset), (train stats, validation stats)).
    `world_size` is the number of processes training runs on."""
    val_every = validation_stride(config.val_fraction)
    # evaluate_loss reads at most eval_steps global batches of batch_size x processes rows.
    limit = config.eval_steps * config.batch_size * world_size if config.eval_steps else MAX_VALIDATION_ROWS
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("tokenizer_name: the tokenizer has no EOS token to join texts with; use one that has")
    val_stats = PretrainStats()
    store: StreamedRows | MaterializedRows
    if config.streaming:
        dataset_path = config.dataset_path
        assert dataset_path is not None  # validate() refuses a config without it

        def numbered_texts(start: int = 0) -> Iterator[tuple[int, str]]:
            return zip(count(start), iter_texts(dataset_path, config.revision, config.text_field, start=start))

        store = StreamedRows(numbered_texts, tokenizer, config.max_length, config.seed, config.shuffle_buffer,
                             val_every, log)
        held_texts = (text for number, text in numbered_texts() if held_out(number, val_every))
        held = (ids for batch in batched(held_texts, TOKENIZE_BATCH) for ids in tokenize(tokenizer, batch))
        val = validation_rows(held, config.max_length, eos, limit) if val_every else []
        train_stats = store.stats
    else:
        records = tokenized_records(config, tokenizer, val_every)
        train_lists: list[list[int]] = []
        held_lists: list[list[int]] = []
        for batch in records.iter(batch_size=4096):
            for ids, is_held in zip(batch["input_ids"], batch["held_out"]):
                (held_lists if is_held else train_lists).append(ids)
        tokens = joined_tokens(train_lists, eos)
        train_stats = PretrainStats(records=len(records), held_out=len(held_lists),
                                    empty=sum(not ids for ids in train_lists), tokens=len(tokens))
        store = MaterializedRows(tokens, config.max_length, config.seed, config.shuffle_buffer, train_stats, log)
        val = validation_rows(held_lists, config.max_length, eos, limit)
    val_stats.rows, val_stats.tokens = len(val), len(val) * config.max_length
    return (store, validation_dataset(val)), (train_stats, val_stats)
