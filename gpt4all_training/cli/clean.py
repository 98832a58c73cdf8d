"""`gpt4all-training clean`: normalize raw JSONL into prompt/response/source records, messages/source conversations
and prompt/chosen/rejected/source preference pairs, with a report per file."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from gpt4all_training.data.clean import OASST_MODES, Filters, clean
from gpt4all_training.data.raw_files import SUFFIXES, read_units
from gpt4all_training.errors import UserError
from gpt4all_training.files import writable_file, writable_folder

# What clean.py reads, for the error when it keeps nothing (data/clean.py's docstring has the details).
FORMATS = ("gpt4all records (prompt, response), Dolly (instruction, context, response), OpenAI messages, ShareGPT "
           "conversations, Alpaca (instruction, input, output), TRL prompt/completion (text or messages), "
           "OpenAssistant message trees (message_tree_id, or a prompt with replies), preference pairs (chosen, "
           "rejected: TRL, UltraFeedback-binarized, HH-RLHF) and, with --prompts, prompts with the fields their "
           "rewards read, as JSON Lines, a JSON array, Parquet or CSV")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help=f"data files ({', '.join(SUFFIXES)}; anything else is read as JSON "
                                                  f"Lines) or folders of them")
    parser.add_argument("--output-dir", required=True, help="where <name>_clean.jsonl and clean_report.json go")
    parser.add_argument("--drop-ai-disclaimers", action="store_true", help="drop responses that say they are an AI")
    parser.add_argument("--drop-refusals", action="store_true", help="drop apology and refusal answers")
    parser.add_argument("--min-response-chars", type=int, default=0,
                        help="drop responses shorter than this (of a preference pair: its chosen answer)")
    parser.add_argument("--oasst", choices=OASST_MODES, default="paths",
                        help="OpenAssistant trees as conversations: every thread, each reply trained once (paths, the "
                             "default), the best-ranked thread only (best); or prompt/response pairs with the thread "
                             "flattened into the prompt (pairs)")
    parser.add_argument("--oasst-preferences", action="store_true",
                        help="OpenAssistant trees as preference pairs (objective dpo): under each prompt, its "
                             "best-ranked reply against each lower-ranked one, the thread above as the prompt")
    parser.add_argument("--rejects", metavar="FILE",
                        help="write every dropped record to FILE as JSONL: its file, line, reason, and the record "
                             "(or, for a line that holds none, its text)")
    parser.add_argument("--near-duplicates", type=float, metavar="SIMILARITY",
                        help="also drop a record whose text shares at least this fraction of its word 3-grams with "
                             "a record kept before it (estimated Jaccard similarity, MinHash-LSH), e.g. 0.9")
    parser.add_argument("--prompts", action="store_true",
                        help="every record as a prompt to sample from (objective grpo): its prompt (text or "
                             "messages ending with the user's turn; or its messages) and every other field, which "
                             "the rewards read (answer, tests, ...)")


def execute(args: argparse.Namespace) -> dict[str, Any]:
    """The report of cleaning the inputs (kept and dropped by reason, per file and in total)."""
    writable_folder("--output-dir", args.output_dir)  # before any input is read
    if args.rejects:
        writable_file("--rejects", args.rejects, example="rejects.jsonl")
    filters = Filters(args.drop_ai_disclaimers, args.drop_refusals, args.min_response_chars)
    return clean(args.inputs, args.output_dir, filters, args.oasst, args.oasst_preferences, args.prompts,
                 args.rejects, args.near_duplicates)


def run(args: argparse.Namespace) -> int:
    report = execute(args)
    print_report(report)
    print(f"report: {Path(args.output_dir) / 'clean_report.json'}")
    if args.rejects:
        print(f"rejects: {args.rejects} ({report['total'].get('read', 0) - report['total'].get('kept', 0)} records)")
    if not report["total"].get("kept"):
        raise UserError(nothing_kept(report))
    return 0


def nothing_kept(report: dict[str, Any]) -> str:
    """The error line of a run that kept no record: the drop reasons in words, what the first record holds, and the
    formats clean.py reads."""
    dropped = Counter({key.split(":", 1)[1]: count for key, count in report["total"].items()
                       if key.startswith("dropped:")})
    read = report["total"].get("read", 0)
    if not dropped:
        return f"clean: kept 0 records: the inputs hold no lines; clean.py reads {FORMATS}"
    reason, count = dropped.most_common(1)[0]
    kind, _, name = reason.partition("_")
    why = {"missing": f"had no {name!r} field (or it was null)", "non": f"had a {name.removeprefix('string_')!r} "
           f"field that is not text", "unknown": "had the fields of none of the formats"}.get(kind, f"were {reason}")
    first = first_record_fields(report)
    prompts = "; prompts without answers, for objective grpo, are read with --prompts" \
        if reason == "missing_response" and not report.get("prompts") else ""
    return (f"clean: kept 0 of {read} records ({', '.join(f'{k} {v}' for k, v in dropped.most_common())}): {count} "
            f"of them {why}{first}; clean.py reads {FORMATS}; rename the fields or convert the file{prompts}")


def first_record_fields(report: dict[str, Any]) -> str:
    """", whose first line has the fields a, b" for the first input that holds a record (its first record: a CSV
    file's header, a Parquet file's columns), else ""."""
    for name in report["files"]:
        try:
            record = next((unit.record for unit in read_units(Path(name)) if isinstance(unit.record, dict)), None)
        except (OSError, UserError):
            continue
        if record is not None:
            return f" ({name}'s first line has the fields: {', '.join(map(str, record)) or 'none'})"
    return ""


def print_report(report: dict[str, Any]) -> None:
    for name, entry in report["files"].items():
        reasons = ", ".join(f"{k} {v}" for k, v in entry["dropped"].items()) or "none"
        print(f"{name}: lines {entry['lines']}, read {entry['read']}, kept {entry['kept']}, "
              f"dropped {entry['dropped_total']} ({reasons})")
