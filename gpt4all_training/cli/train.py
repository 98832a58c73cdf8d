"""`gpt4all-training train --config c.yaml [key=value ...]`: fine-tune or pretrain, under python, accelerate launch or
torchrun. The one place a training process ends: with the run's exit code, hard where the backend needs it."""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

from gpt4all_training.backends.accelerate import build_backend
from gpt4all_training.cli.config_options import add_config_arguments
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import TrainingError
from gpt4all_training.evaluation.train_tasks import TaskEvaluator, check_eval_tasks, evaluate_final
from gpt4all_training.training.loop import train
from gpt4all_training.training.precision import resolve_dtype


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TrainConfig, "training config YAML (see configs/train/)", required=True,
                         overrides_help="key=value overrides, e.g. lr=1e-4 max_steps=5")


def lost_peer_error(exc: RuntimeError) -> TrainingError | None:
    """A collective that failed because another rank died (gloo: "Connection closed by peer") or stopped answering
    for ddp_timeout_s, as one line; None for any other error, which keeps its traceback."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    first = (str(exc).splitlines() or [""])[0]
    if not isinstance(exc, dist.DistError) and "gloo/" not in first:
        return None
    reason = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0][:200]  # without gloo's "[file.cc:12]" and advice
    return TrainingError(f"rank {dist.get_rank()} of {dist.get_world_size()}: another process of this run died or "
                         f"stopped answering ({reason}); find the first error in the other ranks' output, then "
                         f"rerun with resume=auto to continue from the last checkpoint")


def run(args: argparse.Namespace) -> int:
    said: list[str] = []  # train() says them after its first line, which says where the run starts
    config = resolve_dtype(load_config(args.config, args.overrides), said.append)  # the backend's precision
    check_eval_tasks(config)  # a misspelt eval task fails now, not after the run
    try:
        backend = build_backend(config)
        summary = train(config, backend, [TaskEvaluator] if config.eval_tasks_every else [], said)
    except RuntimeError as exc:
        lost = lost_peer_error(exc)
        if lost is None:
            raise
        raise lost from None
    code = summary.get("exit_code", 0)  # 128 + signal when SIGTERM/SIGINT stopped it early with a checkpoint
    if code == 0 and config.eval_tasks and backend.is_main_process and not summary.get("already_finished"):
        evaluate_final(config, summary)
    if backend.exit_hard:  # everything is written; leave without the interpreter teardown that can abort
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
