"""The reward kinds built in (config/rewards.py's REWARD_KINDS names each, its keys and its function here). Each
function builds the reward from its `rewards` entry and the run's max_completion_length; the reward is called as
every reward is (rewards.py):
- exact_match: 1 when the final answer equals the record's `field` (default "answer"), both stripped; the final
  answer is the completion, or with `pattern` (a regular expression) its last match (its first group when it has
  one); no match scores 0.
- numeric_match: 1 when the last number of the completion (or `pattern`'s last match) is within `tolerance`
  (default 1e-6) of the field's number.
- format: 1 when the whole completion, stripped, matches `pattern` (re.fullmatch, `.` matching newlines too).
- length_penalty: DAPO's soft overlong punishment (TRL's get_soft_overlong_punishment): 0 up to
  max_completion_length - `cache` tokens (cache: a quarter of max_completion_length by default), then falling
  linearly to -1 at max_completion_length.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional

from gpt4all_training.config.rewards import compared_field

NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?"
RewardFunction = Callable[..., list[float]]


def completion_text(completion: Any) -> str:
    """A completion's text: itself, or the content of its assistant message."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion)


def final_answer(text: str, pattern: Optional[str]) -> Optional[str]:
    """The completion's final answer: the text stripped, or `pattern`'s last match in it (its first group when it
    has one), stripped; None when the pattern does not match."""
    if pattern is None:
        return text.strip()
    matches = list(re.finditer(pattern, text, re.DOTALL))
    if not matches:
        return None
    last = matches[-1]
    return (last.group(1) if last.re.groups else last.group(0)).strip()


def as_number(text: Optional[str]) -> Optional[float]:
    if text is None:
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def exact_match(entry: Mapping[str, Any], max_completion_length: int) -> RewardFunction:
    field, pattern = compared_field(entry), entry.get("pattern")

    def reward(completions, **columns) -> list[float]:
        return [float(final_answer(completion_text(c), pattern) == str(answer).strip())
                for c, answer in zip(completions, columns[field])]
    return reward


def numeric_match(entry: Mapping[str, Any], max_completion_length: int) -> RewardFunction:
    field, pattern, tolerance = compared_field(entry), entry.get("pattern"), float(entry.get("tolerance", 1e-6))

    def reward(completions, **columns) -> list[float]:
        out = []
        for completion, answer in zip(completions, columns[field]):
            got, expected = as_number(final_answer(completion_text(completion), pattern or NUMBER)), \
                as_number(str(answer))
            out.append(float(got is not None and expected is not None and abs(got - expected) <= tolerance))
        return out
    return reward


def format_match(entry: Mapping[str, Any], max_completion_length: int) -> RewardFunction:
    compiled = re.compile(entry["pattern"], re.DOTALL)

    def reward(completions, **columns) -> list[float]:
        return [float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions]
    return reward


def length_penalty(entry: Mapping[str, Any], max_completion_length: int) -> RewardFunction:
    cache = entry.get("cache") or max(1, max_completion_length // 4)
    free = max_completion_length - cache

    def reward(completion_ids, **columns) -> list[float]:
        return [0.0 if len(ids) <= free else (free - len(ids)) / cache for ids in completion_ids]
    return reward
