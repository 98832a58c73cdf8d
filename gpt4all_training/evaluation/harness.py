"""lm-evaluation-harness on a model opened by this project's loader.

The harness's own `hf` model class (HFLM) wraps the model and tokenizer we load, so anything `--model` may name
works: a folder, a GGUF file, an adapter over its base, a `step_N/` checkpoint. Tasks are the harness's: a name it
ships (whose data it downloads from the Hub), a name defined by task YAML files under an include path, or a YAML
file. The scores are the harness's own, computed by `lm_eval.simple_evaluate` with the harness's default seeds, so
they equal what its `lm_eval --model hf` command reports for the same weights, tasks and settings. Only the text a
generate_until task asks for is decoded by this project's decoder (model/decoding.py) instead of transformers'
generate, with generate's meaning of the task's settings (see `decoding_hflm`).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from gpt4all_training.errors import UserError
from gpt4all_training.evaluation.results import per_example
from gpt4all_training.model.decoding import Sampling, Sequence, decode_all, eos_token_ids
from gpt4all_training.model.trained import DTYPES, describe, open_model

# The harness's defaults (its command's --seed 0,1234,1234,1234): Python's random, NumPy, torch, few-shot sampler.
HARNESS_SEEDS = {"python": 0, "numpy": 1234, "torch": 1234, "fewshot": 1234}
# The generation settings the decoder reads as transformers' generate does; a task asking for another (num_beams,
# ...) is decoded by generate itself, so every task the harness runs still runs.
DECODER_SETTINGS = {"do_sample", "temperature", "top_p", "top_k", "repetition_penalty"}
TASK_FILE_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class EvalSettings:
    """Everything besides the model that decides the scores. `num_fewshot` None keeps each task's own; `seed` None
    keeps the harness's default seeds; `device` None is CUDA when there is one."""
    tasks: tuple[str, ...]
    include_paths: tuple[str, ...] = ()
    limit: Optional[int] = None
    num_fewshot: Optional[int] = None
    batch_size: int = 1
    dtype: str = "float32"
    device: Optional[str] = None
    seed: Optional[int] = None
    apply_chat_template: bool = False

    def seeds(self) -> dict[str, int]:
        return dict(HARNESS_SEEDS) if self.seed is None else dict.fromkeys(HARNESS_SEEDS, self.seed)


@dataclass(frozen=True)
class Keys:
    """How the user named the tasks and include paths, for error lines: options of `eval`, or training config keys."""
    tasks: str = "--tasks"
    include_path: str = "--include-path"


def is_task_file(name: str) -> bool:
    return name.endswith(TASK_FILE_SUFFIXES)


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def task_manager_for(tasks: tuple[str, ...], include_paths: tuple[str, ...], keys: Keys = Keys()):
    """A harness TaskManager that knows every task in `tasks`, or a UserError naming the first it cannot find.

    Indexing the harness's own tasks reads thousands of YAML files (half a minute on a small machine), so when the
    include paths define every requested name (or only task files are asked for), they are indexed alone."""
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise UserError(f"{keys.tasks}: name at least one task")
    for folder in include_paths:
        if not Path(folder).is_dir():
            raise UserError(f"{keys.include_path}: {folder} is not a folder of task YAML files")
    for name in tasks:
        if is_task_file(name) and not Path(name).is_file():
            raise UserError(f"{keys.tasks}: task file {name} does not exist")
    names = [name for name in tasks if not is_task_file(name)]
    if include_paths or not names:
        local = TaskManager(include_path=list(include_paths) or None, include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local
    manager = TaskManager(include_path=list(include_paths) or None)
    for name in names:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else (
                f"; task YAML files of your own go in a folder passed with {keys.include_path}")
            raise UserError(f"{keys.tasks}: unknown task {name!r}{hint}")
    return manager


def load_tasks(manager, tasks: tuple[str, ...], keys: Keys = Keys()) -> list:
    """The harness's Task and Group objects for `tasks`, with their data loaded. A task whose data cannot be read
    (a Hub dataset while offline, a missing data file) is a UserError naming it."""
    objects = []
    for name in tasks:
        try:
            loaded = manager.load([name])
        except OSError as exc:  # datasets' ConnectionError (Hub unreachable or offline), FileNotFoundError
            raise UserError(f"{keys.tasks}: the data of task {name!r} cannot be loaded ({first_line(exc)}); the "
                            f"harness's own tasks download theirs from the Hub, so run once with network access, "
                            f"or use local task files ({keys.include_path})") from None
        except yaml.YAMLError as exc:
            raise UserError(f"{keys.tasks}: task file {name} is not valid YAML ({first_line(exc)})") from None
        # Passed on as objects, so simple_evaluate does not build (and read the data of) each task again.
        children = {child for kids in loaded.get("group_map", {}).values() for child in kids}
        objects += [obj for key, obj in {**loaded.get("groups", {}), **loaded["tasks"]}.items() if key not in children]
    return objects


def evaluate(model_name: str, settings: EvalSettings, keys: Keys = Keys()) -> dict[str, Any]:
    """The harness's results for `model_name` (see trained.open_model for what it may be) under `settings`, plus
    a `run` entry with what decides the scores: the model's paths and content hashes, the settings, the seeds,
    the chat template applied and the library versions."""
    # Tasks first: a misspelt task name costs no model load.
    manager = task_manager_for(settings.tasks, settings.include_paths, keys)
    tasks = load_tasks(manager, settings.tasks, keys)
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device: cuda was asked for, and torch sees no CUDA device")
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tokenizer = open_model(model_name, DTYPES[settings.dtype], device)
    results = score(model, tokenizer, manager, tasks, settings, model_name)
    results["run"] = {"model": describe(model_name), **results["run"], "device": str(device)}
    return results


def score(model, tokenizer, manager, tasks: list, settings: EvalSettings, label: str) -> dict[str, Any]:
    """The harness's results for a model already in memory (the harness puts it in eval mode), with the `run`
    entry of what decides them besides the model; `label` names the model in errors."""
    import lm_eval
    import transformers

    lm = decoding_hflm()(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size)
    template = lm.chat_template(True) if settings.apply_chat_template else None
    if settings.apply_chat_template and not template:
        raise UserError(f"--apply-chat-template: the tokenizer of {label} has no chat template")
    seeds = settings.seeds()
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, num_fewshot=settings.num_fewshot, limit=settings.limit,
        batch_size=settings.batch_size, log_samples=True, apply_chat_template=settings.apply_chat_template,
        fewshot_as_multiturn=settings.apply_chat_template, random_seed=seeds["python"],
        numpy_random_seed=seeds["numpy"], torch_random_seed=seeds["torch"], fewshot_random_seed=seeds["fewshot"])
    # Each example's scores, not its prompts and outputs: what the intervals and paired comparisons need.
    results["per_example"] = per_example(results.pop("samples", {}), results["results"])
    results["run"] = {
        **asdict(settings),
        "seeds": seeds,
        "chat_template": template,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
        "versions": {"lm_eval": lm_eval.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, "python": platform.python_version()},
    }
    return results


def generate_sampling(settings: dict[str, Any], defaults) -> Optional[Sampling]:
    """The sampling transformers' generate applies for a task's generation settings: greedy unless do_sample, and
    what a setting leaves unset taken from the model's generation config (`defaults`); None for settings the
    decoder does not have."""
    if set(settings) - DECODER_SETTINGS:
        return None

    def value(key: str, default):
        given = settings.get(key)
        given = getattr(defaults, key, None) if given is None else given
        return default if given is None else given

    penalty = float(value("repetition_penalty", 1.0))
    if not value("do_sample", False):
        return Sampling(repetition_penalty=penalty)
    return Sampling(float(value("temperature", 1.0)), float(value("top_p", 1.0)), int(value("top_k", 0)), penalty)


@functools.cache
def decoding_hflm():
    """The harness's `hf` model class (HFLM) with its generation hook, `_model_generate`, decoding with our decoder.

    generate_until hands the hook a left-padded batch of contexts and takes back the contexts followed by the
    generated ids (padded), which it decodes and cuts at the task's first stop string itself. Greedy text equals
    generate's: the same ids up to the model's EOS, a stop string or max_length (generate runs a batch on until every
    row has seen a stop string; the text after the first is cut either way). A sampled row draws from torch's global
    generator, which the harness seeds, after the same processing: on CPU the draws are generate's until a row of the
    batch ends, then they differ, because generate goes on drawing for finished rows and the decoder does not. Such a
    task's score is then another sample of the same distribution, as it already is under another batch size."""
    from lm_eval.models.huggingface import HFLM

    class DecodingHFLM(HFLM):
        def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
            mask = generation_kwargs.pop("attention_mask", None)
            sampling = generate_sampling(generation_kwargs, getattr(self.model, "generation_config", None))
            if sampling is None:
                return super()._model_generate(context, max_length, stop, attention_mask=mask, **generation_kwargs)
            real = torch.ones_like(context, dtype=torch.bool) if mask is None else mask.bool()
            sequences = [Sequence(ids[kept].tolist(), max_length - context.shape[1], sampling, stop=tuple(stop))
                         for ids, kept in zip(context, real)]
            with torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                enabled=self.mixed_precision_dtype is not None):
                decode_all(self.model, self.tokenizer, sequences, eos_token_ids(self.model, self.tokenizer),
                           batch_size=len(sequences))
            generated = [s.ids + ([] if s.eos_id is None else [s.eos_id]) for s in sequences]
            width = max(len(ids) for ids in generated)
            padded = [ids + [self.tokenizer.pad_token_id] * (width - len(ids)) for ids in generated]
            return torch.cat([context, torch.tensor(padded, dtype=context.dtype, device=context.device)], dim=1)

    return DecodingHFLM
