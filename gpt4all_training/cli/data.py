"""`gpt4all-training data`: tokenize a training config's dataset; show examples and the split statistics, and dump
every example's ids and labels."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Optional

from gpt4all_training.cli.config_options import add_config_arguments
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.sft import TRAINED_MARKS, dump_examples, load_data, show_example
from gpt4all_training.errors import UserError
from gpt4all_training.files import writable_file
from gpt4all_training.model.loading import tokenizer_for
from gpt4all_training.paths import require_dataset
from gpt4all_training.training.objectives import objective_for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TrainConfig, "training config YAML", required=True)
    parser.add_argument("--show", type=int, default=3, help="print this many tokenized examples")
    parser.add_argument("--dump", metavar="FILE", help="write every example of both splits as JSONL: split, index, "
                                                       "input_ids, labels")


@dataclass
class Tokenized:
    tokenizer: Any
    train: Any  # the splits as load_data returns them
    val: Any
    train_stats: Any
    val_stats: Any
    dumped: Optional[int]  # examples written to --dump


def execute(args: argparse.Namespace) -> Tokenized:
    """The config's dataset tokenized as training reads it, both splits and their statistics; every example
    written to --dump when given."""
    config = load_config(args.config, args.overrides)
    if args.dump:
        writable_file("--dump", args.dump, example="examples.jsonl")  # before the tokenization
    objective = objective_for(config)
    if not objective.shows_examples:
        raise UserError(f"{args.config}: objective {objective.name}: `data` shows and dumps sft examples only; "
                        f"`plan` counts this objective's tokens and `check` tries a step of it")
    require_dataset(config.dataset_path)  # before the tokenizer, which may take a while to load
    tokenizer = tokenizer_for(config)
    (train, val), (train_stats, val_stats) = load_data(config, tokenizer)
    dumped = dump_examples({"train": train, "val": val}, args.dump) if args.dump else None
    return Tokenized(tokenizer, train, val, train_stats, val_stats, dumped)


def shown_rows(tokenized: Tokenized, show: int) -> Any:
    """The first `show` training examples, the ones `--show` prints."""
    return tokenized.train.select(range(min(show, len(tokenized.train))))


def run(args: argparse.Namespace) -> int:
    tokenized = execute(args)
    start, end = TRAINED_MARKS
    for row in shown_rows(tokenized, args.show):
        print(f"--- example {row['index']} ({row['n_trained']} trained tokens, between {start} and {end})")
        print(show_example(row, tokenized.tokenizer, colour=sys.stdout.isatty()))
    print(tokenized.train_stats.describe("train"))
    print(tokenized.val_stats.describe("validation"))
    if args.dump:
        print(f"{args.dump}: {tokenized.dumped} examples")
    return 0
