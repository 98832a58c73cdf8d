"""`gpt4all-training tokenizer`: train a byte-level BPE tokenizer, save it, and print its held-out statistics."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpt4all_training.cli.config_options import add_config_arguments
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import TokenizerConfig
from gpt4all_training.data.bpe import build_tokenizer, save_tokenizer
from gpt4all_training.files import writable_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TokenizerConfig, "tokenizer config YAML (see configs/tokenizer/)",
                         overrides_help="key=value overrides, e.g. vocab_size=8192")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides, cls=TokenizerConfig)
    writable_folder("output_dir", config.output_dir)  # before the records are read and the merges learned
    tokenizer, stats = build_tokenizer(config)
    output_dir = Path(config.output_dir)
    save_tokenizer(tokenizer, stats, output_dir)
    print(f"tokenizer: {tokenizer.vocab_size:,} tokens, saved to {output_dir} "
          f"(load with AutoTokenizer.from_pretrained('{output_dir}'))")
    if stats is None:
        print("statistics: no held-out records (heldout_size: 0, or too little data)")
    else:
        print(stats.describe())
    return 0
