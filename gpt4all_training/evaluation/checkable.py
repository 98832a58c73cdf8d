"""Instructions whose answers can be checked exactly, in four seeded families: arithmetic, unit conversion,
reversing a word and sorting a short list. One implementation for the two places that ask them: the offline suite's
exact-match task (configs/eval/suite.py) and the demo's training conversations and preference pairs (demo/tasks.py).

Standard library only: lm-evaluation-harness imports the suite, and with it this module, in its own process.
"""

from __future__ import annotations

import random
import re
from typing import Callable, Optional

WORDS = ("apple", "river", "garden", "planet", "window", "silver", "dragon", "pencil", "forest", "castle",
         "rocket", "violin", "marble", "harbor", "lantern", "meadow", "tiger", "cookie", "bridge", "summer",
         "candle", "wizard", "pocket", "island", "mirror", "basket", "jungle", "copper", "turtle", "winter",
         "guitar", "falcon", "carpet", "button", "orange", "canyon", "pillow", "rabbit", "helmet", "velvet",
         "sunset", "kitten", "ladder", "anchor", "puzzle", "shadow", "thunder", "crystal", "blanket", "compass")
UNITS = (("km", "m", 1000), ("m", "cm", 100), ("kg", "g", 1000), ("hours", "minutes", 60), ("minutes", "seconds", 60),
         ("liters", "milliliters", 1000))


def arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return f"What is {a} + {b}? Answer with the number only.", str(a + b)
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}? Answer with the number only.", str(a - b)


def unit_conversion(rng: random.Random) -> tuple[str, str]:
    big, small, factor = rng.choice(UNITS)
    n = rng.randint(2, 40)
    return f"Convert {n} {big} to {small}. Answer with the number only.", str(n * factor)


def reverse_word(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Reverse the letters of the word '{word}'. Answer with the reversed word only.", word[::-1]


def sort_numbers(rng: random.Random) -> tuple[str, str]:
    numbers = rng.sample(range(1, 50), rng.randint(3, 5))
    listed = ", ".join(map(str, numbers))
    return (f"Sort these numbers in ascending order: {listed}. Answer with the sorted list only.",
            ", ".join(map(str, sorted(numbers))))


# Each family by its name: the `family` of a suite row and the `source` of a demo record.
FAMILIES: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "arithmetic": arithmetic, "unit_conversion": unit_conversion, "reverse_word": reverse_word,
    "sort_numbers": sort_numbers}


# Each family's prompt, read back: what answer_of solves.
ASKED = (
    (re.compile(r"What is (\d+) ([+-]) (\d+)\?"),
     lambda m: str(int(m[1]) + int(m[3]) if m[2] == "+" else int(m[1]) - int(m[3]))),
    (re.compile(r"Convert (\d+) (\w+) to (\w+)\."),
     lambda m: next((str(int(m[1]) * f) for big, small, f in UNITS if (big, small) == (m[2], m[3])), None)),
    (re.compile(r"Reverse the letters of the word '(\w+)'\."), lambda m: m[1][::-1]),
    (re.compile(r"Sort these numbers in ascending order: ([\d, ]+)\."),
     lambda m: ", ".join(map(str, sorted(int(n) for n in m[1].split(", "))))),
)


def answer_of(prompt: str) -> Optional[str]:
    """The right answer to a prompt of one of the families, computed from the prompt itself; None for any other."""
    for pattern, solve in ASKED:
        found = pattern.search(prompt)
        if found:
            return solve(found)
    return None
