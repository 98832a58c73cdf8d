"""The demo's generated data (demo/tasks.py): held-out tasks never asked in training, planted copies and wrong
answers where the demo looks for them, its verifier finding exactly those, and every task, pair and prompt drawn
anew for another seed."""

from __future__ import annotations

import json

import pytest

from demo.measure import rewards_by_prompt
from demo.run import planted_wrong_answers
from demo.tasks import (FAMILIES, WRONG, read_records, verified_answers, write_conversations, write_held_out_tasks,
                        write_preference_pairs, write_reward_prompts)
from gpt4all_training.evaluation.checkable import answer_of


def user_prompts(record: dict) -> list[str]:
    messages = record.get("messages") or record["prompt"]
    return [m["content"] for m in messages if m["role"] == "user"]


def generate(tmp_path, seed: int) -> dict[str, list[dict]]:
    """What demo/run.py writes for --seed `seed`, at the demo's sizes."""
    out = tmp_path / str(seed)
    tasks = read_records(write_held_out_tasks(out, 300, 10 * seed))
    held_out = {task["prompt"][-1]["content"] for task in tasks}
    return {"tasks": tasks,
            "train": read_records(write_conversations(out, 160, 10 * seed + 1, held_out, 16, 16)),
            "pairs": read_records(write_preference_pairs(out, 48, 10 * seed + 2, held_out)),
            "prompts": read_records(write_reward_prompts(out, 24, 10 * seed + 3, held_out))}


def test_held_out_tasks_are_distinct_checkable_and_never_asked_in_training(tmp_path):
    data = generate(tmp_path, 0)
    tasks = data["tasks"]
    assert [task["source"] for task in tasks[:4]] == list(FAMILIES)
    assert {family: sum(t["source"] == family for t in tasks) for family in FAMILIES} == dict.fromkeys(FAMILIES, 75)
    asked = [user_prompts(task)[0] for task in tasks]
    assert len(set(asked)) == 300
    for name in ("train", "pairs", "prompts"):
        assert not set(asked) & {p for record in data[name] for p in user_prompts(record)}, name
    for task in tasks:  # each held-out pair: the right answer against a wrong one of its family's kind
        assert task["rejected"] != task["answer"]
    reversal = next(task for task in tasks if task["source"] == "reverse_word")
    assert reversal["rejected"] == reversal["answer"][::-1] == WRONG["reverse_word"](reversal["answer"], None)
    # A unit slip is a zero too many or one too few, both often: one direction alone would teach dpo that direction.
    slips = [int(t["rejected"]) / int(t["answer"]) for t in tasks if t["source"] == "unit_conversion"]
    assert set(slips) == {10, 0.1} and 0.3 < slips.count(10) / len(slips) < 0.7


def test_the_planted_copies_and_wrong_answers_are_where_the_demo_counts_them(tmp_path):
    train = generate(tmp_path, 0)["train"]
    clean, copies, swapped = train[:160], train[160:176], train[176:]
    conversations = [json.dumps(r["messages"]) for r in clean]
    assert len(set(conversations)) == 160 and all(json.dumps(r["messages"]) in conversations for r in copies)
    assert len(swapped) == 16
    for record in swapped:  # the same questions as a clean conversation, another conversation's last answer
        [original] = [r for r in clean if user_prompts(r) == user_prompts(record)]
        assert original["messages"][:-1] == record["messages"][:-1]
        assert original["messages"][-1]["content"] != record["messages"][-1]["content"]
    raw = tmp_path / "0" / "raw" / "train.jsonl"
    assert planted_wrong_answers(raw, 16) == {json.dumps(r["messages"]) for r in swapped}


def test_the_verifier_scores_0_exactly_the_planted_wrong_answers(tmp_path):
    """answer_of solves every family's prompt from its text; the verifier built on it (inference's `verifier` in the
    demo) scores each conversation's own last answer, a final full stop allowed."""
    data = generate(tmp_path, 0)
    for task in data["tasks"] + data["prompts"]:
        assert answer_of(task["prompt"][-1]["content"]) == task["answer"]
    assert answer_of("What is the capital of France?") is None
    train = data["train"]
    answers = [r["messages"][-1]["content"] for r in train]
    scores = verified_answers([None] * len(train), answers, [[0]] * len(train), [r["messages"] for r in train])
    assert scores == [1.0] * 176 + [0.0] * 16
    assert verified_answers([None], [answers[0] + "."], [[0]], [train[0]["messages"]]) == [1.0]


def test_another_seed_draws_every_task_pair_and_prompt_anew(tmp_path):
    first, second = generate(tmp_path, 0), generate(tmp_path, 1)
    for name in ("tasks", "train", "pairs", "prompts"):
        # Drawn anew record by record. (A unit conversion has 234 possible questions and a word to reverse 183, so
        # the same question may turn up under both seeds, at another place.)
        same = sum(one == other for one, other in zip(first[name], second[name]))
        assert same <= len(first[name]) // 20, name
    assert generate(tmp_path, 0) == first  # the same seed, the same data


def test_grpo_rewards_pair_each_prompt_with_itself(tmp_path):
    """Four epochs of one prompt a step, in the order the run's StepSampler draws them for its seed: each prompt's
    reward in the first epoch pairs with its reward in the last, whatever the order within each epoch."""
    from gpt4all_training.data.sampling import StepSampler

    sampler = StepSampler(5, batch_size=1, seed=3)
    drawn = [sampler.step_indices(step)[0][0] for step in range(20)]
    assert drawn[:5] != drawn[-5:] and sorted(drawn[:5]) == sorted(drawn[-5:]) == list(range(5))
    rows = [{"step": step + 1, "reward": 0.1 * prompt + (0.5 if step >= 15 else 0.0)}
            for step, prompt in enumerate(drawn)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    first, last = rewards_by_prompt(tmp_path, 5, seed=3)
    assert first == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4]) and last == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9])
    with pytest.raises(RuntimeError, match="not four epochs of one prompt a step"):
        rewards_by_prompt(tmp_path, 4, seed=3)
