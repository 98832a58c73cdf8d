"""The data of the offline evaluation suite, generated when a task loads: seeded, so every run scores the same
examples, and nothing to download. The task YAML files next to this one name these functions as `custom_dataset`.

Three tasks, one per kind of request the harness makes:
- gpt4all_arithmetic_choice (log-likelihood multiple choice): "What is 37 + 45?" with four numeric answers;
- gpt4all_last_word (LAMBADA-style): a short story whose last word is a name or thing introduced earlier in it,
  so predicting it needs the whole passage, not just the previous few words;
- gpt4all_exact_match (greedy generation until a newline): instructions whose answers can be checked exactly
  (arithmetic, unit conversion, reversing a word, sorting numbers).

This file is imported by lm-evaluation-harness (also by its own `lm_eval` command), so it uses only the standard
library, `datasets` and the exact-match families it shares with the demo (gpt4all_training/evaluation/checkable.py).
"""

from __future__ import annotations

import random
from typing import Callable

import datasets

from gpt4all_training.evaluation.checkable import FAMILIES

TEST_SIZE = 100
FEWSHOT_SIZE = 10  # the train split: few-shot examples only, never scored

NAMES = ("Anna", "Ben", "Clara", "David", "Elena", "Felix", "Grace", "Hugo", "Iris", "Jonas", "Kira", "Leo", "Maya",
         "Nora", "Oscar", "Paula", "Quinn", "Rosa", "Simon", "Tara")
THINGS = ("violin", "lantern", "compass", "basket", "mirror", "blanket", "helmet", "candle", "anchor", "puzzle",
          "kettle", "ladder", "pillow", "rocket", "marble", "guitar", "carpet", "wallet", "hammer", "bucket")
PLACES = ("kitchen", "garden", "harbor", "library", "station", "market", "bakery", "forest", "museum", "castle")


# ---------------------------------------------------------------- multiple choice

def arithmetic_choice(rng: random.Random) -> dict:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    right = a + b
    # Near misses a model that only half-learned addition would pick: off by one, off by ten.
    wrong = rng.sample([right + 1, right - 1, right + 10, right - 10, right + 11], 3)
    choices = [right, *wrong]
    rng.shuffle(choices)
    return {"question": f"What is {a} + {b}?", "choices": [str(c) for c in choices], "label": choices.index(right)}


# ---------------------------------------------------------------- last word (LAMBADA-style)

STORIES = (
    "{name} kept an old {thing} on the shelf in the {place}. Every evening {name} dusted it carefully. When a "
    "visitor asked what the most precious thing in the {place} was, {name} pointed at the {thing}",
    "In the {place}, {name} lost a {thing} and searched for hours. A stranger finally found it under a bench and "
    "handed it back. Relieved, {name} thanked the stranger and held on tightly to the {thing}",
    "{name} and {other} walked to the {place} together. {other} carried the bags while {name} read the map. At "
    "the end of the day, the one who was tired from carrying the bags was {other}",
    "Nobody in the {place} knew who had left the {thing} by the door. {name} guessed it was {other}, because "
    "{other} always forgot things. The next morning the owner came back for it, and it was indeed {other}",
)


def last_word(rng: random.Random) -> dict:
    name, other = rng.sample(NAMES, 2)
    story = rng.choice(STORIES).format(name=name, other=other, thing=rng.choice(THINGS), place=rng.choice(PLACES))
    context, _, target = story.rpartition(" ")
    return {"context": context, "target": target}


# ---------------------------------------------------------------- exact match

def instruction(rng: random.Random, index: int) -> dict:
    name = list(FAMILIES)[index % len(FAMILIES)]
    prompt, answer = FAMILIES[name](rng)
    return {"prompt": prompt, "answer": answer, "family": name}


# ---------------------------------------------------------------- the splits

def splits(make: Callable[[random.Random, int], dict], seed: int, key: str) -> datasets.DatasetDict:
    """`test` and `train` (few-shot) splits of distinct examples: no `key` value appears twice, so no few-shot
    example repeats a scored one."""
    rng = random.Random(seed)
    rows, seen = [], set()
    wanted = TEST_SIZE + FEWSHOT_SIZE
    for _ in range(100 * wanted):  # bounded: a family with too few distinct examples fails instead of hanging
        row = make(rng, len(rows))
        if row[key] not in seen:
            seen.add(row[key])
            rows.append(row)
        if len(rows) == wanted:
            break
    else:
        raise RuntimeError(f"only {len(rows)} distinct examples of {wanted} (seed {seed})")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:TEST_SIZE]),
                                 "train": datasets.Dataset.from_list(rows[TEST_SIZE:])})


# The harness calls these with the task's metadata and the run's model arguments as keywords; none change the data.
def load_arithmetic_choice(**_) -> datasets.DatasetDict:
    return splits(lambda rng, _i: arithmetic_choice(rng), seed=1, key="question")


def load_last_word(**_) -> datasets.DatasetDict:
    return splits(lambda rng, _i: last_word(rng), seed=2, key="context")


def load_exact_match(**_) -> datasets.DatasetDict:
    return splits(instruction, seed=3, key="prompt")
