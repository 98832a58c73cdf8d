"""A seeded generator of instruction data whose answers can be checked exactly.

Four task families (gpt4all_training/evaluation/checkable.py, shared with the offline eval suite): arithmetic, unit
conversion, reversing a word and sorting a short list, asked two at a time in conversations written as OpenAI
`messages` JSONL, so the demo runs them through clean.py like user data; and, for preference tuning, one task at a
time as a prompt with its correct answer chosen over a wrong one of the kind that family invites (TRL's message
shape)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from gpt4all_training.evaluation.checkable import FAMILIES

# A wrong answer to a task, from its right one: the mistakes each family invites.
WRONG = {"arithmetic": lambda answer, rng: str(int(answer) + rng.choice((-10, -1, 1, 10))),
         "unit_conversion": lambda answer, rng: str(int(answer) * 10),
         "reverse_word": lambda answer, rng: answer[::-1],  # the word as it was given
         "sort_numbers": lambda answer, rng: ", ".join(reversed(answer.split(", ")))}


def exact_match(prediction: str, answer: str) -> bool:
    return prediction.strip().rstrip(".") == answer


SYSTEM = "You are a precise assistant. Answer with the answer only."


def make_conversations(seed: int):
    """An endless stream of two-round conversations: a system message, then tasks of two different families, each
    answered by the assistant. The second round cycles through the families and `source` names it: the demo scores
    that answer, per family."""
    rng = random.Random(seed)
    names = list(FAMILIES)
    i = 0
    while True:
        second = names[i % len(names)]
        first = rng.choice([name for name in names if name != second])
        turns = [FAMILIES[first](rng), FAMILIES[second](rng)]
        messages = [{"role": "system", "content": SYSTEM}]
        for prompt, answer in turns:
            messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        yield {"messages": messages, "source": second}
        i += 1


def write_conversation_splits(out_dir: Path, n_train: int, n_test: int, seed: int, n_copies: int = 0,
                              n_swapped: int = 0) -> tuple[Path, Path]:
    """raw/train.jsonl and raw/test.jsonl of conversations; no user turn of a test conversation appears in train.

    The training split is then made dirty the way scraped data is, for the curation step to find: `n_copies`
    conversations appear twice, and `n_swapped` have their last answer swapped with another conversation's (a wrong
    label). The clean conversations come first, so the demo knows which lines were planted."""
    rng = random.Random(seed + 1)
    test, train, seen = [], [], set()
    for record in make_conversations(seed):
        if len(test) == n_test and len(train) == n_train:
            break
        prompts = tuple(m["content"] for m in record["messages"] if m["role"] == "user")
        # A test conversation's prompts appear in no other conversation; training prompts may recur in other
        # pairings (there are only 50 words to reverse), but no training conversation twice.
        if prompts in seen or len(test) == n_test and any(p in seen for p in prompts):
            continue
        seen.update({prompts, *prompts} if len(test) < n_test else {prompts})
        (test if len(test) < n_test else train).append(record)
    copies = [json.loads(json.dumps(r)) for r in rng.sample(train, n_copies)]
    swapped = [json.loads(json.dumps(r)) for r in rng.sample(train, n_swapped)]
    answers = [r["messages"][-1]["content"] for r in swapped]
    for i, record in enumerate(swapped):  # each takes the next one's last answer: a wrong label
        record["messages"][-1]["content"] = answers[(i + 1) % len(answers)]
    train += copies + swapped
    return write_records(out_dir / "raw" / "train.jsonl", train), write_records(out_dir / "raw" / "test.jsonl", test)


def write_preference_pairs(out_dir: Path, n_pairs: int, seed: int, held_out: set[str]) -> Path:
    """raw/pairs.jsonl: `n_pairs` single tasks, the families in turn, each with its correct answer chosen and a wrong
    one rejected; no prompt is one of `held_out` (the test conversations' questions) or repeats."""
    rows = [{"prompt": task_prompt(prompt), "chosen": [{"role": "assistant", "content": answer}],
             "rejected": [{"role": "assistant", "content": WRONG[family](answer, rng)}], "source": family}
            for family, prompt, answer, rng in single_tasks(n_pairs, seed, held_out)]
    return write_records(out_dir / "raw" / "pairs.jsonl", rows)


def write_reward_prompts(out_dir: Path, n_prompts: int, seed: int, held_out: set[str]) -> Path:
    """raw/prompts.jsonl: `n_prompts` single tasks, the families in turn, each a prompt (the system message and the
    task) with its `answer` for the exact-match reward; no prompt is one of `held_out` or repeats."""
    rows = [{"prompt": task_prompt(prompt), "answer": answer, "source": family}
            for family, prompt, answer, _ in single_tasks(n_prompts, seed, held_out)]
    return write_records(out_dir / "raw" / "prompts.jsonl", rows)


def single_tasks(n: int, seed: int, held_out: set[str]):
    """`n` tasks (family, prompt, answer, the generator that drew them), the families in turn, none of them in
    `held_out` and none twice. The generator is handed on so that a wrong answer drawn from it follows its task."""
    rng = random.Random(seed)
    names, seen, count = list(FAMILIES), set(held_out), 0
    while count < n:
        family = names[count % len(names)]
        prompt, answer = FAMILIES[family](rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        count += 1
        yield family, prompt, answer, rng


def task_prompt(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


def write_records(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
