"""`gpt4all-training inference`: per-example loss, embeddings and the scores the config asks for (ifd, base_model,
ifd_model, checker, outliers) over the training data, on N processes."""

from __future__ import annotations

import argparse
import dataclasses

from gpt4all_training.analysis.inference import SPLIT_KEYS, run_inference
from gpt4all_training.cli.config_options import add_config_arguments
from gpt4all_training.config.loader import load_config, parse_overrides, read_yaml
from gpt4all_training.config.schemas import InferenceConfig
from gpt4all_training.model.loading import training_run_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, InferenceConfig, "inference config YAML (configs/inference/*.yaml)")


def execute(args: argparse.Namespace) -> None:
    config = load_config(args.config, args.overrides, cls=InferenceConfig)
    written = set(read_yaml(args.config) if args.config else {}) | set(parse_overrides(args.overrides))
    run_inference(with_training_split(config, written))


def run(args: argparse.Namespace) -> int:
    execute(args)
    return 0


def with_training_split(config: InferenceConfig, written: set[str]) -> InferenceConfig:
    """`config` with the split settings (SPLIT_KEYS) that neither its file nor the command line wrote taken from the
    training run that wrote the model (its config.yaml in final/ or step_N/), so that `split` is the run's own. A
    value the user wrote stays, and one that contradicts the run is refused in one line by run_inference
    (analysis/inference.check_training_split)."""
    assert config.model_name is not None  # validate() refuses a config without it
    found = training_run_config(config.model_name)
    if found is None:
        return config
    _, run_values = found
    return dataclasses.replace(config, **{key: run_values[key] for key in SPLIT_KEYS
                                          if key in run_values and key not in written})
