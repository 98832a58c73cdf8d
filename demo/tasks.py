"""A seeded generator of instruction data whose answers can be checked exactly.

Four task families (gpt4all_training/evaluation/checkable.py, shared with the offline eval suite): arithmetic, unit
conversion, reversing a word and sorting a short list. The demo draws words to reverse from a larger list than the
suite's 50 (`WORDS`), so that 300 held-out tasks and the training data never share a prompt. From one seed it writes:
- the held-out tasks, one task each as a prompt (the system message and the task) with its answer, the families in
  turn: what every model is scored on;
- two-round conversations (a system message, then tasks of two different families, each answered) in OpenAI
  `messages` JSONL, run through clean.py like user data, with planted copies and wrong answers;
- preference pairs, a task's correct answer chosen over a wrong one of the kind its family invites (TRL's message
  shape);
- prompts with their answers for the exact-match reward of grpo.
No prompt of the held-out tasks appears in any of the others.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, Iterator

from gpt4all_training.evaluation import checkable

WORDS = checkable.WORDS + (
    "acorn", "almond", "amber", "arrow", "autumn", "badger", "bamboo", "banner", "barrel", "beacon", "beaver",
    "biscuit", "blossom", "bottle", "branch", "bucket", "butter", "cabin", "cactus", "camera", "cannon", "canvas",
    "carrot", "cavern", "cellar", "cherry", "chimney", "circus", "clover", "cobalt", "comet", "coral", "cotton",
    "cradle", "crater", "cricket", "dagger", "daisy", "desert", "dolphin", "donkey", "dragonfly", "eagle", "ember",
    "engine", "fabric", "feather", "fiddle", "flannel", "fossil", "fountain", "galaxy", "garlic", "ginger",
    "glacier", "goblet", "granite", "gravel", "hammer", "hazel", "hermit", "hollow", "honey", "horizon", "iceberg",
    "insect", "jacket", "jasmine", "kettle", "kingdom", "lagoon", "lemon", "lizard", "locket", "magnet", "mango",
    "maple", "meteor", "mitten", "monkey", "mosaic", "muffin", "napkin", "needle", "nectar", "oyster", "paddle",
    "palace", "parrot", "peanut", "pebble", "pepper", "pigeon", "pirate", "plaster", "pumpkin", "quiver",
    "radish", "raven", "ribbon", "saddle", "salmon", "satin", "scarf", "shovel", "spider", "spiral", "sponge",
    "squirrel", "stable", "statue", "sugar", "swallow", "tablet", "teapot", "temple", "thistle", "timber", "tomato",
    "towel", "trumpet", "tunnel", "umbrella", "valley", "vessel", "walnut", "walrus", "wagon", "whistle", "willow",
    "wombat", "yogurt", "zebra")


def reverse_word(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Reverse the letters of the word '{word}'. Answer with the reversed word only.", word[::-1]


# Each family by its name: the `source` of a record.
FAMILIES: dict[str, Callable[[random.Random], tuple[str, str]]] = {**checkable.FAMILIES, "reverse_word": reverse_word}

# A wrong answer to a task, from its right one: the mistakes each family invites.
WRONG = {"arithmetic": lambda answer, rng: str(int(answer) + rng.choice((-10, -1, 1, 10))),
         # A zero too many or one too few, about half each: always too many teaches dpo to stop early, a bias that
         # costs the conversions it gets right. Decided by the answer's digit sum, not drawn, so that the tasks
         # drawn after it stay the same.
         "unit_conversion": lambda answer, rng: str(int(answer) * 10 if sum(map(int, answer)) % 2
                                                    else int(answer) // 10),
         "reverse_word": lambda answer, rng: answer[::-1],  # the word as it was given
         "sort_numbers": lambda answer, rng: ", ".join(reversed(answer.split(", ")))}

SYSTEM = "You are a precise assistant. Answer with the answer only."


def exact_match(prediction: str, answer: str) -> bool:
    return prediction.strip().rstrip(".") == answer


def verified_answers(prompts: list, completions: list[str], completion_ids: list, messages: list[list[dict]],
                     **fields) -> list[float]:
    """inference's verifier for the demo's conversations: 1 where the last answer (the completion) is the right answer
    to the last question, computed from the question itself (checkable.answer_of), else 0."""
    return [float(exact_match(answer, checkable.answer_of(turns[-2]["content"]) or ""))
            for answer, turns in zip(completions, messages)]


def task_prompt(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


def single_tasks(n: int, seed: int, held_out: set[str]) -> Iterator[tuple[str, str, str, random.Random]]:
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


def write_held_out_tasks(out_dir: Path, n: int, seed: int) -> Path:
    """raw/test.jsonl: `n` distinct single tasks, each a prompt with its `answer` and a `rejected` wrong answer (the
    held-out preference pair of the task), the families in turn."""
    rows = [{"prompt": task_prompt(prompt), "answer": answer, "rejected": WRONG[family](answer, rng),
             "source": family} for family, prompt, answer, rng in single_tasks(n, seed, set())]
    return write_records(out_dir / "raw" / "test.jsonl", rows)


def make_conversations(seed: int, held_out: set[str]) -> Iterator[dict]:
    """An endless stream of two-round conversations: a system message, then tasks of two different families, each
    answered by the assistant, neither of them in `held_out`. The second round cycles through the families and
    `source` names it."""
    rng = random.Random(seed)
    names = list(FAMILIES)
    i = 0
    while True:
        second = names[i % len(names)]
        first = rng.choice([name for name in names if name != second])
        turns = [FAMILIES[first](rng), FAMILIES[second](rng)]
        if any(prompt in held_out for prompt, _ in turns):
            continue
        messages = [{"role": "system", "content": SYSTEM}]
        for prompt, answer in turns:
            messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        yield {"messages": messages, "source": second}
        i += 1


def write_conversations(out_dir: Path, n: int, seed: int, held_out: set[str], n_copies: int = 0,
                        n_swapped: int = 0) -> Path:
    """raw/train.jsonl: `n` distinct conversations, none asking a `held_out` prompt, then made dirty the way scraped
    data is, for the curation step to find: `n_copies` conversations appear twice, and `n_swapped` have their last
    answer swapped with another conversation's (a wrong label). The clean conversations come first and the swapped
    ones last, so the demo knows which lines were planted."""
    rng = random.Random(seed + 1)
    train: list[dict] = []
    seen: set[tuple[str, ...]] = set()
    for record in make_conversations(seed, held_out):
        if len(train) == n:
            break
        prompts = tuple(m["content"] for m in record["messages"] if m["role"] == "user")
        if prompts not in seen:
            seen.add(prompts)
            train.append(record)
    copies = [json.loads(json.dumps(r)) for r in rng.sample(train, n_copies)]
    swapped = [json.loads(json.dumps(r)) for r in rng.sample(train, n_swapped)]
    answers = [r["messages"][-1]["content"] for r in swapped]
    for i, record in enumerate(swapped):  # each takes the next one's last answer: a wrong label
        record["messages"][-1]["content"] = answers[(i + 1) % len(answers)]
    return write_records(out_dir / "raw" / "train.jsonl", train + copies + swapped)


def write_preference_pairs(out_dir: Path, n_pairs: int, seed: int, held_out: set[str]) -> Path:
    """raw/pairs.jsonl: `n_pairs` single tasks, the families in turn, each with its correct answer chosen and a wrong
    one rejected; no prompt is one of `held_out` or repeats."""
    rows = [{"prompt": task_prompt(prompt), "chosen": [{"role": "assistant", "content": answer}],
             "rejected": [{"role": "assistant", "content": WRONG[family](answer, rng)}], "source": family}
            for family, prompt, answer, rng in single_tasks(n_pairs, seed, held_out)]
    return write_records(out_dir / "raw" / "pairs.jsonl", rows)


def write_reward_prompts(out_dir: Path, n_prompts: int, seed: int, held_out: set[str],
                         name: str = "prompts.jsonl") -> Path:
    """raw/<name>: `n_prompts` single tasks, the families in turn, each a prompt (the system message and the task)
    with its `answer` for the exact-match reward; no prompt is one of `held_out` or repeats."""
    rows = [{"prompt": task_prompt(prompt), "answer": answer, "source": family}
            for family, prompt, answer, _ in single_tasks(n_prompts, seed, held_out)]
    return write_records(out_dir / "raw" / name, rows)


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def write_records(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
