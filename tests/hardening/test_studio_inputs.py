"""Issue 40, class 3: the studio's own inputs, each generated over every endpoint it reaches, in this process through
the real HTTP stack (starlette's TestClient; httpx's ASGI transport where two requests must interleave).

- A symbolic link in the workdir that leads outside it (in each folder the pickers list, or the folder itself) is
  left out of GET /api/files and GET /api/runs with a warning in the log; the rest is listed.
- A run's studio.json or studio_exit.json that is not what the studio writes (each key missing, each of the wrong
  type, not JSON) leaves that one run out of GET /api/runs with a warning; asked for by name it is one 400 line.
- A body nested 100,000 deep, to every JSON endpoint and to /api/upload, and each field nested 100 deep: 400.
- A body past its limit, with or without a Content-Length: 413, on every JSON endpoint and on /api/upload.
- Uploads never replace a file: two uploads to one name at once are a 200 and a 409, and the file is the first's.
- What a killed upload leaves behind is removed when the studio starts; another studio's running upload is not.
- The studio's API key in any value of a config (or its name) is refused naming the key, and nothing is saved.
Every refusal is the studio's one-line JSON error, and the workdir is byte for byte what it was.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import typing
from pathlib import Path

import httpx
import pytest
from support.paths import REPO

from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.files import MARKER
from gpt4all_training.studio.app import MAX_JSON_BYTES, StudioSettings, create_app
from gpt4all_training.studio.runs import ExitRecord, RunRecord
from gpt4all_training.studio.workdir import PARTIAL_SUFFIX

from .entry_points import snapshot
from .web_apps import STUDIO_URL, api_routes, holds_text, studio_client, studio_error

KEY = "studio-inputs-key-0123456789"
GOOD_RECORD = {"command": "gpt4all-training train --config configs/a.yaml", "config": "configs/a.yaml",
               "pid": 2 ** 22 + 7, "create_time": 0.0, "launch": {"config": "configs/a.yaml"}}
GOOD_EXIT = {"exit_code": 0, "stop_signal": None}


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A workdir with one of everything the pickers list, and a finished run started by the studio."""
    work = tmp_path / "work"
    for path, text in [("data/a.jsonl", '{"text": "x"}\n'), ("configs/a.yaml", "max_steps: 2\n"),
                       ("models/m/config.json", "{}"), ("exports/e.gguf", "GGUF"),
                       ("maps/r/inference.parquet", "PAR1"), ("runs/good/metrics.jsonl", '{"step": 1, "loss": 2.0}\n'),
                       (f"runs/good/final/{MARKER}", "{}"), ("runs/good/studio.json", json.dumps(GOOD_RECORD)),
                       ("runs/good/studio_exit.json", json.dumps(GOOD_EXIT))]:
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text(text)
    monkeypatch.chdir(work)
    return work


LISTED = {"data": ["data/a.jsonl"], "configs": ["configs/a.yaml"], "models": ["models/m", "runs/good/final"],
          "maps": ["maps/r"], "exports": ["exports/e.gguf"],
          # read from their package, outside the workdir: no link in the workdir changes them
          "packaged": [{"name": "smollm2", "description": "SmolLM2-135M-Instruct (GGUF Q4_1)", "install": None}]}


def outside_tree(root: Path) -> Path:
    """A folder outside the workdir holding something each picker would list."""
    for path in ("x.jsonl", "x.yaml", "x.gguf", "model/config.json", "map/inference.parquet", "run/metrics.jsonl"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("{}")
    return root


def expected(link: str) -> tuple[dict[str, list[str]], list[str]]:
    """(GET /api/files, the runs GET /api/runs names) once `link` leads outside: a link inside a folder is left
    out; a whole folder as a link takes what it held out with it (configs/: the run whose config it held)."""
    if "/" in link:
        return LISTED, ["good"]
    files = {**LISTED, **({link: []} if link in LISTED else {})}
    if link == "models":
        files["models"] = ["runs/good/final"]
    if link in ("runs", "configs"):
        files["models"] = ["models/m"]
    return files, [] if link in ("runs", "configs") else ["good"]


# (the link in the workdir, what it points to outside); and each listed folder itself as a link
LINKS = [("data/out.jsonl", "x.jsonl"), ("data/outdir", "."), ("configs/out.yaml", "x.yaml"),
         ("models/out", "model"), ("exports/out.gguf", "x.gguf"), ("maps/out", "map"), ("runs/out", "run"),
         *((folder, ".") for folder in ("data", "configs", "models", "exports", "maps", "runs"))]


@pytest.mark.parametrize("link, target", LINKS, ids=[link for link, _ in LINKS])
def test_a_link_out_of_the_workdir_is_left_out_of_every_listing_with_a_warning(workdir, tmp_path, caplog, link,
                                                                               target):
    outside = outside_tree(tmp_path / "outside")
    if (workdir / link).exists():  # a whole folder
        os.rename(workdir / link, tmp_path / f"moved-{link}")
    (workdir / link).symlink_to(outside / target)
    before = snapshot(workdir)
    with caplog.at_level(logging.WARNING, "gpt4all_training.studio"), studio_client(workdir) as client:
        files = client.get("/api/files")
        runs = client.get("/api/runs")
    listed, run_names = expected(link)
    assert files.status_code == 200 and files.json() == listed
    assert runs.status_code == 200 and [run["name"] for run in runs.json()["runs"]] == run_names
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings and all(str(workdir / link) in line or f"runs/{Path(link).name}" in line
                            or f"config {link}/a.yaml: outside the workdir" in line for line in warnings)
    assert snapshot(workdir) == before


def bad_records() -> list[tuple[str, str, bytes]]:
    """(case, file, its bytes): each key of each record missing, each of the wrong type, and files that are not a
    record at all."""
    cases = []
    for name, shape, good in (("studio.json", RunRecord, GOOD_RECORD), ("studio_exit.json", ExitRecord, GOOD_EXIT)):
        for key, field in shape.model_fields.items():
            if field.is_required():
                cases.append((f"{name}-no-{key}", name, json.dumps({k: v for k, v in good.items() if k != key})))
            wrong = [1] if field.annotation is str or typing.get_args(field.annotation)[:1] == (str,) else "wrong"
            cases.append((f"{name}-{key}-wrong-type", name, json.dumps({**good, key: wrong})))
        cases += [(f"{name}-not-json", name, '{"exit_code": '), (f"{name}-a-list", name, "[1, 2]"),
                  (f"{name}-empty", name, ""), (f"{name}-deep", name, "[" * 100_000 + "]" * 100_000)]
    return [(case, name, text.encode()) for case, name, text in cases]


@pytest.mark.parametrize("case, name, content", bad_records(), ids=[case for case, _, _ in bad_records()])
def test_a_bad_run_record_leaves_that_run_out_of_the_list_and_is_one_line_by_name(workdir, caplog, case, name,
                                                                                  content):
    bad = workdir / "runs" / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (bad / "studio.json").write_text(json.dumps(GOOD_RECORD))
    (bad / name).write_bytes(content)
    before = snapshot(workdir)
    with caplog.at_level(logging.WARNING, "gpt4all_training.studio"), studio_client(workdir) as client:
        runs = client.get("/api/runs")
        assert runs.status_code == 200 and [run["name"] for run in runs.json()["runs"]] == ["good"]
        assert client.get("/api/files").json()["models"] == ["models/m", "runs/good/final"]
        for method, path in (("GET", "/api/runs/bad"), ("GET", "/api/runs/bad/events"),
                             ("POST", "/api/runs/bad/stop"), ("POST", "/api/runs/bad/resume")):
            line = studio_error(client.request(method, path), 400)
            assert line.startswith(f"error: runs/bad/{name}: "), (path, line)
    [warning] = {record.getMessage() for record in caplog.records if record.levelno == logging.WARNING}
    assert warning.startswith(f"runs/bad left out of the run list: runs/bad/{name}: ")
    assert snapshot(workdir) == before


def json_routes(client) -> list[str]:
    return [route.path for route in api_routes(client.app) if route.dependant.body_params]


def test_a_body_nested_past_reason_is_400_at_every_json_endpoint_and_the_upload(workdir):
    before = snapshot(workdir)
    deep = b"[" * 100_000 + b"]" * 100_000
    with studio_client(workdir) as client:
        routes = json_routes(client)
        assert len(routes) >= 12
        for route in routes:
            line = studio_error(client.post(route, content=deep, headers={"Content-Type": "application/json"}), 400)
            assert line == "error: the request body is JSON nested too deeply to read", route
            for field in api_field_names(client, route):  # each field nested 100 deep (parsed, then refused)
                body = json.dumps({field: "HOLE"}).replace('"HOLE"', "[" * 100 + "]" * 100)
                studio_error(client.post(route, content=body, headers={"Content-Type": "application/json"}), 400)
        line = studio_error(client.post("/api/upload", params={"path": "data/deep.jsonl"}, content=deep), 400)
        assert line == ("error: upload data/deep.jsonl: line 1 is JSON nested too deeply to read; a JSONL file holds "
                        "one JSON object a line")
        values = {"model_config_overrides": {"n": json.loads("[" * 40 + "]" * 40)}}
        line = studio_error(client.post("/api/configs", json={"name": "deep", "values": values}), 400)
        assert line == "error: model_config_overrides: nested more than 32 levels deep; no config value is"
    assert snapshot(workdir) == before


def api_field_names(client, route: str) -> list[str]:
    [api] = [r for r in api_routes(client.app) if r.path == route and r.dependant.body_params]
    return list(api.dependant.body_params[0].field_info.annotation.model_fields)


def chunks_of(data: bytes, size: int = 1 << 16):
    """The body streamed in pieces, without a Content-Length (chunked, as a browser's upload may be)."""
    return (data[i:i + size] for i in range(0, len(data), size))


def test_a_body_past_its_limit_is_413_at_every_endpoint_with_or_without_its_length(workdir):
    before = snapshot(workdir)
    big = b'{"config": "' + b"x" * (2 << 20) + b'"}'
    with studio_client(workdir, max_upload_bytes=1000) as client:
        for route in json_routes(client):
            for content in (big, chunks_of(big)):
                line = studio_error(client.post(route, content=content, headers={"Content-Type": "application/json"}),
                                    413)
                assert line == f"error: the request body is larger than {MAX_JSON_BYTES:,} bytes", route
        upload = b'{"text": "x"}\n' * 100
        for content in (upload, chunks_of(upload, 100)):
            line = studio_error(client.post("/api/upload", params={"path": "data/big.jsonl"}, content=content), 413)
            assert line == ("error: upload: larger than the limit of 1,000 bytes; start the studio with a larger "
                            "--max-upload-mb, or put the file in the workdir yourself")
    assert snapshot(workdir) == before


def test_two_uploads_to_one_name_at_once_are_a_200_and_a_409_and_nothing_is_replaced(workdir):
    """Both pass the check that the name is free before either has written it; the second to finish finds it taken
    when it links its file into place."""
    app = create_app(StudioSettings(workdir=workdir))
    started, both_started = [], asyncio.Event()

    async def body(text: bytes):
        yield text
        started.append(text)
        if len(started) == 2:
            both_started.set()
        await both_started.wait()  # each stays in the middle of its upload until both are
        yield text

    async def uploads() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=STUDIO_URL) as client:
            return await asyncio.gather(*(client.post("/api/upload", params={"path": "data/same.jsonl"},
                                                      content=body(text))
                                          for text in (b'{"first": 1}\n', b'{"second": 2}\n')))

    responses = dict(zip((b'{"first": 1}\n', b'{"second": 2}\n'), asyncio.run(uploads())))
    assert sorted(response.status_code for response in responses.values()) == [200, 409]
    [(kept, taken)] = [(text, response) for text, response in responses.items() if response.status_code == 200]
    [refused] = [response for response in responses.values() if response.status_code == 409]
    assert taken.json() == {"path": "data/same.jsonl", "bytes": 2 * len(kept), "lines": 2}
    assert studio_error(refused, 409) == ("error: upload data/same.jsonl: data/same.jsonl exists; choose another "
                                          "name (an upload never replaces a file)")
    assert (workdir / "data" / "same.jsonl").read_bytes() == kept * 2
    before = snapshot(workdir)
    with studio_client(workdir) as client:  # and one after: the same refusal, the file untouched
        studio_error(client.post("/api/upload", params={"path": "data/same.jsonl"}, content=b'{"x": 1}\n'), 409)
    assert snapshot(workdir) == before
    assert sorted(p.name for p in (workdir / "data").iterdir()) == ["a.jsonl", "same.jsonl"]


UPLOADER = """
import asyncio, sys
from gpt4all_training.studio.workdir import Workdir

async def chunks():
    yield b'{"text": "x"}\\n'
    print("streaming", flush=True)
    await asyncio.sleep(600)

asyncio.run(Workdir(sys.argv[1]).upload("data/big.jsonl", chunks()))
"""


def uploading(workdir: Path) -> subprocess.Popen:
    """A process in the middle of an upload to data/big.jsonl (its temporary file written and held)."""
    process = subprocess.Popen([sys.executable, "-c", UPLOADER, str(workdir)], stdout=subprocess.PIPE, text=True,
                               cwd=workdir, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert process.stdout.readline() == "streaming\n"
    return process


def test_what_a_killed_upload_left_is_removed_when_the_studio_starts(workdir, caplog):
    killed = uploading(workdir)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    [left] = [p for p in (workdir / "data").iterdir() if p.name.endswith(PARTIAL_SUFFIX)]
    running = uploading(workdir)  # another studio's upload, still going: kept
    try:
        [held] = [p for p in (workdir / "data").iterdir() if p.name.endswith(PARTIAL_SUFFIX) and p != left]
        (workdir / "data" / ".notes.partial").write_text("mine")  # a user's own hidden files are not ours
        (workdir / ".big.jsonl.x.studio-upload.txt").write_text("mine")
        before = snapshot(workdir)
        with caplog.at_level(logging.WARNING, "gpt4all_training.studio"), studio_client(workdir) as client:
            assert client.get("/api/files").json()["data"] == ["data/a.jsonl"]
        assert not left.exists() and held.exists()
        assert {k: v for k, v in before.items() if k != f"data/{left.name}"} == snapshot(workdir)
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
            f"removed data/{left.name}: left by an upload that was cut short (the studio was killed)"]
    finally:
        running.kill()
        running.wait()


def secret_value(tp, key: str):
    """A value of type `tp` with `key` inside it."""
    base = typing.get_args(tp)[0] if type(None) in typing.get_args(tp) else tp
    if typing.get_origin(base) is list:
        inner = typing.get_args(base)[0]
        return [{"function": f"f_{key}"}] if inner is dict else [f"x{key}"]
    return {"entry": f"x{key}"} if base is dict else f"x{key}y"


TEXT_FIELDS = [name for name, tp in typing.get_type_hints(TrainConfig).items() if holds_text(tp)]


def test_the_studio_s_key_in_any_config_value_or_its_name_is_refused_naming_it(workdir):
    """The run's environment lacks the key, so nothing downstream could mask it: the studio refuses it here."""
    assert {"save_name", "model_name", "rewards", "model_config_overrides"} <= set(TEXT_FIELDS)
    assert "report_to" not in TEXT_FIELDS  # choices: no text of one's own
    hints = typing.get_type_hints(TrainConfig)
    before = snapshot(workdir)
    headers = {"Authorization": f"Bearer {KEY}"}
    with studio_client(workdir, api_key=KEY) as client:
        for field in TEXT_FIELDS:
            values = {"model_name": "models/m", "dataset_path": "data/a.jsonl", "output_dir": "runs/k",
                      field: secret_value(hints[field], KEY)}
            response = client.post("/api/configs", json={"name": "k", "values": values}, headers=headers)
            assert studio_error(response, 400) == (f"error: {field}: holds this studio's API key; remove it (a saved "
                                                   f"config, and every checkpoint of its run, would record it)")
        response = client.post("/api/configs", json={"name": KEY, "values": {}}, headers=headers)
        assert studio_error(response, 400).startswith("error: name: holds this studio's API key")
    assert snapshot(workdir) == before


def test_a_config_written_by_hand_with_the_studio_s_key_is_not_started(workdir):
    """A config put in configs/ without the form (an editor, a copy) is checked when a run starts from it."""
    config = workdir / "configs" / "by-hand.yaml"
    config.parent.mkdir(exist_ok=True)
    config.write_text(f"model_name: models/m\ndataset_path: data/a.jsonl\noutput_dir: runs/by-hand\n"
                      f"save_name: {KEY}\n")
    with studio_client(workdir, api_key=KEY) as client:
        response = client.post("/api/runs", json={"config": "configs/by-hand.yaml"},
                               headers={"Authorization": f"Bearer {KEY}"})
        assert studio_error(response, 400) == ("error: save_name: holds this studio's API key; remove it (a saved "
                                               "config, and every checkpoint of its run, would record it)")
    assert not (workdir / "runs" / "by-hand").exists()
