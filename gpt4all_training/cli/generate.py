"""`gpt4all-training generate`: answer one prompt, a file of prompts (as JSONL), conversations (`--messages`), or
standard input line by line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from gpt4all_training.cli.config_options import add_config_arguments
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import GenerateConfig
from gpt4all_training.generation.generate import load_generator, read_messages_file, read_prompts_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, GenerateConfig, "generation config YAML (configs/generate/*.yaml)")
    parser.add_argument("--prompt", help="one prompt to answer")
    parser.add_argument("--prompts-file", help="prompts, one per line or JSONL with 'prompt'; prints JSONL")
    parser.add_argument("--messages", help="a conversation to answer (.json: prints the reply) or JSONL of them "
                                           "(prints each with the reply appended)")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides, cls=GenerateConfig, check=None)
    # A flag wins over the config's prompt, prompts_file or messages_file, and replaces them.
    for flag, key in ((args.prompt, "prompt"), (args.prompts_file, "prompts_file"), (args.messages, "messages_file")):
        if flag is not None:
            config.prompt = config.prompts_file = config.messages_file = None
            setattr(config, key, flag)
    validate(config)
    prompts = read_prompts_file(config.prompts_file) if config.prompts_file else None
    conversations = read_messages_file(config.messages_file) if config.messages_file else None
    generator = load_generator(config)
    if config.prompt is not None:
        print(generator.answer([config.prompt])[0])
    elif prompts is not None:
        for prompt, response in zip(prompts, generator.answer(prompts)):
            print(json.dumps({"prompt": prompt, "response": response}, ensure_ascii=False))
    elif conversations is not None:
        replies = generator.reply(conversations)
        if config.messages_file.endswith(".json"):  # one conversation: its reply, as --prompt prints an answer
            print(replies[0])
        else:
            for messages, reply in zip(conversations, replies):
                print(json.dumps({"messages": [*messages, {"role": "assistant", "content": reply}]},
                                 ensure_ascii=False))
    else:
        interactive(generator.answer)
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
