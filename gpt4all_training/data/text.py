"""Raw text for tokenizer training and pretraining (`objective: causal_lm`): records, rows, their order, the loss.

Records. They are read one at a time (a local JSONL file line by line, a Hub dataset with `streaming=True`), so a
corpus larger than memory is never loaded whole. A record's text is its `text_field`, or, when that is unset, its
`text` or `content` field (CodeParrot's name). A bad record is a UserError naming the file and line.

Rows, as CodeParrot's ConstantLengthDataset made them: each training record's tokens plus EOS are joined into one
sequence, cut into rows of exactly `max_length` tokens, with every token trained. Unlike CodeParrot:
- the rows of each pass (epoch) go through a shuffle buffer of `shuffle_buffer` rows, seeded by (seed, epoch);
- the position is a function of the optimiser step: step s trains global rows s*G .. s*G+G-1 (G = batch_size x
  processes x gradient_accumulation_steps) of the run's row sequence, each rank taking its share of every
  micro-batch as StepSampler does. So resuming at step s is exact, and a global step holds the same rows for
  every world size;
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

import json
import random
from collections import deque
from dataclasses import asdict, dataclass
from itertools import count, islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

import numpy as np
import torch

from gpt4all_training.errors import UserError

T = TypeVar("T")

TEXT_FIELDS = ("text", "content")


def local_text_files(dataset_path: str) -> Optional[list[Path]]:
    """The JSONL files a local `dataset_path` names (a file, or a folder's *.jsonl sorted), or None if not local."""
    path = Path(dataset_path).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise UserError(f"dataset_path: no *.jsonl files in {path}")
        return files
    if path.suffix in (".jsonl", ".json") or dataset_path.startswith((".", "/", "~")):
        raise UserError(f"dataset_path: {dataset_path} does not exist")
    return None


def iter_records(dataset_path: str, revision: Optional[str] = None, split: str = "train", start: int = 0
                 ) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) pairs in stored order from record number `start` on (the ones before it are skipped without
    being parsed); `where` is `file:line` or `dataset record N` for error messages."""
    files = local_text_files(dataset_path)
    if files is not None:
        skip = start
        for file in files:
            with open(file, "rb") as f:
                for number, raw in enumerate(f, start=1):
                    if not raw.strip():
                        continue
                    if skip:
                        skip -= 1
                        continue
                    try:
                        record = json.loads(raw.decode("utf-8"))
                    except UnicodeDecodeError:
                        raise UserError(f"{file}:{number}: not UTF-8 text; re-encode the file as UTF-8") from None
                    except json.JSONDecodeError as exc:
                        raise UserError(f"{file}:{number}: not valid JSON ({exc.msg}); fix or remove the line") \
                            from None
                    if not isinstance(record, dict):
                        raise UserError(f"{file}:{number}: expected a JSON object per line")
                    yield f"{file}:{number}", record
        return
    import datasets

    try:
        stream = datasets.load_dataset(dataset_path, revision=revision, split=split, streaming=True)
        for number, record in enumerate(stream.skip(start) if start else stream, start=start):
            yield f"{dataset_path} record {number}", record
    except (FileNotFoundError, ValueError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise UserError(f"dataset_path {dataset_path}: cannot load ({str(exc).splitlines()[0][:200]})") from None


def record_text(where: str, record: dict[str, Any], text_field: Optional[str]) -> str:
    """The record's text: `text_field`, or the first of `text`/`content` when unset."""
    names = (text_field,) if text_field else TEXT_FIELDS
    for name in names:
        if name in record:
            value = record[name]
            if value is None:
                return ""  # a null text is an empty one, as a datasets column reads it
            if not isinstance(value, str):
                raise UserError(f"{where}: field {name!r} is {type(value).__name__}, not text")
            return value
    wanted = f"field {text_field!r}" if text_field else "a 'text' or 'content' field"
    raise UserError(f"{where}: no {wanted} (fields: {', '.join(map(str, record)) or 'none'}); set text_field")


def iter_texts(dataset_path: str, revision: Optional[str] = None, text_field: Optional[str] = None,
               split: str = "train", start: int = 0) -> Iterator[str]:
    """Every record's text from record `start` on, in stored order (empty texts included: callers decide what they
    mean)."""
    for where, record in iter_records(dataset_path, revision, split, start):
        yield record_text(where, record, text_field)


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
    return random.Random(seed * 1_000_003 + epoch)


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


def training_batch(rows: list[list[int]] | np.ndarray) -> dict[str, torch.Tensor]:
    """Constant-length rows as a micro-batch: every token trained (label 0 is IGNORE, as data.py's convention)."""
    from gpt4all_training.data.sft import IGNORE

    input_ids = torch.as_tensor(np.asarray(rows, dtype=np.int64))
    labels = input_ids.clone()
    labels[:, 0] = IGNORE
    return {"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones_like(input_ids)}


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


# ---------------------------------------------------------------- the sampler: step -> global row ids

@dataclass(frozen=True)
class RowSampler:
    """StepSampler's interface over rows: step s trains the run's global rows s*G .. s*G+G-1.

    Micro-batch j of the step is its j-th slice of batch_size x world_size rows; rank r takes the r-th batch_size
    of it. So a global step holds the same rows for every world size, and the step is the whole position.
    """

    store: Any
    batch_size: int
    world_size: int = 1
    rank: int = 0
    grad_accum: int = 1
    seed: int = 0
    max_steps: Optional[int] = None
    lengths = None  # rows are never grouped by length

    def __post_init__(self) -> None:
        steps = self.store.configure(self.examples_per_step)
        if steps is None and not self.max_steps:
            raise UserError("max_steps: streaming: true with objective causal_lm needs max_steps (a stream's length "
                            "is unknown until it ends)")

    @property
    def examples_per_step(self) -> int:
        return self.batch_size * self.world_size * self.grad_accum

    @property
    def n_examples(self) -> int:
        """Rows per pass when the loader knows them up front; 0 for a stream (the same before and after a resume)."""
        return 0 if self.store.streaming else len(self.store)

    @property
    def steps_per_epoch(self) -> int:
        """Steps per pass. A stream's passes are unknown in advance: there, the run (max_steps) counts as one."""
        return self.store.stats.steps if not self.store.streaming else self.max_steps

    def step_indices(self, step: int) -> list[list[int]]:
        start = step * self.examples_per_step
        micro = self.batch_size * self.world_size
        return [list(range(start + j * micro + self.rank * self.batch_size,
                           start + j * micro + (self.rank + 1) * self.batch_size)) for j in range(self.grad_accum)]

    def data_state(self) -> Optional[dict[str, Any]]:
        """A stream's position, which the step alone cannot give back without reading the stream again."""
        return self.store.state_dict() if self.store.streaming else None

    def load_data_state(self, state: dict[str, Any]) -> None:
        self.store.load_state_dict(state)


def fetch_rows(store, ids: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """The loop's `fetch(dataset, indices, pad_id)` for rows (which need no padding)."""
    return training_batch(store.rows(ids))


# ---------------------------------------------------------------- loading

def text_column(ds, dataset_path: str, text_field: Optional[str]) -> str:
    names = (text_field,) if text_field else TEXT_FIELDS
    for name in names:
        if name in ds.column_names:
            dtype = getattr(ds.features[name], "dtype", None)
            if dtype not in ("string", "large_string"):
                raise UserError(f"dataset_path {dataset_path}: field {name!r} holds {dtype or 'non-text values'}, "
                                f"not text; set text_field")
            return name
    wanted = f"field {text_field!r}" if text_field else "a 'text' or 'content' field"
    raise UserError(f"dataset_path {dataset_path}: no {wanted} (fields: {', '.join(ds.column_names)}); set text_field")


def _tokenize_records(batch, indices, tokenizer, column: str, val_every: int) -> dict[str, list]:
    texts = [t or "" for t in batch[column]]
    return {"input_ids": tokenize(tokenizer, texts), "held_out": [held_out(i, val_every) for i in indices]}


def tokenized_records(config, tokenizer, val_every: int):
    """`streaming: false`: every record tokenised by datasets.map (cached, parallel), in stored order."""
    import datasets

    from gpt4all_training.data.sft import effective_num_proc, unreadable_jsonl

    files = local_text_files(config.dataset_path)
    try:
        if files is not None:
            ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train")
        else:
            ds = datasets.load_dataset(config.dataset_path, revision=config.revision, split="train")
    except (FileNotFoundError, ValueError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise UserError(f"dataset_path {config.dataset_path}: cannot load ({str(exc).splitlines()[0][:200]})") \
            from None
    except datasets.exceptions.DatasetGenerationError as exc:
        raise unreadable_jsonl(config.dataset_path, [str(f) for f in files or []], exc, "fix or remove the line") \
            from None
    column = text_column(ds, config.dataset_path, config.text_field)
    return ds.map(_tokenize_records, batched=True, batch_size=TOKENIZE_BATCH, with_indices=True,
                  remove_columns=ds.column_names, num_proc=effective_num_proc(config, len(ds)),
                  fn_kwargs={"tokenizer": tokenizer, "column": column, "val_every": val_every}, desc="tokenising")


def validation_rows(token_lists: Iterable[list[int]], max_length: int, eos_id: int, limit: int) -> list[list[int]]:
    cutter, rows = RowCutter(max_length, eos_id), []
    for ids in token_lists:
        rows.extend(cutter.add(ids))
        if len(rows) >= limit:
            break
    return rows[:limit]


def validation_dataset(rows: list[list[int]]):
    import datasets

    from gpt4all_training.data.sft import IGNORE

    labels = [[IGNORE, *row[1:]] for row in rows]
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "labels": datasets.List(datasets.Value("int64"))})
    return datasets.Dataset.from_dict({"input_ids": rows, "labels": labels}, features=features)


# Validation rows kept when eval_steps does not bound them: held-out records past this are read by neither split.
MAX_VALIDATION_ROWS = 1024


def load_pretrain_data(config, tokenizer, log: Callable[[str], Any] = print):
    """Same shape as data.load_data: ((train rows, validation dataset), (train stats, validation stats))."""
    from gpt4all_training.backends.accelerate import launched_world_size

    val_every = validation_stride(config.val_fraction)
    # evaluate_loss reads at most eval_steps global batches of batch_size x processes rows.
    limit = config.eval_steps * config.batch_size * launched_world_size() if config.eval_steps else MAX_VALIDATION_ROWS
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("tokenizer_name: the tokenizer has no EOS token to join texts with; use one that has")
    val_stats = PretrainStats()
    if config.streaming:
        def numbered_texts(start: int = 0) -> Iterator[tuple[int, str]]:
            return zip(count(start), iter_texts(config.dataset_path, config.revision, config.text_field, start=start))

        store = StreamedRows(numbered_texts, tokenizer, config.max_length, config.seed, config.shuffle_buffer,
                             val_every, log)
        held_texts = (text for number, text in numbered_texts() if held_out(number, val_every))
        held = (ids for batch in batched(held_texts, TOKENIZE_BATCH) for ids in tokenize(tokenizer, batch))
        val = validation_rows(held, config.max_length, eos, limit) if val_every else []
        train_stats = store.stats
    else:
        records = tokenized_records(config, tokenizer, val_every)
        train_lists, held_lists = [], []
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


# ---------------------------------------------------------------- the loss (z-loss, last-position loss)

class CausalLMLoss:
    """The loop's `loss_fn(model, batch)`: the sum of next-token NLL over trained positions, like
    loss.token_loss_sum, plus `z_loss` x the sum of log(Z)^2 (mesh-transformer-jax's auxiliary loss, which keeps
    the softmax normaliser near 1). The loop divides by the step's trained tokens, so the z-term is a mean too.

    It also keeps, as metrics, the loss at the final position of each row (`train/last_loss`, the prediction with
    the most context) and the z-term (`train/z_loss`), summed over the steps since they were last read. Both terms
    go through the chunked head of loss.py, so only each row's last logits are built whole besides.
    """

    def __init__(self, z_loss: float = 0.0) -> None:
        self.z_loss = z_loss
        self.window = torch.zeros(4, dtype=torch.float64)  # last-loss sum, rows, log(Z)^2 sum, trained positions

    def __call__(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch.nn.functional as F

        from gpt4all_training.data.sft import IGNORE
        from gpt4all_training.training.loss import chunked_loss_and_z, head_removed, model_inputs, output_head

        targets = batch["labels"][:, 1:]
        found = output_head(model)
        if found is None:
            hidden, head = None, None
            logits_all = model(**model_inputs(batch)).logits[:, :-1].float()
        else:
            parent, name, head = found
            with head_removed(parent, name):
                hidden = model(**model_inputs(batch)).logits[:, :-1]
        targets = targets.to((hidden if hidden is not None else logits_all).device)
        trained = targets != IGNORE
        if hidden is not None:
            loss, z_sum = chunked_loss_and_z(hidden[trained], head, targets[trained], self.z_loss)
        else:
            logits = logits_all[trained]
            lse = torch.logsumexp(logits, dim=-1)
            z_sum = (lse * lse).sum()
            loss = (lse - logits.gather(1, targets[trained][:, None]).squeeze(1)).sum() + self.z_loss * z_sum
        with torch.no_grad():
            last = (head(hidden[:, -1]).float() if hidden is not None else logits_all[:, -1])
            last_targets = targets[:, -1]
            last_sum = F.cross_entropy(last, last_targets, ignore_index=IGNORE, reduction="sum")
            self.window += torch.stack([last_sum.double().cpu(), (last_targets != IGNORE).sum().double().cpu(),
                                        z_sum.detach().double().cpu(), trained.sum().double().cpu()])
        return loss

    def window_metrics(self, accelerator) -> dict[str, float]:
        """The metrics since the last call, over all ranks (a collective: every rank calls it), then reset."""
        totals = accelerator.reduce(self.window.to(accelerator.device), reduction="sum").cpu()
        self.window.zero_()
        metrics = {"train/last_loss": (totals[0] / totals[1]).item() if totals[1] else float("nan")}
        if self.z_loss:
            metrics["train/z_loss"] = (self.z_loss * totals[2] / totals[3]).item() if totals[3] else float("nan")
        return metrics
