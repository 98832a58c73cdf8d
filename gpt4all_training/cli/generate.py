"""`gpt4all-training generate`: answer one prompt, a file of prompts (as JSONL), or standard input line by line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from gpt4all_training.cli.config_options import add_config_arguments
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import GenerateConfig
from gpt4all_training.generation.generate import load_generator, read_prompts_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, GenerateConfig, "generation config YAML (configs/generate/*.yaml)")
    parser.add_argument("--prompt", help="one prompt to answer")
    parser.add_argument("--prompts-file", help="prompts, one per line or JSONL with 'prompt'; prints JSONL")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides, cls=GenerateConfig, check=None)
    # A flag wins over the config's prompt or prompts_file, and replaces both.
    if args.prompt is not None:
        config.prompt, config.prompts_file = args.prompt, None
    if args.prompts_file is not None:
        config.prompts_file, config.prompt = args.prompts_file, None
    validate(config)
    prompts = read_prompts_file(config.prompts_file) if config.prompts_file else None
    answer = load_generator(config)
    if config.prompt is not None:
        print(answer([config.prompt])[0])
    elif prompts is not None:
        for prompt, response in zip(prompts, answer(prompts)):
            print(json.dumps({"prompt": prompt, "response": response}, ensure_ascii=False))
    else:
        interactive(answer)
    return 0


def interactive(answer: Callable[[list[str]], list[str]]) -> None:
    """Answer standard input line by line; a terminal gets a '> ' prompt, a pipe does not."""
    tty = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if tty else "")
        except EOFError:
            break
        if line.strip():
            print(answer([line.strip()])[0], flush=True)
