"""First start against second start with the tokenized-data cache: `python bench/data_cache.py`.

The corpus is `--examples` prompt/response records (default 200,000) made from the Dolly sample, each record's
prompt numbered so that no two are equal, in one JSONL file under .cache/bench/. A "start" is a fresh process that
does what `train` does before it builds the model: load the tokenizer, then the fine-tuning objective's load_data
(read the records, hash them, then tokenize and split them, or load the cached splits). Each repeat starts from
empty caches, ours and datasets' own (its JSON-to-Arrow conversion), as a new machine would: start 1 converts,
tokenizes and writes the entry (cache miss), start 2 reads both caches (cache hit). The table shows medians of the
data-loading seconds and of the whole process, and the entry's size on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from gpt4all_training.run_folder import TOKENIZED_DIR  # noqa: E402


def corpus(examples: int) -> Path:
    """`examples` records cycled from the cleaned Dolly sample, written once."""
    path = harness.WORK / f"corpus-{examples}" / "corpus_clean.jsonl"
    if path.is_file():
        return path.parent
    rows = [json.loads(line) for line in next(harness.clean_data().glob("*_clean.jsonl")).read_text().splitlines()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(examples):
            row = rows[i % len(rows)]
            f.write(json.dumps({"prompt": f"{row['prompt']} (request {i})", "response": row["response"],
                                "source": row["source"]}) + "\n")
    tmp.rename(path)
    return path.parent


def start(data: Path, kind: str, cache_dir: Path) -> dict:
    """One start's data loading, in this (fresh) process."""
    os.environ["HF_DATASETS_CACHE"] = str(cache_dir.parent / "datasets")  # read when datasets is first imported
    from gpt4all_training.config.loader import load_config
    from gpt4all_training.model.loading import tokenizer_for
    from gpt4all_training.training.objectives import objective_for

    began = time.perf_counter()
    config = load_config(None, [f"model_name={harness.model_dir(kind)}", f"dataset_path={data}",
                                f"cache_dir={cache_dir}", f"output_dir={cache_dir.parent / 'run'}",
                                f"max_length={harness.MODELS[kind]['max_length']}"])
    tokenizer = tokenizer_for(config)
    lines: list[str] = []
    tokenizer_ready = time.perf_counter()
    splits = objective_for(config).load_data(config, tokenizer, lines.append, 1)
    done = time.perf_counter()
    return {"load_data_seconds": done - tokenizer_ready, "startup_seconds": done - began,
            "train_examples": len(splits.train),
            "line": next(line for line in lines if line.startswith("tokenized data:"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=200_000)
    parser.add_argument("--model", choices=sorted(harness.MODELS), default="smollm2", help="whose tokenizer")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of starts, each with an empty cache")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    harness.setup_environment()
    if args.worker:
        print(json.dumps(start(args.data, args.model, args.worker)))
        return 0

    data = corpus(args.examples)
    harness.model_dir(args.model)
    print(f"# {args.examples:,} examples ({(data / 'corpus_clean.jsonl').stat().st_size / 2**20:,.0f} MiB of JSONL), "
          f"{args.model} tokenizer, max_length {harness.MODELS[args.model]['max_length']}; {harness.machine()}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    results: dict[str, list[dict]] = {"first": [], "second": []}
    for repeat in range(args.repeats):
        cache_dir = harness.WORK / "runs" / "data-cache" / f"repeat-{repeat}" / TOKENIZED_DIR
        shutil.rmtree(cache_dir.parent, ignore_errors=True)
        for which in ("first", "second"):
            result = harness.run_worker("data_cache.py", ["--worker", str(cache_dir), "--data", str(data),
                                                          "--model", args.model])
            result["entry_mib"] = sum(p.stat().st_size for p in cache_dir.rglob("*") if p.is_file()) / 2**20
            results[which].append(result)
            print(f"  repeat {repeat + 1} {which} start: load_data {result['load_data_seconds']:.1f} s, process "
                  f"{result['process_seconds']} s; {result['line']}", flush=True)
    first, second = (harness.median([r["load_data_seconds"] for r in results[w]]) for w in ("first", "second"))
    print("| start | load_data s (median) | process s (median) | cache entry MiB |\n|---|---|---|---|")
    for which in ("first", "second"):
        runs = results[which]
        print(f"| {which} ({'cache miss' if which == 'first' else 'cache hit'}) | "
              f"{harness.median([r['load_data_seconds'] for r in runs]):.1f} | "
              f"{harness.median([r['process_seconds'] for r in runs]):.1f} | {runs[-1]['entry_mib']:,.0f} |")
    print(f"second start's data loading: {first / second:.1f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
