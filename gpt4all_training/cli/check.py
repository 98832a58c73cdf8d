"""`gpt4all-training check`: pre-flight checks of a training config before a long run; exit 1 if any fails."""

from __future__ import annotations

import argparse
from typing import Callable

from gpt4all_training.cli.config_options import add_config_arguments
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.preflight.check import Outcome, run_checks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TrainConfig, "training config YAML", required=True)


def execute(args: argparse.Namespace, report: Callable[[str], None]) -> list[Outcome]:
    """The checks' outcomes; `report(line)` says each as it finishes."""
    return run_checks(args.config, args.overrides, report=report)


def run(args: argparse.Namespace) -> int:
    outcomes = execute(args, lambda line: print(line, flush=True))
    failures = sum(not o.ok for o in outcomes)
    print(f"{len(outcomes) - failures} passed, {failures} failed" if failures else f"all {len(outcomes)} checks passed")
    return 1 if failures else 0
