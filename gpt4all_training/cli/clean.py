"""`gpt4all-training clean`: normalize raw JSONL into prompt/response/source records, with a report per file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gpt4all_training.data.clean import Filters, clean


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="JSONL files or folders of them")
    parser.add_argument("--output-dir", required=True, help="where <name>_clean.jsonl and clean_report.json go")
    parser.add_argument("--drop-ai-disclaimers", action="store_true", help="drop responses that say they are an AI")
    parser.add_argument("--drop-refusals", action="store_true", help="drop apology and refusal answers")
    parser.add_argument("--min-response-chars", type=int, default=0, help="drop responses shorter than this")


def run(args: argparse.Namespace) -> int:
    filters = Filters(args.drop_ai_disclaimers, args.drop_refusals, args.min_response_chars)
    report = clean(args.inputs, args.output_dir, filters)
    print_report(report)
    print(f"report: {Path(args.output_dir) / 'clean_report.json'}")
    return 0


def print_report(report: dict[str, Any]) -> None:
    for name, entry in report["files"].items():
        reasons = ", ".join(f"{k} {v}" for k, v in entry["dropped"].items()) or "none"
        print(f"{name}: lines {entry['lines']}, read {entry['read']}, kept {entry['kept']}, "
              f"dropped {entry['dropped_total']} ({reasons})")
