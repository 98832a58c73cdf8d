"""data/cache.py's lock: while one start prepares a cache entry, another start that asks for the same entry waits
for it (saying so) and then reads it, tokenizing nothing; a start that asks for another entry does not wait. Two
threads stand for two processes: each lock is a file lock on its own open file, which excludes another open file of
the same path in the same process as in another one."""

from __future__ import annotations

import threading

import pytest
from support.files import write_jsonl

from gpt4all_training.config.loader import load_config
from gpt4all_training.data import cache, sft

ROWS = [{"prompt": f"What is {i} times {i}?", "response": f"{i * i}.", "source": "t"} for i in range(40)]


@pytest.fixture
def config(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "data" / "squares_clean.jsonl", ROWS).parent
    return load_config(None, [f"model_name={tiny_model_dir}", f"dataset_path={data}", f"output_dir={tmp_path / 'run'}",
                              "max_length=32"])


def test_a_start_waits_for_the_one_preparing_its_entry_then_reads_it(config, tokenizer):
    started, release = threading.Event(), threading.Event()
    builds: list[str] = []
    lines: dict[str, list[str]] = {"first": [], "second": []}
    results: dict[str, tuple] = {}

    def build(name: str):
        def run():
            builds.append(name)
            started.set()
            assert release.wait(60)
            return sft.load_data(config, tokenizer)
        return run

    def start(name: str) -> None:
        results[name] = cache.cached_splits(config, tokenizer, "digest", build(name), lines[name].append)

    first = threading.Thread(target=start, args=("first",))
    first.start()
    assert started.wait(60)
    second = threading.Thread(target=start, args=("second",))
    second.start()
    second.join(1.0)
    assert second.is_alive()  # waiting on the lock while the first one tokenizes
    release.set()
    first.join(60)
    second.join(60)
    entry = cache.cache_entry(config, tokenizer, "digest")
    assert builds == ["first"]
    assert lines["first"] == [f"tokenized data: cache miss (nothing cached for this data, tokenizer and settings); "
                              f"saved to {entry}"]
    assert lines["second"] == [f"tokenized data: another process is preparing {entry}; waiting for it",
                               f"tokenized data: cache hit ({entry})"]
    (train, val), _ = results["second"]
    (first_train, first_val), _ = results["first"]
    assert train["input_ids"] == first_train["input_ids"] and val["index"] == first_val["index"]


def test_another_entry_is_prepared_without_waiting(config, tokenizer):
    """The lock is the entry's: a start for other data goes on while one entry is being prepared."""
    release = threading.Event()
    holder = threading.Thread(target=cache.cached_splits, args=(
        config, tokenizer, "held", lambda: (release.wait(60), sft.load_data(config, tokenizer))[1], lambda _: None))
    holder.start()
    lines: list[str] = []
    try:
        cache.cached_splits(config, tokenizer, "other", lambda: sft.load_data(config, tokenizer), lines.append)
    finally:
        release.set()
        holder.join(60)
    assert len(lines) == 1 and lines[0].startswith("tokenized data: cache miss")
