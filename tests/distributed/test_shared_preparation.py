"""One preparation per dataset under a launcher: torchrun starts 2 gloo processes of `train` on the tiny GPT-J, and
exactly one of them tokenizes the records (data/cache.py's lock); the other waits on the lock, then reads its cache
entry. Counted by tests/distributed/counted_train.py, which records every tokenization with the process that ran it.
Two processes, the fewest that can both tokenize: each costs seconds of interpreter start-up on a 2-core machine, and
the lock is the same for any count (a process that skipped it would tokenize too)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.files import write_config
from support.launch import explain, run_train, torchrun

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]
PROCESSES = 2


def test_launched_processes_tokenize_the_records_once(tiny_model_dir, clean_dolly, tmp_path):
    config = write_config(tmp_path, {
        "model_name": str(tiny_model_dir), "dataset_path": str(clean_dolly), "max_length": 64, "batch_size": 1,
        "max_steps": 1, "eval_every": None, "save_every": None, "val_fraction": 0.05, "seed": 7, "num_proc": 1,
        "report_to": ["jsonl"], "dtype": "float32"})
    preparations = tmp_path / "preparations.txt"
    result = run_train(config, tmp_path / "run", script=Path(__file__).with_name("counted_train.py"),
                       launcher=torchrun(PROCESSES), env={"PREPARATIONS_FILE": str(preparations)})
    assert result.returncode == 0, explain(result)
    lines = [line.split() for line in preparations.read_text().splitlines()]
    assert [rows for _, rows in lines] == ["619"], lines  # the clean records, tokenized once, then split
    assert "tokenized data: cache miss" in result.stdout or "tokenized data: cache hit" in result.stdout
