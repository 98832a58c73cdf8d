"""Data preparation at scale, stage by stage, against the raw tokenizer and TRL: `python bench/data_scale.py`.

The records are generated from the Dolly sample, numbered so that no two are equal: `dolly` records as Dolly
publishes them (instruction, context, response, category), and `chat` records of two rounds (`messages`: a user
turn, an answer, a second user turn, a second answer). Every stage is a fresh process over the same records, timed
from its start to its result (imports and the tokenizer's loading left out), with its peak RSS and the largest
peak of the processes it started (datasets' workers):

  clean      `clean` on the raw file (normalise, drop and count, exact duplicates).
  clean-near the same with `--near-duplicates 0.9` (MinHash-LSH); its output is not what tokenise reads.
  tokenise   what `train` does before the model: read the clean records, tokenize and label them, split and count
             (the fine-tuning objective's load_data), into an empty cache; with num_proc 1 and 2.
  raw        the fast tokenizer alone, batched, on the texts tokenise encodes: each record as SmolLM2's chat template
             writes the whole example (rendered 1,000 at a time, that time reported apart); the floor tokenise is
             measured against.
  trl        TRL's SFTTrainer preparing the same records as `messages` with packing (max_length 512), the
             preparation its constructor runs (the model, a 2-layer SmolLM2 shape, built before the clock starts).

The tokenizer is SmolLM2-135M-Instruct's (ChatML), max_length 512. Every stage reads and writes its records as a
stream (the generator, raw's chunks, TRL's dataset written to Arrow as it is read), so that at a million records the
peaks are the stages' own. Each row records the machine's load average when its stage started: on a shared machine
read the ratios, which the load moves less than the seconds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from gpt4all_training.run_folder import TOKENIZED_DIR  # noqa: E402

SHAPES = ("dolly", "chat")
STAGES = ("clean", "clean-near", "tokenise", "tokenise-2", "raw", "trl")
MAX_LENGTH = 512
RAW_BATCH = 1000  # conversations per call of the raw tokenizer


def raw_records(shape: str, count: int) -> Path:
    """`count` raw records of `shape`, written once under .cache/bench/scale/."""
    path = harness.WORK / "scale" / f"{shape}-{count}" / "raw" / f"{shape}.jsonl"
    if path.is_file():
        return path
    sample = [json.loads(line) for line in harness.DOLLY.read_text(encoding="utf-8").splitlines()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for i in range(count):
            row, other = sample[i % len(sample)], sample[(7 * i + 3) % len(sample)]
            if shape == "dolly":
                record: dict[str, Any] = {**row, "instruction": f"{row['instruction']} (request {i})"}
            else:
                record = {"messages": [
                    {"role": "user", "content": f"{row['instruction']} (request {i})"},
                    {"role": "assistant", "content": row["response"]},
                    {"role": "user", "content": other["instruction"]},
                    {"role": "assistant", "content": other["response"]}]}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.rename(path)
    return path


def clean_folder(raw: Path, near: bool = False) -> Path:
    return raw.parent.parent / ("clean-near" if near else "clean")


def peaks() -> dict[str, float]:
    """Peak RSS in MiB of this process and of the largest process it started and waited for."""
    return {"rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "children_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def clean_conversations(folder: Path) -> Iterator[list[dict[str, str]]]:
    """The clean records as conversations (a prompt/response record as one round), read line by line."""
    with open(next(folder.glob("*_clean.jsonl")), encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            yield record["messages"] if "messages" in record else [
                {"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]


def chunks(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    while chunk := list(itertools.islice(items, size)):
        yield chunk


def stage_clean(raw: Path, near: bool) -> dict[str, Any]:
    from gpt4all_training.data.clean import clean

    out = clean_folder(raw, near)
    shutil.rmtree(out, ignore_errors=True)
    began = time.perf_counter()
    report = clean([str(raw)], out, near_duplicates=0.9 if near else None)
    return {"seconds": time.perf_counter() - began, "kept": report["total"]["kept"],
            "near_duplicates": report["total"].get("dropped:near_duplicate", 0)}


def stage_tokenise(raw: Path, num_proc: int) -> dict[str, Any]:
    from gpt4all_training.config.loader import load_config
    from gpt4all_training.data.sft import column_arrays
    from gpt4all_training.model.loading import tokenizer_for
    from gpt4all_training.training.objectives import objective_for

    work = raw.parent.parent / f"tokenise-{num_proc}"
    shutil.rmtree(work, ignore_errors=True)
    os.environ["HF_DATASETS_CACHE"] = str(work / "datasets")
    config = load_config(None, [f"model_name={harness.smollm2()}", f"dataset_path={clean_folder(raw)}",
                                f"output_dir={work / 'run'}", f"cache_dir={work / TOKENIZED_DIR}",
                                f"max_length={MAX_LENGTH}", f"num_proc={num_proc}"])
    tokenizer = tokenizer_for(config)
    lines: list[str] = []
    began = time.perf_counter()
    data = objective_for(config).load_data(config, tokenizer, lines.append, 1)
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "examples": len(data.train) + len(data.val),
            "tokens": sum(int(column_arrays(split, ["length"])["length"].sum()) for split in (data.train, data.val))}


def stage_raw(raw: Path) -> dict[str, Any]:
    from gpt4all_training.model.loading import load_tokenizer

    tokenizer = load_tokenizer(str(harness.smollm2()))
    rendering = tokenizing = 0.0
    tokens = 0
    for conversations in chunks(clean_conversations(clean_folder(raw)), RAW_BATCH):
        began = time.perf_counter()
        texts = tokenizer.apply_chat_template(conversations, tokenize=False)
        rendered = time.perf_counter()
        tokens += sum(map(len, tokenizer(texts, add_special_tokens=False)["input_ids"]))
        rendering, tokenizing = rendering + rendered - began, tokenizing + time.perf_counter() - rendered
    return {"seconds": tokenizing, "render_seconds": rendering, "tokens": tokens}


def stage_trl(raw: Path) -> dict[str, Any]:
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from gpt4all_training.model.loading import load_tokenizer

    work = raw.parent.parent / "trl"
    shutil.rmtree(work, ignore_errors=True)
    os.environ["HF_DATASETS_CACHE"] = str(work / "datasets")
    tokenizer = load_tokenizer(str(harness.smollm2()))
    shape_config = AutoConfig.from_pretrained(harness.smollm2(), num_hidden_layers=2)
    torch.manual_seed(harness.SEED)
    model = AutoModelForCausalLM.from_config(shape_config)
    # Written to Arrow on disk as they are read, as TRL's users load a dataset of this size.
    records = datasets.Dataset.from_generator(
        lambda: ({"messages": m} for m in clean_conversations(clean_folder(raw))),
        cache_dir=str(work / "datasets"))
    began = time.perf_counter()
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=records, args=SFTConfig(
        output_dir=str(work / "out"), max_length=MAX_LENGTH, packing=True, report_to=[], use_cpu=True,
        dataset_num_proc=None))
    return {"seconds": time.perf_counter() - began, "rows": len(trainer.train_dataset)}


def worker(args) -> dict[str, Any]:
    raw = Path(args.raw)
    if args.worker.startswith("clean"):
        result = stage_clean(raw, args.worker == "clean-near")
    elif args.worker.startswith("tokenise"):
        result = stage_tokenise(raw, 2 if args.worker == "tokenise-2" else 1)
    elif args.worker == "raw":
        result = stage_raw(raw)
    else:
        result = stage_trl(raw)
    return {**result, **peaks()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=lambda text: [int(n) for n in text.split(",")], default=[10_000],
                        help="record counts, comma-separated (e.g. 10000,100000,1000000)")
    parser.add_argument("--shapes", type=lambda text: text.split(","), default=list(SHAPES))
    parser.add_argument("--stages", type=lambda text: text.split(","), default=list(STAGES))
    parser.add_argument("--worker", choices=STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=SHAPES, help=argparse.SUPPRESS)
    parser.add_argument("--raw", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    harness.setup_environment()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    harness.smollm2()
    print(f"# SmolLM2 tokenizer, max_length {MAX_LENGTH}; {harness.machine()}; {time.strftime('%Y-%m-%d %H:%M')}")
    print("| shape | records | stage | seconds | peak RSS MiB (self / largest child) | load avg | note |")
    print("|---|---|---|---|---|---|---|")
    for count in args.sizes:
        for shape in args.shapes:
            raw = raw_records(shape, count)
            results: dict[str, dict[str, Any]] = {}
            for stage in args.stages:
                load = os.getloadavg()[0]
                result = harness.run_worker("data_scale.py", ["--worker", stage, "--shape", shape, "--raw", str(raw)],
                                            timeout=6 * 3600)
                results[stage] = result
                note = {"raw": f"render {result.get('render_seconds', 0):.1f} s, {result.get('tokens', 0):,} tokens",
                        "trl": f"{result.get('rows', 0):,} packed rows",
                        "clean": f"{result.get('kept', 0):,} kept",
                        "clean-near": f"{result.get('kept', 0):,} kept, {result.get('near_duplicates', 0):,} near "
                                      f"duplicates"}.get(stage, "")
                if stage.startswith("tokenise"):
                    note = f"{result['examples']:,} examples, {result['tokens']:,} tokens"
                print(f"| {shape} | {count:,} | {stage} | {result['seconds']:.1f} | {result['rss_mib']:,.0f} / "
                      f"{result['children_rss_mib']:,.0f} | {load:.1f} | {note} |", flush=True)
            print(ratios(shape, count, results), flush=True)
    return 0


def ratios(shape: str, count: int, results: dict[str, dict[str, Any]]) -> str:
    """The ratios the targets name, from whichever stages ran."""
    seconds = {stage: result["seconds"] for stage, result in results.items()}
    parts = []
    if "tokenise" in seconds and "raw" in seconds:
        parts.append(f"tokenise / raw tokenizer {seconds['tokenise'] / seconds['raw']:.2f}x")
    if "tokenise" in seconds and "trl" in seconds:
        parts.append(f"TRL / tokenise {seconds['trl'] / seconds['tokenise']:.2f}x")
    if "tokenise" in seconds and "tokenise-2" in seconds:
        parts.append(f"num_proc 1 / num_proc 2 {seconds['tokenise'] / seconds['tokenise-2']:.2f}x")
    return f"{shape} {count:,}: " + ("; ".join(parts) or "no ratio (stages missing)")


if __name__ == "__main__":
    sys.exit(main())
