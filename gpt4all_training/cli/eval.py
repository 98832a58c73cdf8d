"""`gpt4all-training eval --model PATH --tasks NAMES`: lm-evaluation-harness scores, written to DIR/results.json."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from gpt4all_training.errors import UserError, write_failure
from gpt4all_training.evaluation.harness import EvalSettings, evaluate
from gpt4all_training.evaluation.results import (RESULTS_FILE, comparison_table, interval_table, read_results,
                                                 results_table, write_results)
from gpt4all_training.files import writable_folder
from gpt4all_training.model.trained import DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a model folder, .gguf file, adapter folder, step_N/ checkpoint or Hub id")
    parser.add_argument("--tasks", required=True,
                        help="comma-separated harness task names, tags, groups or task YAML files "
                             "(e.g. gpt4all_offline with --include-path configs/eval)")
    parser.add_argument("--include-path", action="append", default=[], metavar="DIR",
                        help="a folder of task YAML files (repeatable)")
    parser.add_argument("--limit", type=int, help="score only the first N examples of each task")
    parser.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples; unset: each task's own")
    parser.add_argument("--batch-size", type=int, default=1, help="requests per forward pass (default 1)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when there is one")
    parser.add_argument("--seed", type=int,
                        help="one seed for Python, NumPy, torch and the few-shot sampler; unset: the harness's "
                             "defaults (0, 1234, 1234, 1234)")
    parser.add_argument("--apply-chat-template", action="store_true",
                        help="render each request with the tokenizer's chat template (few-shot as turns)")
    parser.add_argument("--output", metavar="DIR", help="write DIR/results.json")
    parser.add_argument("--compare", metavar="RESULTS_JSON",
                        help="an earlier results.json: print its scores beside these, with the difference paired "
                             "on the examples both scored, its 95%% interval and a verdict")


def execute(args: argparse.Namespace) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """The model's scores, and those of --compare's results.json (None without it)."""
    for key, value in (("--limit", args.limit), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise UserError(f"{key}: must be at least 1, got {value}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num-fewshot: must be >= 0, got {args.num_fewshot}")
    before = read_results(args.compare) if args.compare else None  # a wrong path fails before the long part
    if args.output:
        writable_folder("--output", args.output)  # so is an output that cannot be written
    settings = EvalSettings(tasks=tuple(t.strip() for t in args.tasks.split(",") if t.strip()),
                            include_paths=tuple(args.include_path), limit=args.limit, num_fewshot=args.num_fewshot,
                            batch_size=args.batch_size, dtype=args.dtype, device=args.device, seed=args.seed,
                            apply_chat_template=args.apply_chat_template)
    return evaluate(args.model, settings), before


def write(args: argparse.Namespace, results: dict[str, Any]) -> Path:
    """--output's results.json; a full disk is one line (no half file is left)."""
    try:
        return write_results(results, args.output)
    except OSError as exc:
        reason, advice = write_failure(exc, "--output")
        raise UserError(f"--output {args.output}: could not write {RESULTS_FILE} ({reason}); the scores are "
                        f"printed above. {advice.capitalize()}, then run again") from None


def run(args: argparse.Namespace) -> int:
    results, before = execute(args)
    print(results_table(results))
    print(f"\n95% intervals (Wilson for a share of examples, else bootstrap):\n{interval_table(results)}")
    if args.output:
        print(f"results: {write(args, results)}")
    if before is not None:
        print(f"\ncompared with {args.compare}:")
        print(comparison_table(before, results))
    return 0
