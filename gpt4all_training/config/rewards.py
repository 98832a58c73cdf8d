"""The reward kinds built in, one entry each in REWARD_KINDS, and the checks of a `rewards` entry (and of inference's
`checker` and `verifier`, which are written as rewards are).

A new reward kind is one entry here plus its function, in a module of its own or beside the others
(training/objectives/grpo/builtin_rewards.py). Everything else reads this table: the keys an entry may take and
needs (`reward_problem`), the `rewards` field's doc (config/blocks.py, and through it `--help` and the studio's forms),
which kinds can be a checker (those that compare with a record field), grpo's rewards (training/objectives/grpo/
rewards.py) and docs/preference.md (tests/test_grpo.py checks that it names exactly these kinds). The function is
named as "module:function" and imported when a run builds its rewards, so config/ imports nothing above it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

# The record field a reward that compares with one reads, unless its entry names another.
ANSWER_FIELD = "answer"


@dataclass(frozen=True)
class RewardKind:
    name: str  # what an entry's `name` takes
    # "module:function" of f(entry, max_completion_length) -> the reward: f(completions, **columns) -> [float, ...]
    implementation: str
    summary: str  # what it scores, for `rewards`' doc
    keys: tuple[str, ...] = ()  # the keys an entry takes besides name and weight
    needs: Mapping[str, str] = field(default_factory=dict)  # keys it cannot do without: what each is
    compares_field: bool = False  # compares the completion with the record's `field` (ANSWER_FIELD unless named)
    numeric: bool = False  # that field holds a number

    @property
    def written(self) -> str:
        """How an entry names it: {name: format, pattern: ...}."""
        return "{name: " + ", ".join([self.name, *(f"{key}: ..." for key in self.needs)]) + "}"


BUILTIN = "gpt4all_training.training.objectives.grpo.builtin_rewards"
REWARD_KINDS = {kind.name: kind for kind in (
    RewardKind("exact_match", f"{BUILTIN}:exact_match",
               "1 when the final answer equals the record's `field`, default answer, after strip; `pattern`: a regex "
               "whose last match, or its first group, is the final answer", ("field", "pattern"),
               compares_field=True),
    RewardKind("numeric_match", f"{BUILTIN}:numeric_match",
               "the last number, or pattern's match, within `tolerance` of the field",
               ("field", "pattern", "tolerance"), compares_field=True, numeric=True),
    RewardKind("format", f"{BUILTIN}:format_match", "1 when the whole completion matches the regex", ("pattern",),
               needs={"pattern": "the regular expression the whole completion must match"}),
    RewardKind("length_penalty", f"{BUILTIN}:length_penalty",
               "DAPO's soft overlong penalty: 0 up to max_completion_length - `cache` tokens, falling to -1 at "
               "max_completion_length; cache defaults to a quarter of it", ("cache",)),
)}
# The keys of a user's own function.
USER_REWARD_KEYS = ("module", "function")
# The kinds that compare an answer with a record field, which inference's checker and verifier can be.
CHECKERS = tuple(name for name, kind in REWARD_KINDS.items() if kind.compares_field)


def compared_field(entry: Mapping[str, Any]) -> str:
    """The record field an entry's answer is compared with."""
    return entry.get("field", ANSWER_FIELD)


def builtin_rewards_doc() -> str:
    return ", ".join(f"{kind.written} ({kind.summary})" for kind in REWARD_KINDS.values())


def function_entry_problem(entry: dict, builtins: tuple[str, ...], kind: str, extra_keys: tuple[str, ...] = ()
                           ) -> Optional[str]:
    """What is wrong with one entry that names a built-in function (`name`, of `builtins`) or a user's own (module
    and function): a reward, or inference's checker. None when its keys are right."""
    name = entry.get("name")
    if name is not None and name not in builtins:
        return (f"no built-in {kind} is called {name!r}; the built-in ones are {', '.join(builtins)} (your own "
                f"function: module and function)")
    if name is None and not all(isinstance(entry.get(key), str) and entry[key] for key in USER_REWARD_KEYS):
        named = " or ".join(builtins) if len(builtins) == 2 else f"one of {', '.join(builtins)}"
        return f"give name ({named}), or module (a .py file) and function (the name of a function in it)"
    allowed = (*(("name", *REWARD_KINDS[name].keys) if name else USER_REWARD_KEYS), *extra_keys)
    unknown = [key for key in entry if key not in allowed]
    if unknown:
        return f"unknown key {unknown[0]!r}; it takes {', '.join(allowed)}"
    return None


def reward_problem(entries: list[dict], max_completion_length: int) -> Optional[str]:
    """What is wrong with the `rewards` list, in words for its error line, or None."""
    names = []
    for number, entry in enumerate(entries, 1):
        builtin = entry.get("name")
        problem = function_entry_problem(entry, tuple(REWARD_KINDS), "reward", ("weight",))
        if problem:
            label = builtin if builtin in REWARD_KINDS else entry.get("function")
            return f"entry {number} ({label}): {problem}" if isinstance(label, str) else f"entry {number}: {problem}"
        problem = reward_value_problem(builtin, entry, max_completion_length)
        if problem:
            return f"entry {number} ({builtin or entry['function']}): {problem}"
        names.append(builtin or entry["function"])
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        return f"{twice[0]} is named twice, so their metrics (rewards/{twice[0]}/mean) would mix; keep one"
    return None


def reward_value_problem(builtin: Optional[str], entry: dict, max_completion_length: int) -> Optional[str]:
    """What is wrong with the values of an entry whose keys are right (`builtin`: the kind it names, or None)."""
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        return f"weight must be a number, got {weight!r}"
    for key, what in (REWARD_KINDS[builtin].needs.items() if builtin is not None else ()):
        if key not in entry:
            return f"needs {key}, {what}"
    pattern = entry.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            return f"pattern must be a regular expression (text), got {pattern!r}"
        try:
            re.compile(pattern)
        except re.error as exc:
            return f"pattern {pattern!r} is not a regular expression ({exc})"
    if not isinstance(compared_field(entry), str):
        return f"field must name a field of the records, got {entry['field']!r}"
    tolerance = entry.get("tolerance", 0.0)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < math.inf:
        return f"tolerance must be a number >= 0, got {tolerance!r}"
    cache = entry.get("cache", 1)
    if isinstance(cache, bool) or not isinstance(cache, int) or not 1 <= cache <= max_completion_length:
        return f"cache must be a whole number of tokens from 1 to max_completion_length ({max_completion_length}), " \
               f"got {cache!r}"
    return None


def checker_problem(entry: dict, key: str) -> Optional[str]:
    """What is wrong with inference's `checker` or `verifier` (`key`), in words for its error line, or None."""
    return (function_entry_problem(entry, CHECKERS, key)
            or reward_value_problem(entry.get("name"), entry, max_completion_length=1))
