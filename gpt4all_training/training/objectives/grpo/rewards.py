"""grpo's rewards: the config's entries as rewards (a kind built in, or a user's own function loaded from the file
the config names), the record fields they read, scoring a batch of completions with all of them, and the validation
that scores greedy completions of the held-out prompts.

Every reward is called as TRL calls one: `prompts` (each completion's prompt as the record holds it: text or
messages), `completions` (the text; for a prompt written as messages, a list of one assistant message, as TRL gives
a conversational completion), `completion_ids` (the sampled ids, an ending EOS included) and every other field of the
records as a keyword argument, one value per completion; it returns one float per completion. The weighted sum of
the rewards is a completion's reward.

The kinds built in are one entry each in config/rewards.py's REWARD_KINDS, their functions in builtin_rewards.py.

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
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from gpt4all_training.config.rewards import REWARD_KINDS, compared_field
from gpt4all_training.data.prompt_records import Prompts
from gpt4all_training.data.records import record_location
from gpt4all_training.errors import TrainingError, UserError
from gpt4all_training.model.decoding import Sampling, Sequence
from gpt4all_training.training.objectives.grpo.builtin_rewards import as_number
from gpt4all_training.training.objectives.grpo.rollout import Decoder, completion_ids
from gpt4all_training.training.objectives.protocol import Batch


@dataclass
class Reward:
    """One entry of `rewards`: what its metrics are called (rewards/<name>/mean), its weight, where it comes from
    ("built in", or the user's file) and the function (None for a user's until `load_user_reward` runs its file)."""
    name: str
    weight: float
    origin: str
    function: Optional[Callable[..., Any]] = None
    fields: tuple[str, ...] = ()  # record fields a built-in reads (checked when the data loads)
    numeric: bool = False  # whether those fields must hold numbers

    @property
    def described(self) -> str:
        return f"reward {self.name}" if self.origin == "built in" else f"reward {self.name} in {self.origin}"


def builtin_reward(entry: dict[str, Any], max_completion_length: int) -> Reward:
    """The reward an entry naming a kind built in describes."""
    kind = REWARD_KINDS[entry["name"]]
    function = pkgutil.resolve_name(kind.implementation)(entry, max_completion_length)
    return Reward(kind.name, float(entry.get("weight", 1.0)), "built in", function,
                  (compared_field(entry),) if kind.compares_field else (), kind.numeric)


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


# ---------------------------------------------------------------- a run's rewards on its prompts

def check_reward_fields(rewards: list[Reward], dataset_path: str, *splits: Prompts) -> None:
    """Every kept record has the fields the built-in rewards read (numbers where they compare numbers)."""
    for split in splits:
        for fields, position in zip(split.fields, split.index):
            for reward in rewards:
                for name in reward.fields:
                    value = fields.get(name)
                    if value is None:
                        problem = f"no {name!r} field, which {reward.described} reads"
                    elif reward.numeric and (isinstance(value, bool) or as_number(str(value)) is None):
                        problem = f"field {name!r} is {value!r}, not the number {reward.described} compares with"
                    else:
                        continue
                    raise UserError(f"{record_location(dataset_path, position)}: {problem}; fix the record or the "
                                    f"reward's field")


def score_completions(rewards: list[Reward], sequences: list[Sequence], prompts: Prompts, positions: list[int],
                      per_prompt: int, backend) -> tuple[np.ndarray, torch.Tensor]:
    """(each reward's values, the weighted sums) of the completions, `per_prompt` of each prompt at `positions`; a
    reward that fails on any process stops every process with its line."""
    chat = [isinstance(prompts.prompts[p], list) for p in positions for _ in range(per_prompt)]
    texts = [s.text for s in sequences]
    completions = [[{"role": "assistant", "content": text}] if is_chat else text for text, is_chat in
                   zip(texts, chat)]
    fields = [prompts.fields[p] for p in positions for _ in range(per_prompt)]
    columns = {name: [f.get(name) for f in fields] for name in dict.fromkeys(k for f in fields for k in f)}
    values, problem = score(rewards, [prompts.prompts[p] for p in positions for _ in range(per_prompt)],
                            completions, [completion_ids(s) for s in sequences], columns)
    if backend.any_rank(problem is not None):
        raise TrainingError(f"{problem or 'a reward failed on another process (its output names it)'}; fix it, "
                            f"then run the same command again to continue from the last checkpoint")
    weights = np.array([reward.weight for reward in rewards])
    return values, torch.from_numpy(values @ weights)


class RewardValidation:
    """Validation of a grpo run: one greedy completion of each held-out prompt, scored by the rewards: the mean
    reward (val_reward), each reward's mean and the completions' mean length. Held-out prompts are sampled on every
    process as validation shares any split (evaluate.py)."""

    def __init__(self, rewards: list[Reward], decoder: Decoder, max_completion_length: int) -> None:
        self.rewards, self.decoder, self.max_completion_length = rewards, decoder, max_completion_length
        self.prompts = Prompts()  # the held-out prompts, once the objective has loaded its data
        self.width = 3 + len(rewards)  # completions, weighted reward, completion tokens, each reward

    def fetch(self, dataset, indices: list[int], pad_id: int) -> Batch:
        return {"position": torch.tensor(indices, dtype=torch.long)}

    def sums(self, model, batch: Batch) -> torch.Tensor:
        positions = batch["position"].tolist()
        sequences = [Sequence(self.prompts.ids[p], self.max_completion_length, Sampling()) for p in positions]
        self.decoder.decode(model, sequences, greedy=True)
        values, total = score_completions(self.rewards, sequences, self.prompts, positions, 1, self.decoder.backend)
        tokens = sum(len(s.ids) + (s.eos_id is not None) for s in sequences)
        return torch.tensor([len(sequences), float(total.sum()), tokens, *values.sum(axis=0)], dtype=torch.float64)

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        count = totals[0].item()
        if not count:
            return {}
        names = [reward.name for reward in self.rewards]
        return {"val_reward": totals[1].item() / count,
                **{f"val_rewards/{name}/mean": value / count for name, value in zip(names, totals[3:].tolist())},
                "val_completions/mean_length": totals[2].item() / count, "val_prompts": int(count)}
