"""Run `gpt4all-training train ARGS`, writing one line to $PREPARATIONS_FILE (`<pid> <split rows>`) each time this
process tokenizes records (data/sft.py's tokenize_dataset, once per preparation). Works as the script of
`python` and of `torchrun`; the training code itself is unchanged."""

from __future__ import annotations

import os
import sys

import gpt4all_training.data.sft as sft
from gpt4all_training.cli.main import main

tokenize_dataset = sft.tokenize_dataset


def counted(ds, *args, **kwargs):
    with open(os.environ["PREPARATIONS_FILE"], "a", encoding="utf-8") as out:
        out.write(f"{os.getpid()} {len(ds)}\n")
    return tokenize_dataset(ds, *args, **kwargs)


sft.tokenize_dataset = counted

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
