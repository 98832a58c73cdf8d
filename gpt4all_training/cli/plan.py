"""`gpt4all-training plan`: the step, memory and time arithmetic of a training config, without loading weights."""

from __future__ import annotations

import argparse

from gpt4all_training.cli.config_options import add_config_arguments
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.preflight.plan import ConfigOnlyPlan, Plan, make_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TrainConfig, "training config YAML", required=True)
    parser.add_argument("--gpus", type=int, default=1, help="processes the run will use (default 1)")
    parser.add_argument("--tokens-per-second", type=float, default=None,
                        help="throughput of the whole run, for the time estimate (default: measured by an earlier "
                             "run in output_dir, if any)")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="memory of one GPU in GiB: each estimate then says whether it fits")
    parser.add_argument("--config-only", action="store_true",
                        help="plan from the model's config.json alone: its memory per GPU and checkpoint size, "
                             "without reading the tokenizer or the data (no steps, tokens or time)")


def execute(args: argparse.Namespace) -> Plan | ConfigOnlyPlan:
    config = load_config(args.config, args.overrides)
    return make_plan(config, args.gpus, args.tokens_per_second, args.gpu_memory, args.config_only)


def run(args: argparse.Namespace) -> int:
    print(execute(args).describe())
    return 0
