"""`gpt4all-training inference`: per-example loss and embeddings over the training data, on N processes."""

from __future__ import annotations

import argparse

from gpt4all_training.analysis.inference import run_inference
from gpt4all_training.cli.config_options import add_config_arguments
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import InferenceConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, InferenceConfig, "inference config YAML (configs/inference/*.yaml)")


def run(args: argparse.Namespace) -> int:
    run_inference(load_config(args.config, args.overrides, cls=InferenceConfig))
    return 0
