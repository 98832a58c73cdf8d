"""What the demo measures on a model, item by item, so that every score has its interval and every comparison is
paired (gpt4all_training/intervals.py):
- `exact_matches`: each held-out task answered greedily through the one decoder (model/decoding.py), in batches;
- `preferences`: whether the model gives a held-out task's correct answer a higher log-probability than a wrong one
  (the held-out preference accuracy, with the pairs encoded and scored as dpo encodes and scores them);
- `success_counts`: how many of k sampled answers to a prompt are exact (which prompts carry signal for grpo);
- `rewards_by_prompt`: each grpo prompt's mean reward in the first and in the last quarter of the run, paired.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from demo.tasks import exact_match
from gpt4all_training.data.batching import collate
from gpt4all_training.data.chat import encode_for_generation, end_of_turn_id
from gpt4all_training.data.sampling import StepSampler
from gpt4all_training.data.pairs import tokenize_message_pairs
from gpt4all_training.model.decoding import Sampling, Sequence, decode_all, eos_token_ids
from gpt4all_training.model.loading import load_model
from gpt4all_training.run_folder import METRICS_FILE
from gpt4all_training.tracking.tracker import read_metrics
from gpt4all_training.training.loss import sequence_logps

BATCH_ROWS = 64  # rows decoded at a time: larger batches keep the CPU's matrix units busier
SCORE_ROWS = 32  # pairs scored per forward pass
# Tokens generated beyond the answer's own: room for a final full stop and spacing. A longer reply cannot be an
# exact match, so decoding stops there instead of running on for a model that answers in sentences.
ANSWER_SLACK = 3


def measured(folder: str | Path, tokenizer, tasks: list[dict], max_length: int | None = None
             ) -> tuple[list[bool], list[bool] | None]:
    """(exact matches, preferences where `max_length` is given) of the model in `folder`, loaded in fp32 (CPUs
    without native bf16, AVX2 only, emulate it far slower) and let go afterwards."""
    model = load_model(str(folder)).eval()
    hits = exact_matches(model, tokenizer, tasks)
    prefers = preferences(model, tokenizer, tasks, max_length) if max_length is not None else None
    del model
    gc.collect()
    return hits, prefers


def answer_budget(tokenizer, answer: str) -> int:
    return len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + ANSWER_SLACK


def exact_matches(model, tokenizer, tasks: list[dict], rows: int = BATCH_ROWS) -> list[bool]:
    """Whether the greedy answer to each task's prompt is its answer exactly (a final full stop allowed), decoding
    `rows` at a time."""
    eos = eos_token_ids(model, tokenizer) | {end_of_turn_id(tokenizer)}
    prompts = encode_for_generation(tokenizer, [task["prompt"] for task in tasks])
    sequences = [Sequence(ids, answer_budget(tokenizer, task["answer"])) for ids, task in zip(prompts, tasks)]
    decode_all(model, tokenizer, sequences, eos, rows)
    return [exact_match(sequence.text, task["answer"]) for sequence, task in zip(sequences, tasks)]


@torch.no_grad()
def preferences(model, tokenizer, tasks: list[dict], max_length: int) -> list[bool]:
    """Whether the model's log-probability of each task's answer (its end of turn included) is above that of the
    task's `rejected` wrong answer."""
    columns = tokenize_message_pairs({"prompt": [task["prompt"] for task in tasks],
                                      "chosen": [[{"role": "assistant", "content": task["answer"]}] for task in tasks],
                                      "rejected": [[{"role": "assistant", "content": task["rejected"]}]
                                                   for task in tasks]}, tokenizer, max_length, "all")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prefers = []
    for start in range(0, len(tasks), SCORE_ROWS):
        rows = [{"input_ids": columns[f"{side}_input_ids"][i], "labels": columns[f"{side}_labels"][i]}
                for side in ("chosen", "rejected") for i in range(start, min(start + SCORE_ROWS, len(tasks)))]
        logps = sequence_logps(model, collate(rows, pad))
        half = len(rows) // 2
        prefers += (logps[:half] > logps[half:]).tolist()
    return prefers


def success_counts(model, tokenizer, prompts: list[dict], samples: int, sampling: Sampling, max_new_tokens: int,
                   seed: int) -> list[int]:
    """Of `samples` answers sampled to each prompt, how many are its `answer` exactly."""
    eos = eos_token_ids(model, tokenizer) | {end_of_turn_id(tokenizer)}
    ids = encode_for_generation(tokenizer, [p["prompt"] for p in prompts])
    sequences = [Sequence(prompt, max_new_tokens, sampling, seed=seed + i * samples + j)
                 for i, prompt in enumerate(ids) for j in range(samples)]
    decode_all(model, tokenizer, sequences, eos, BATCH_ROWS)
    return [sum(exact_match(s.text, p["answer"]) for s in sequences[i * samples:(i + 1) * samples])
            for i, p in enumerate(prompts)]


def rewards_by_prompt(run_dir: Path, n_prompts: int, seed: int) -> tuple[list[float], list[float]]:
    """Each prompt's mean reward (over its group of samples) in the first and in the last quarter of the grpo run in
    `run_dir`, in the same prompt order, so that the rise is paired prompt by prompt: prompts differ in difficulty far
    more than a run moves them. The run (demo/grpo.yaml) draws one prompt a step, in one process, in the order its
    StepSampler gives for its seed, over four epochs: each quarter is one epoch, every prompt in it once."""
    rewards = [row["reward"] for row in read_metrics(run_dir / METRICS_FILE) if "reward" in row]
    sampler = StepSampler(n_prompts, batch_size=1, seed=seed)
    drawn = [sampler.step_indices(step)[0][0] for step in range(len(rewards))]
    quarter = len(rewards) // 4
    first, last = dict(zip(drawn[:quarter], rewards[:quarter])), dict(zip(drawn[-quarter:], rewards[-quarter:]))
    if quarter != n_prompts or not sorted(first) == sorted(last) == list(range(n_prompts)):
        raise RuntimeError(f"{run_dir}: {len(rewards)} steps over {n_prompts} prompts are not four epochs of one "
                           f"prompt a step; the quarters do not hold every prompt once")
    return [first[p] for p in range(n_prompts)], [last[p] for p in range(n_prompts)]
