"""Issue 40, class 1: the studio reads, writes and runs nothing outside its workdir.

Every local path a config can name is found from its schema (the fields typed PathName or marked LocalPath,
config/fields.py), and every path a request can name from the request models' and routes' types. Each is planted
with a path that leaves the workdir (absolute, `..`, `~`, and a symbolic link in the workdir to a folder outside)
and sent to every endpoint that takes it: a 403 with one line naming the key, nothing in the workdir changed, nothing
outside written, and the outside reward module never run. Two tests keep the marks complete: every field of every
config schema and every request parameter that can hold text is either marked a path or listed here as a name.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml

from gpt4all_training.config import schemas
from gpt4all_training.config.blocks import Block
from gpt4all_training.config.fields import path_fields
from gpt4all_training.config.loader import build_config
from gpt4all_training.studio.workdir import OutsideWorkdir, Workdir

from .entry_points import snapshot
from .web_apps import holds_text, parameters, studio_client, studio_error

CONFIGS = [cls for cls in vars(schemas).values()
           if isinstance(cls, type) and issubclass(cls, Block) and cls.__module__ == schemas.__name__]
# Text fields that name no file: each with what it is instead.
NOT_PATHS = {
    "model_revision": "a Hub revision", "revision": "a Hub revision", "text_field": "a record field",
    "lora_target_modules": "module names of the model", "model_config_overrides": "model config fields",
    "eval_tasks": "harness task names", "resume_allow_changes": "config keys", "wandb_entity": "a wandb team",
    "wandb_project_name": "a wandb project", "save_name": "a Hub repo id", "prompt": "text", "stop": "text",
    "split": "a dataset split", "special_tokens": "tokens",
}
# Request parameters that name no file directly: each looked up in a list, or joined under a folder of the workdir
# and confined with it, or not a name at all.
NOT_PATH_PARAMETERS = {
    ("/api/login", "key"): "the API key", ("/api/clean", "oasst"): "a choice",
    ("/api/data", "config"): "a preset's name (a saved config's is its path), looked up in the presets listed",
    ("/api/presets", "name"): "a preset's name, looked up in the presets listed",
    ("/api/configs", "name"): "a file name under configs/ (letters, digits, . _ -)",
    ("/api/configs", "values"): "a config: its paths are the schema's (the tests below)",
    ("/api/runs/{name}", "name"): "a run's name under runs/", ("/api/runs/{name}/stop", "name"): "a run's name",
    ("/api/runs/{name}/resume", "name"): "a run's name", ("/api/runs/{name}/events", "name"): "a run's name",
    ("/api/runs", "launcher"): "a choice", ("/api/runs", "accelerate_config"): "a name in configs/accelerate/",
    ("/api/runs", "devices"): "device numbers", ("/api/jobs/map", "run"): "a run's name under runs/",
    ("/api/jobs/map", "layout"): "a choice", ("/api/jobs/eval", "tasks"): "task names",
    ("/api/jobs/eval", "name"): "a folder name under eval/", ("/api/jobs/export", "format"): "a choice",
    ("/api/jobs/export", "dtype"): "a choice", ("/api/jobs/{job_id}", "job_id"): "a job's id",
    ("/api/chat", "messages"): "the conversation", ("/api/chat", "messages.0.role"): "a role",
    ("/api/chat", "messages.0.content"): "text",
    ("/api/data", "overrides"): "key=value overrides: the config they make is confined (the tests above)",
    ("/api/jobs/map", "color"): "a column name", ("/api/jobs/curate", "embedder"): "a choice",
    ("/api/jobs/curate", "drop"): "rules on columns", ("/api/jobs/curate", "label_column"): "a column name",
    ("/api/jobs/curate", "name"): "a file name's stem inside the output folder", ("/api/jobs/eval", "dtype"): "a choice",
    ("/api/jobs/export", "max_shard_size"): "a size",
}
VARIANTS = ("absolute", "dotdot", "home", "link")
REWARD = "def score(completions, **_):\n    return [0.0 for _ in completions]\n"


@pytest.fixture
def place(tmp_path, monkeypatch) -> dict[str, Path]:
    """A workdir holding a config, a data file, a run folder and `escape`, a link to the folder outside; outside, a
    reward module that leaves a mark when it is imported, and the home folder (`~`)."""
    work, outside = tmp_path / "work", tmp_path / "outside"
    (work / "configs").mkdir(parents=True)
    (work / "data").mkdir()
    (work / "data" / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (work / "configs" / "ok.yaml").write_text(yaml.safe_dump(BASE))
    (work / "runs" / "r").mkdir(parents=True)
    (work / "runs" / "r" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    outside.mkdir()
    (outside / "reward.py").write_text(f"open({str(outside / 'ran')!r}, 'w').close()\n{REWARD}")
    (work / "escape").symlink_to(outside, target_is_directory=True)
    monkeypatch.setenv("HOME", str(outside))
    monkeypatch.chdir(work)
    return {"work": work, "outside": outside}


def planted(variant: str, outside: Path, name: str) -> str:
    """A path to `name` outside the workdir, spelt as `variant`."""
    return {"absolute": str(outside / name), "dotdot": f"../outside/{name}", "home": f"~/{name}",
            "link": f"escape/{name}"}[variant]


BASE = {"model_name": "models/tiny", "dataset_path": "data/chat.jsonl", "output_dir": "runs/planted", "max_steps": 2}


def values_with(field: str, path: str) -> dict:
    """A valid training config whose `field` names `path` (the reward module of a grpo run, for rewards)."""
    if field == "rewards":
        return {**BASE, "objective": "grpo", "rewards": [{"module": path, "function": "score"}]}
    return {**BASE, field: path}


def text_fields(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if holds_text(hints[f.name])]


def test_every_text_field_of_every_config_is_a_marked_path_or_a_known_name():
    """A field added later that names a file fails here until its type is marked (and then the tests below plant
    paths in it), or it is listed as a name."""
    assert {cls.__name__ for cls in CONFIGS} >= {"TrainConfig", "InferenceConfig", "GenerateConfig",
                                                 "TokenizerConfig"}
    unclassified = {f"{cls.__name__}.{name}" for cls in CONFIGS for name in text_fields(cls)
                    if name not in path_fields(cls) and name not in NOT_PATHS}
    assert unclassified == set()
    assert {name for cls in CONFIGS for name in path_fields(cls)} & set(NOT_PATHS) == set()


CONFIG_CASES = [(cls, field, variant) for cls in CONFIGS for field, mark in path_fields(cls).items()
                for variant in (VARIANTS if not mark.within else ("absolute", "dotdot"))]


@pytest.mark.parametrize("cls, field, variant", CONFIG_CASES,
                         ids=[f"{c.__name__}.{f}-{v}" for c, f, v in CONFIG_CASES])
def test_the_one_rule_refuses_an_outside_path_in_every_path_field_of_every_config(place, cls, field, variant):
    """Workdir.confine, which the studio applies to every config it loads or builds, on each schema's own fields
    (inference, generation and tokenizer configs included, which no request names directly)."""
    mark = path_fields(cls)[field]
    path = planted(variant, place["outside"], "reward.py" if mark.keys else "x")
    value = [{"module": path, "function": "score"}] if mark.keys and field == "rewards" else \
        {"module": path, "function": "score"} if mark.keys else path
    config = build_config({field: value, **({"model_name": "models/tiny"} if mark.within else {})}, cls)
    key = f"{field} entry 1 module" if field == "rewards" else f"{field} module" if mark.keys else field
    with pytest.raises(OutsideWorkdir) as refused:
        Workdir(place["work"]).confine(config)
    assert str(refused.value).startswith(f"{key} ")


TRAIN_CASES = [(field, variant) for field, mark in path_fields(schemas.TrainConfig).items()
               for variant in (VARIANTS if not mark.within else ("absolute", "dotdot"))]


@pytest.mark.parametrize("field, variant", TRAIN_CASES, ids=[f"{f}-{v}" for f, v in TRAIN_CASES])
def test_an_outside_path_in_any_config_key_is_403_at_every_endpoint_that_takes_a_config(place, field, variant):
    """Saved through the form (/api/configs), or written into the workdir by hand and then planned, checked,
    shown (/api/data), started (/api/runs) or resumed: 403 naming the key, and nothing runs."""
    work, outside = place["work"], place["outside"]
    path = planted(variant, outside, "reward.py" if field == "rewards" else "x")
    key = "rewards entry 1 module" if field == "rewards" else field
    values = values_with(field, path)
    (work / "configs" / "planted.yaml").write_text(yaml.safe_dump(values))
    (work / "runs" / "s").mkdir()  # a run the studio started with that config, which failed: resume starts it again
    (work / "runs" / "s" / "studio.json").write_text(json.dumps({
        "command": "gpt4all-training train --config configs/planted.yaml", "config": "configs/planted.yaml",
        "pid": 2 ** 22 + 7, "create_time": 0.0, "launch": {"config": "configs/planted.yaml"}}))
    before, outside_before = snapshot(work), snapshot(outside)
    requests = [("/api/configs", {"name": "planted", "values": values}),
                ("/api/plan", {"config": "configs/planted.yaml"}), ("/api/check", {"config": "configs/planted.yaml"}),
                ("/api/runs", {"config": "configs/planted.yaml"}), ("/api/runs/s/resume", None)]
    if field not in ("model_name", "dataset_path"):  # /api/data's own model_name and dataset_path replace these
        requests.append(("/api/data", {"config": "configs/planted.yaml", "model_name": "models/tiny",
                                       "dataset_path": "data/chat.jsonl"}))
    with studio_client(work) as client:
        for route, body in requests:
            line = studio_error(client.post(route, json=body), 403)
            assert line.startswith(f"error: {key} "), (route, line)
    assert snapshot(work) == before and snapshot(outside) == outside_before
    assert not (outside / "ran").exists()


# Valid bodies of the routes that take paths, and the path parameters of every route: one path at a time is
# replaced by one outside the workdir.
BODIES = {
    "/api/clean": {"inputs": ["data/chat.jsonl"], "output_dir": "data/cleaned", "rejects": "data/rejects.jsonl"},
    "/api/data": {"config": "configs/ok.yaml", "model_name": "models/tiny", "dataset_path": "data/chat.jsonl",
                  "dump": "data/examples.jsonl"},
    "/api/plan": {"config": "configs/ok.yaml"}, "/api/check": {"config": "configs/ok.yaml"},
    "/api/runs": {"config": "configs/ok.yaml"},
    "/api/jobs/map": {"run": "r", "model": "runs/r/final", "compare": "maps/q", "png": "maps/r/map.png",
                      "clusters_csv": "maps/r/map.csv"},
    "/api/jobs/curate": {"input": "maps/r", "output": "data/curated", "label_ids": "data/bad.json"},
    "/api/jobs/eval": {"models": ["models/tiny"], "tasks": ["gpt4all_exact_match"], "name": "e",
                       "include_path": ["tasks"]},
    "/api/jobs/export": {"source": "models/tiny", "to": "exports/x", "format": "hf", "base": "models/tiny"},
    "/api/chat": {"model": "models/tiny", "messages": [{"role": "user", "content": "hi"}]},
}
PATH_PARAMETERS = [("/files/{name:path}", "path", "name"), ("/api/upload", "query", "path"),
                   ("/api/clean", "body", "inputs"), ("/api/clean", "body", "output_dir"),
                   ("/api/clean", "body", "rejects"),
                   ("/api/data", "body", "model_name"), ("/api/data", "body", "dataset_path"),
                   ("/api/data", "body", "dump"),
                   ("/api/plan", "body", "config"), ("/api/check", "body", "config"), ("/api/runs", "body", "config"),
                   ("/api/jobs/map", "body", "model"), ("/api/jobs/map", "body", "compare"),
                   ("/api/jobs/map", "body", "png"), ("/api/jobs/map", "body", "clusters_csv"),
                   ("/api/jobs/curate", "body", "input"), ("/api/jobs/curate", "body", "output"),
                   ("/api/jobs/curate", "body", "label_ids"),
                   ("/api/jobs/eval", "body", "models"), ("/api/jobs/eval", "body", "include_path"),
                   ("/api/jobs/export", "body", "source"), ("/api/jobs/export", "body", "to"),
                   ("/api/jobs/export", "body", "base"), ("/api/chat", "body", "model")]


def test_every_text_parameter_of_every_request_is_a_marked_path_or_a_known_name(place):
    """A parameter added later that names a file fails here until it is typed PathName and planted below, or it
    is listed as a name."""
    with studio_client(place["work"]) as client:
        found = parameters(client.app)
    unclassified = {(p.route, p.name) for p in found
                    if holds_text(p.annotation) and not p.path and (p.route, p.name) not in NOT_PATH_PARAMETERS}
    assert unclassified == set()
    assert sorted((p.route, p.where, p.name) for p in found if p.path) == sorted(PATH_PARAMETERS)


REQUEST_CASES = [(*parameter, variant) for parameter in PATH_PARAMETERS for variant in VARIANTS]


@pytest.mark.parametrize("route, where, name, variant", REQUEST_CASES,
                         ids=[f"{r}-{n}-{v}" for r, _, n, v in REQUEST_CASES])
def test_an_outside_path_in_any_path_parameter_of_any_request_is_403(place, route, where, name, variant):
    work, outside = place["work"], place["outside"]
    path = planted(variant, outside, "x.jsonl")
    before, outside_before = snapshot(work), snapshot(outside)
    with studio_client(work) as client:
        if where == "path":
            response = client.get(f"/files/{quote(path, safe='')}")  # as sent: `..` is not resolved by the client
        elif where == "query":
            response = client.post(route, params={name: path}, content=b'{"text": "x"}\n')
        else:
            body = {**BODIES[route], name: [path] if isinstance(BODIES[route][name], list) else path}
            response = client.post(route, json=body)
    key = {"/api/upload": "path", "/files/{name:path}": "path"}.get(route, name)
    assert studio_error(response, 403).startswith(f"error: {key} "), response.text
    assert snapshot(work) == before and snapshot(outside) == outside_before


def test_packaged_model_names_and_hub_ids_are_names_not_paths(place):
    """A short name (smollm2) and a Hub id are relative names that lead nowhere outside: saved as given."""
    with studio_client(place["work"]) as client:
        for name, model in (("short", "smollm2"), ("hub", "HuggingFaceTB/SmolLM2-135M")):
            response = client.post("/api/configs", json={"name": name, "values": {**BASE, "model_name": model}})
            assert response.status_code == 200, response.text
            assert yaml.safe_load((place["work"] / "configs" / f"{name}.yaml").read_text())["model_name"] == model


def test_a_reward_module_inside_the_workdir_is_taken_and_the_form_says_it_is_code(place):
    (place["work"] / "rewards.py").write_text(REWARD)
    values = values_with("rewards", "rewards.py")
    with studio_client(place["work"]) as client:
        assert client.post("/api/configs", json={"name": "grpo", "values": values}).status_code == 200
        fields = {f["name"]: f for block in client.get("/api/form").json()["blocks"] for f in block["fields"]}
    assert fields["rewards"]["kind"] == "mappings"
    assert fields["rewards"]["warning"].startswith("A module named here is Python code: the run imports and runs it")
    assert [name for name, field in fields.items() if field["warning"]] == ["rewards"]
    page = (Path(__file__).parents[2] / "gpt4all_training" / "studio" / "static" / "pages" / "train.js").read_text()
    assert "field.warning" in page  # the form shows it under the field
