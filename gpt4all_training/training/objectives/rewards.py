"""grpo's rewards: the functions built in, a user's own function loaded from the file the config names, and scoring
a batch of completions with all of them.

Every reward is called as TRL calls one: `prompts` (each completion's prompt as the record holds it: text or
messages), `completions` (the text; for a prompt written as messages, a list of one assistant message, as TRL gives
a conversational completion), `completion_ids` (the sampled ids, an ending EOS included) and every other field of the
records as a keyword argument, one value per completion; it returns one float per completion. The weighted sum of
the rewards is a completion's reward.

Built in (config/blocks.py's BUILTIN_REWARDS names them and their keys):
- exact_match: 1 when the final answer equals the record's `field` (default "answer"), both stripped; the final
  answer is the completion, or with `pattern` (a regular expression) its last match (its first group when it has
  one); no match scores 0.
- numeric_match: 1 when the last number of the completion (or `pattern`'s last match) is within `tolerance`
  (default 1e-6) of the field's number.
- format: 1 when the whole completion, stripped, matches `pattern` (re.fullmatch, `.` matching newlines too).
- length_penalty: DAPO's soft overlong punishment (TRL's get_soft_overlong_punishment): 0 up to
  max_completion_length - `cache` tokens (cache: a quarter of max_completion_length by default), then falling
  linearly to -1 at max_completion_length.

A user's function is read from its file only: the file is parsed (not run) when the data loads, so a missing file or
function is an error before the model loads, and imported when training starts, with one line saying that it runs
the user's code. Whatever it does wrong at a step stops the run with one line naming the file and the function, and
the last checkpoint is left as it was: it raises, exits (sys.exit, exit()), returns the wrong number of values, or a
value that is not a finite real number (complex, None, text, an array of another shape, inf, NaN, an integer beyond a
float's range). True and False count as 1 and 0. Ctrl-C stays an interrupt; os._exit and SIGKILL end the process
where no Python code can report them."""

from __future__ import annotations

import ast
import importlib.util
import math
import numbers
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from gpt4all_training.errors import UserError

NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?"


@dataclass
class Reward:
    """One entry of `rewards`: what its metrics are called (rewards/<name>/mean), its weight, where it comes from
    ("built in", or the user's file) and the function (None for a user's until `load` runs its file)."""
    name: str
    weight: float
    origin: str
    function: Optional[Callable[..., Any]] = None
    fields: tuple[str, ...] = ()  # record fields a built-in reads (checked when the data loads)
    numeric: bool = False  # whether those fields must hold numbers

    @property
    def described(self) -> str:
        return f"reward {self.name}" if self.origin == "built in" else f"reward {self.name} in {self.origin}"


# ---------------------------------------------------------------- the built-in rewards

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


def exact_match(field: str = "answer", pattern: Optional[str] = None) -> Callable[..., list[float]]:
    def reward(completions, **columns) -> list[float]:
        return [float(final_answer(completion_text(c), pattern) == str(answer).strip())
                for c, answer in zip(completions, columns[field])]
    return reward


def numeric_match(field: str = "answer", pattern: Optional[str] = None,
                  tolerance: float = 1e-6) -> Callable[..., list[float]]:
    def reward(completions, **columns) -> list[float]:
        out = []
        for completion, answer in zip(completions, columns[field]):
            got, expected = as_number(final_answer(completion_text(completion), pattern or NUMBER)), \
                as_number(str(answer))
            out.append(float(got is not None and expected is not None and abs(got - expected) <= tolerance))
        return out
    return reward


def format_match(pattern: str) -> Callable[..., list[float]]:
    compiled = re.compile(pattern, re.DOTALL)

    def reward(completions, **columns) -> list[float]:
        return [float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions]
    return reward


def length_penalty(max_completion_length: int, cache: Optional[int] = None) -> Callable[..., list[float]]:
    cache = cache or max(1, max_completion_length // 4)
    free = max_completion_length - cache

    def reward(completion_ids, **columns) -> list[float]:
        return [0.0 if len(ids) <= free else (free - len(ids)) / cache for ids in completion_ids]
    return reward


def builtin_reward(entry: dict[str, Any], max_completion_length: int) -> Reward:
    name, weight = entry["name"], float(entry.get("weight", 1.0))
    if name == "exact_match":
        field = entry.get("field", "answer")
        return Reward(name, weight, "built in", exact_match(field, entry.get("pattern")), (field,))
    if name == "numeric_match":
        field = entry.get("field", "answer")
        return Reward(name, weight, "built in", numeric_match(field, entry.get("pattern"),
                                                              float(entry.get("tolerance", 1e-6))), (field,), True)
    if name == "format":
        return Reward(name, weight, "built in", format_match(entry["pattern"]))
    return Reward(name, weight, "built in", length_penalty(max_completion_length, entry.get("cache")))


def rewards_of(config) -> list[Reward]:
    """The config's rewards (validated by the config), a user's function not loaded yet."""
    return [builtin_reward(entry, config.max_completion_length) if "name" in entry
            else Reward(entry["function"], float(entry.get("weight", 1.0)), entry["module"])
            for entry in config.rewards or []]


# ---------------------------------------------------------------- a user's own function

def check_user_reward(reward: Reward, key: str = "rewards") -> None:
    """The user's file exists and defines the function at its top level: read and parsed, never run. `key` is the
    config key that names it, for the error lines."""
    path = Path(reward.origin).expanduser()
    if not path.is_file():
        raise UserError(f"{key}: module {reward.origin}: no such file; give the path of the Python file that "
                        f"defines {reward.name}")
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{key}: module {reward.origin}: not Python that parses ({exc})") from None
    defined = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assigned = {target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets
                if isinstance(target, ast.Name)}
    if reward.name not in defined and reward.name not in assigned:
        raise UserError(f"{key}: module {reward.origin} defines no function {reward.name!r} at its top level "
                        f"(it defines: {', '.join(defined) or 'none'}); fix function or the file")


def load_user_reward(reward: Reward, log: Callable[[str], Any], key: str = "rewards",
                     calls: str = "called at every step") -> None:
    """Run the user's file (its top level, once per process) and take the function from it; `key` names the config
    key and `calls` says when the function runs, for the log and the error lines."""
    path = Path(reward.origin).expanduser().resolve()
    log(f"{key}: running your code: {reward.name} from {path} (imported once, {calls}, in this process)")
    spec = importlib.util.spec_from_file_location(f"grpo_reward_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise UserError(f"{key}: module {reward.origin}: not a Python file Python can import; give a .py file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the user's code failed (or exited) as it was imported: say where, in one line
        raise UserError(f"{key}: importing {reward.origin} {what_it_raised(exc)}") from None
    function = getattr(module, reward.name, None)
    if not callable(function):
        raise UserError(f"{key}: {reward.name} in {reward.origin} is not a function")
    reward.function = function


def first_line(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # the user's exception class with a __str__ that fails
        text = ""
    return (text.splitlines() or [""])[0][:200]


# ---------------------------------------------------------------- scoring

def score(rewards: list[Reward], prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
          columns: dict[str, list[Any]]) -> tuple[np.ndarray, Optional[str]]:
    """((completions, rewards) float64 of every reward's values, None), or (an empty array, the line that says which
    reward failed and how). Never raises for the user's code (an exception, sys.exit, a value that is not a finite
    real number): the caller stops every process together. Ctrl-C while a reward runs stays an interrupt."""
    values = np.zeros((len(completions), len(rewards)), dtype=np.float64)
    for k, reward in enumerate(rewards):
        assert reward.function is not None, "load_user_reward runs before the first step"
        try:
            got = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            column, problem = reward_values(got, len(completions))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the user's code, sys.exit included: reported in one line, the run stopped
            return values[:0], f"{reward.described} {what_it_raised(exc)}"
        if problem:
            return values[:0], f"{reward.described} {problem}"
        values[:, k] = column
    return values, None


def what_it_raised(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"exited (SystemExit: {shown(exc.code)}); a reward returns its values, it does not end the process"
    message = first_line(exc)
    return f"raised {type(exc).__name__}: {message}" if message else f"raised {type(exc).__name__}"


def reward_values(got: Any, expected: int) -> tuple[list[float], Optional[str]]:
    """(one float per completion, None) of what a reward returned for `expected` completions, or ([], what is wrong
    with it). Iterating `got` may run the user's code (a generator): what that raises is the caller's to report."""
    try:
        items = None if isinstance(got, (str, bytes, dict, set, frozenset)) else iter(got)
    except TypeError:
        items = None
    if items is None:
        described = "None" if got is None else type(got).__name__
        return [], f"returned {described}, not a list of {expected} numbers (one per completion)"
    got = list(items)
    if len(got) != expected:
        return [], f"returned {len(got)} values for {expected} completions; return one number per completion"
    floats = []
    for i, value in enumerate(got):
        number = real_number(value, i + 1)
        if isinstance(number, str):
            return [], number
        floats.append(number)
    return floats, None


def real_number(value: Any, completion: int) -> float | str:
    """A reward's value for the `completion`th completion as a float, or what is wrong with it. Python's and numpy's
    real numbers, and 0-d numpy arrays and torch tensors of them, are numbers; True and False count as 1 and 0 (bool
    is an int, and TRL takes them so). Complex numbers, None, text, arrays of another shape, numbers beyond a float's
    range, inf and NaN are not."""
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # numpy's scalars, 0-d arrays and tensors
        value = value.item()
    if not isinstance(value, numbers.Real):
        return (f"returned {shown(value)} for completion {completion}, not a real number; return one real number "
                f"per completion")
    try:
        number = float(value)
    except OverflowError:
        described = f"an integer of {value.bit_length()} bits" if isinstance(value, int) else shown(value)
        return f"returned {described} for completion {completion}, beyond a float's range; return finite numbers"
    if not math.isfinite(number):
        return f"returned {number} for completion {completion}; return finite numbers"
    return number


def shown(value: Any) -> str:
    """`value` as an error line shows it: its repr, cut short."""
    try:
        text = repr(value)
    except Exception:  # a repr that fails (the user's class, an int of too many digits): its type instead
        return f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."
