"""The tokenized fine-tuning data, cached: a second start with the same inputs loads the tokenized splits instead of
tokenizing the records again.

An entry's key is the SHA-256 of everything that decides the tokens:
- the records' content (records_fingerprint: the digest a resume compares, so a moved file is the same data and a
  Hub dataset is identified by the data its revision holds);
- the tokenizer: its serialized vocabulary, merges, normalizer, pre-tokenizer, post-processor and added tokens, its
  special tokens, its chat template, and how it encodes a probe;
- the config's data settings: the objective (sft examples or dpo pairs), every field of the examples and prompt
  blocks (max_length, prompt_template, the split's val_fraction and seed, train_turns, and whatever masking option
  joins them), but num_proc, which only says how many processes tokenize;
- the code: the source of the data package, and the versions of transformers, tokenizers and datasets.
Any change gives another key: a miss, and a new entry.

One process prepares an entry; the others wait for it. Each start takes the entry's lock (`<key>.lock` beside it, an
operating-system file lock, released when the process ends however it ends) before it looks: the first one finds
nothing, tokenizes and writes the entry while it holds the lock; every other process that asks for the same entry
meanwhile (the other ranks of a torchrun, accelerate or DeepSpeed launch on that machine, a `check` or a second run
started beside it) waits on the lock, then finds the entry whole and memory-maps it. They wait on a file, not on a
collective, so a preparation of any length never meets the launch's collective timeout (NCCL's 10 minutes by
default). A cache folder that cannot hold the lock file is one that cannot hold an entry either: each process then
tokenizes on its own, as when the entry cannot be written.

An entry is the folder `<cache_dir>/<key>/`: the kept train and validation splits (`Dataset.save_to_disk`), their
statistics (`stats.json`) and, written last, a `COMPLETE` marker that lists every file's SHA-256 (`files.py`). It is
written as `<key>.partial-<random>/` and renamed, so a crash never leaves an entry that looks whole; an entry
without its marker or with a file that no longer matches it is reported, deleted and rebuilt. Each start prints one
line with `cache hit` or `cache miss`.

An entry may also hold arrays computed from its splits by a model (dpo's precomputed reference log-probabilities),
each set in a folder of its own inside the entry, named by what else decides them, written and checked the same way
(`write_arrays`, `load_arrays`). They go when their entry goes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gpt4all_training.config.blocks import Examples, PromptFormat
from gpt4all_training.data.settings import CachedDataSettings, CacheLocation
from gpt4all_training.data.sft import DataStats
from gpt4all_training.files import marker_problem, new_folder
from gpt4all_training.run_folder import TOKENIZED_DIR

SPLITS = ("train", "validation")
# Examples fields that do not change what tokenization produces.
NOT_DECIDING = frozenset({"num_proc"})
PROBE = ["Hello world\n", " a b", "<|endoftext|><|im_start|>"]


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 of what decides how `tokenizer` encodes text and renders prompts."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # Without the padding and truncation the last call left in the backend: they decide no stored token.
        model = json.dumps({key: value for key, value in json.loads(backend.to_str()).items()
                            if key not in ("padding", "truncation")}, sort_keys=True)
    else:
        model = json.dumps(sorted(tokenizer.get_vocab().items()))
    described = {"class": type(tokenizer).__name__, "model": model, "chat_template": tokenizer.chat_template,
                 "special_tokens": tokenizer.special_tokens_map,
                 "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
                 "probe": tokenizer(PROBE)["input_ids"]}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


def data_settings(config: CachedDataSettings) -> dict[str, Any]:
    """The config's fields that decide the tokens (see the module docstring)."""
    fields = ["objective", *(f.name for block in (Examples, PromptFormat) for f in dataclasses.fields(block))]
    return {name: getattr(config, name) for name in fields if name not in NOT_DECIDING}


def code_version() -> str:
    """SHA-256 of the data package's source and the library versions that tokenize and store the splits."""
    import datasets
    import tokenizers
    import transformers

    digest = hashlib.sha256(f"{transformers.__version__} {tokenizers.__version__} {datasets.__version__}".encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


def cache_key(config: CachedDataSettings, tokenizer, records_digest: str) -> str:
    parts = {"records": records_digest, "tokenizer": tokenizer_fingerprint(tokenizer),
             "settings": data_settings(config), "code": code_version()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cache_entry(config: CachedDataSettings, tokenizer, records_digest: str) -> Path:
    """The folder of the entry these inputs would have."""
    return cache_root(config) / cache_key(config, tokenizer, records_digest)


def cache_root(config: CacheLocation) -> Path:
    """cache_dir, or output_dir/tokenized: a restart or resume of the run finds it without any setting."""
    return Path(config.cache_dir).expanduser() if config.cache_dir else Path(config.output_dir) / TOKENIZED_DIR


def entry_problem(entry: Path) -> str | None:
    """None when `entry` is a complete, intact entry; otherwise why not."""
    return marker_problem(entry)


def load_entry(entry: Path):
    import datasets

    stats = json.loads((entry / "stats.json").read_text(encoding="utf-8"))
    splits = tuple(datasets.load_from_disk(str(entry / name)) for name in SPLITS)
    return splits, tuple(DataStats(**stats[name]) for name in SPLITS)


def write_entry(entry: Path, splits, stats) -> None:
    """Write the entry beside its final place and rename it there; another process that wrote the same entry first
    wins (the contents are equal)."""
    def write(tmp: Path) -> None:
        for name, split in zip(SPLITS, splits):
            # An empty split (val_fraction: 0) would be saved as no shard at all, which load_from_disk cannot read.
            split.save_to_disk(str(tmp / name), num_shards=None if len(split) else 1)
        (tmp / "stats.json").write_text(json.dumps({name: dataclasses.asdict(s) for name, s in zip(SPLITS, stats)}),
                                        encoding="utf-8")

    write_complete(entry, write)


def write_complete(folder: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a folder of its own beside `folder`, then the COMPLETE marker listing every file's SHA-256,
    then the rename to `folder` (which fails, leaving the entry another process wrote first)."""
    with new_folder(folder) as tmp:
        write(tmp)


def write_arrays(folder: Path, arrays: dict[str, np.ndarray]) -> None:
    """Arrays as folder/<name>.npy, written as an entry is."""
    def write(tmp: Path) -> None:
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", array, allow_pickle=False)

    write_complete(folder, write)


def load_arrays(folder: Path) -> dict[str, np.ndarray]:
    """What write_arrays wrote to `folder` (check entry_problem first)."""
    return {path.stem: np.load(path, allow_pickle=False) for path in sorted(folder.glob("*.npy"))}


@contextlib.contextmanager
def preparing(entry: Path, log: Callable[[str], Any]):
    """Holds the lock of `entry` (see the module docstring), saying so when another process holds it first; holds
    nothing where the cache folder cannot be written."""
    from filelock import FileLock, Timeout

    lock = FileLock(f"{entry}.lock")
    held = True
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log(f"tokenized data: another process is preparing {entry}; waiting for it")
            lock.acquire()
    except OSError:
        held = False
    try:
        yield
    finally:
        if held:
            lock.release()


def cached_splits(config: CachedDataSettings, tokenizer, records_digest: str, build: Callable[[], tuple[tuple, tuple]],
                  log: Callable[[str], Any]) -> tuple[tuple, tuple]:
    """((train, val), (train_stats, val_stats)): from the cache entry of these inputs, or `build()` and saved as one,
    by one process at a time (`preparing`). A cache that cannot be written costs the next start a tokenization,
    never this run."""
    entry = cache_entry(config, tokenizer, records_digest)
    with preparing(entry, log):
        return entry_or_built(entry, build, log)


def entry_or_built(entry: Path, build: Callable[[], tuple[tuple, tuple]], log: Callable[[str], Any]
                   ) -> tuple[tuple, tuple]:
    if entry.is_dir():
        problem = entry_problem(entry)
        if problem is None:
            log(f"tokenized data: cache hit ({entry})")
            return load_entry(entry)
        reason = f"the entry was unusable ({problem}); rebuilt"
        shutil.rmtree(entry, ignore_errors=True)
    else:
        reason = "nothing cached for this data, tokenizer and settings"
    splits, stats = build()
    try:
        write_entry(entry, splits, stats)
        log(f"tokenized data: cache miss ({reason}); saved to {entry}")
    except OSError as exc:
        if entry_problem(entry) is None:  # written by another process meanwhile
            log(f"tokenized data: cache miss ({reason}); another process saved {entry}")
        else:
            log(f"tokenized data: cache miss ({reason}); not saved ({exc.strerror or type(exc).__name__})")
            return splits, stats
    # The entry's files, memory-mapped, as every later start reads them: the built splits reach their rows through
    # index mappings (the split, the drops), and every read of theirs would go through those again.
    return load_entry(entry)
