"""The JSON API of each page, one FastAPI router per page (static/pages/*.js is its other half): Data, Plan and
train, Map and curate, Evaluate, Chat, Export.

A page's form runs a CLI subcommand: its request body holds the subcommand's options by their argparse dest (and
what the page adds, such as a map's selection), and `FORMS` says, for each subcommand the pages run, the body and the
page's form that send it and the options the studio sets itself. tests/test_studio_api.py walks every subcommand's
options against it, so an option added to the CLI is refused there until the page and its body take it.

A field that names a file or folder of the workdir is typed PathName, as a config's are: every such field is checked
to be inside the workdir before anything runs (`actions.confined`), and tests plant paths outside the workdir in each
one the types mark (tests/hardening/test_studio_confinement.py).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from gpt4all_training.config.fields import PathName
from gpt4all_training.run_folder import METRICS_FILE
from gpt4all_training.studio import actions
from gpt4all_training.studio.chat import ChatModels, ChatRequest
from gpt4all_training.studio.configs import (EVAL_SUITE_DIR, form_schema, preset_values, presets, save_config,
                                             saved_name)
from gpt4all_training.studio.jobs import Jobs
from gpt4all_training.studio.runs import Launch, Runs, accelerate_configs
from gpt4all_training.studio.workdir import Workdir
from gpt4all_training.tracking.tracker import read_metrics

UPLOAD_PATH = "/api/upload"
EVENTS_POLL_S = 0.5


def blocking(function, *args, **kwargs):
    """Run a package function off the event loop: the page stays responsive while it works."""
    return run_in_threadpool(function, *args, **kwargs)


# ---------------------------------------------------------------- request bodies
# An option left None is the CLI's default (the command line shown leaves it out).

class CleanBody(BaseModel):
    inputs: list[PathName]
    output_dir: PathName
    drop_ai_disclaimers: bool = False
    drop_refusals: bool = False
    min_response_chars: Optional[int] = Field(None, ge=0)
    oasst: str = "paths"
    oasst_preferences: bool = False
    rejects: Optional[PathName] = None
    near_duplicates: Optional[float] = None
    prompts: bool = False


class DataBody(BaseModel):
    config: str  # a preset's name, looked up among the presets (a saved config's is its path in the workdir)
    model_name: PathName
    dataset_path: PathName
    overrides: list[str] = []  # key=value: confined with the config's paths
    show: int = 3
    dump: Optional[PathName] = None


class ConfigBody(BaseModel):
    name: str
    values: dict[str, Any]


class PlanBody(BaseModel):
    config: PathName
    gpus: Optional[int] = None
    tokens_per_second: Optional[float] = None
    gpu_memory: Optional[float] = None
    config_only: bool = False


class CheckBody(BaseModel):
    config: PathName


class LaunchBody(BaseModel):
    config: PathName
    launcher: str = "python"
    accelerate_config: Optional[str] = None
    num_processes: Optional[int] = None
    devices: str = ""
    allow_concurrent: bool = False


class MapBody(BaseModel):
    run: str
    model: PathName
    layout: str = "umap"
    compare: Optional[PathName] = None
    color: Optional[str] = None
    clusters: Optional[int] = None
    seed: Optional[int] = None
    text_chars: Optional[int] = None
    png: Optional[PathName] = None
    clusters_csv: Optional[PathName] = None


class CurateBody(BaseModel):
    input: PathName
    output: PathName
    ids: Optional[list[int]] = None
    keep_selected: bool = False
    near_duplicates: Optional[float] = None
    embedder: Optional[str] = None
    loss_above: Optional[float] = None
    loss_below: Optional[float] = None
    drop: list[str] = []
    label_column: Optional[str] = None
    label_ids: Optional[PathName] = None
    name: Optional[str] = None
    seed: Optional[int] = None


class EvalBody(BaseModel):
    models: list[PathName]
    tasks: list[str]
    name: str
    limit: Optional[int] = None
    include_path: list[PathName] = []  # beside the shipped suite
    num_fewshot: Optional[int] = None
    batch_size: Optional[int] = None
    dtype: Optional[str] = None
    seed: Optional[int] = None
    apply_chat_template: bool = False


class ExportBody(BaseModel):
    source: PathName
    to: PathName
    format: str
    dtype: Optional[str] = None
    base: Optional[PathName] = None
    max_shard_size: Optional[str] = None


@dataclass(frozen=True)
class Form:
    """How a page runs a subcommand: its form in index.html (`<form id=...>`, an input named by each option's
    dest), the request body it is sent as, and the options the studio sets itself, each with how."""
    form: str
    body: type[BaseModel]
    set_by_studio: dict[str, str] = field(default_factory=dict)


THE_SAVED_CONFIG = {"config": "the config the train form saves", "overrides": "every key is on the train form"}
FORMS = {
    "clean": Form("clean-form", CleanBody),
    "data": Form("data-form", DataBody),
    "plan": Form("train-plan-form", PlanBody, THE_SAVED_CONFIG),
    "check": Form("train-plan-form", CheckBody, THE_SAVED_CONFIG),
    "train": Form("train-form", LaunchBody, THE_SAVED_CONFIG),
    "inference": Form("map-form", MapBody, {
        "config": "the run's own data settings, as overrides", "overrides": "the run's data, the model, maps/RUN"}),
    "build_map": Form("map-form", MapBody, {"input": "maps/RUN, where the map's inference wrote",
                                            "output": "maps/RUN/map.html"}),
    "curate": Form("curate-form", CurateBody, {"input": "the map shown",
                                               "include_ids": "the map's selection, kept (keep_selected)",
                                               "exclude_ids": "the map's selection, removed"}),
    "eval": Form("eval-form", EvalBody, {
        "model": "models: one, or two to compare", "output": "eval/NAME/before and after",
        "compare": "the first model's results, when there are two", "device": "the studio's --device"}),
    "export": Form("export-form", ExportBody),
}
# The subcommands no page runs, each with why.
NOT_ON_A_PAGE = {
    "generate": "the chat page answers through serve's engine instead",
    "serve": "a server of its own; the chat page uses its engine",
    "studio": "the studio itself",
    "tokenizer": "training a tokenizer is left to the CLI",
}


# ---------------------------------------------------------------- the pages

def data_router(workdir: Workdir) -> APIRouter:
    router = APIRouter()

    @router.post(UPLOAD_PATH)
    async def upload(request: Request, path: PathName):
        return await workdir.upload(path, request.stream())

    @router.post("/api/clean")
    def clean_data(body: CleanBody):
        return actions.clean_data(workdir, actions.confined(workdir, body))

    @router.post("/api/data")
    def show_examples(body: DataBody):
        values = actions.confined(workdir, body)
        model_name, dataset_path = values.pop("model_name"), values.pop("dataset_path")
        return actions.show_examples(workdir, values, model_name, dataset_path)

    return router


def train_router(workdir: Workdir, runs: Runs, api_keys: tuple[str, ...]) -> APIRouter:
    router = APIRouter()

    @router.get("/api/form")
    async def form():
        return {"blocks": form_schema(), "presets": list(presets(workdir)),
                "accelerate_configs": accelerate_configs()}

    @router.get("/api/presets")
    def preset(name: str):
        return {"name": name, "config_name": saved_name(name), "values": preset_values(workdir, name)}

    @router.post("/api/configs")
    def save(body: ConfigBody):
        path, config = save_config(workdir, body.name, body.values, api_keys)
        return {"path": path, "output_dir": config.output_dir,
                "command": actions.command("train", "--config", path)}

    @router.post("/api/plan")
    def plan(body: PlanBody):
        return actions.plan_run(workdir, actions.confined(workdir, body))

    @router.post("/api/check")
    def check(body: CheckBody):
        return actions.check_run(workdir, actions.confined(workdir, body))

    @router.get("/api/runs")
    def list_runs():
        return {"runs": runs.list()}

    @router.get("/api/runs/{name}")
    def run_detail(name: str):
        return runs.info(name)

    @router.post("/api/runs")
    def start_run(body: LaunchBody):
        return runs.start(Launch(**body.model_dump()))

    @router.post("/api/runs/{name}/stop")
    def stop_run(name: str):
        return runs.stop(name)

    @router.post("/api/runs/{name}/resume")
    def resume_run(name: str):
        return runs.resume(name)

    @router.get("/api/runs/{name}/events")
    async def run_events(request: Request, name: str, after: int = 0):
        """Server-sent events: `metrics` (each new row of metrics.jsonl past step `after`) and `state` (the run's
        state when it changes); the stream ends once the run is no longer running."""
        folder = runs.folder(name)
        await blocking(runs.info, name)  # a run the stream could not read is its one-line error, not a cut stream

        async def events():
            sent, state = 0, None
            while not await request.is_disconnected():
                info = await blocking(runs.info, name)
                logged = await blocking(read_metrics, folder / METRICS_FILE)
                for row in unsent(logged, sent, after):
                    yield f"event: metrics\ndata: {json.dumps(row)}\n\n"
                sent = len(logged)
                if info["state"] != state:
                    state = info["state"]
                    yield f"event: state\ndata: {json.dumps(info)}\n\n"
                if state != "running":
                    return
                await asyncio.sleep(EVENTS_POLL_S)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return router


def unsent(rows: list[dict[str, Any]], sent: int, after: int) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl a run's event stream has still to send: those past the first `sent` (sent before),
    less those at or before step `after` (the page has them). Counted by place in the file, not by step: the rows a
    step logs after its training row (validation, per-layer gradient norms) share its step and often land a poll
    later."""
    return [row for row in rows[sent:] if row.get("step", 0) > after]


def started(jobs: Jobs, kind: str, planned: tuple[list[str], actions.Work]) -> dict[str, Any]:
    commands, work = planned
    return jobs.start(kind, commands, work).as_dict()


def map_router(workdir: Workdir, runs: Runs, jobs: Jobs) -> APIRouter:
    router = APIRouter()

    @router.post("/api/jobs/map")
    def map_job(body: MapBody):
        values = actions.confined(workdir, body)
        run_name, model, layout = values.pop("run"), values.pop("model"), values.pop("layout")
        run = runs.info(run_name)
        return started(jobs, "map", actions.map_job(workdir, runs.folder(run_name), model, layout, run["config"],
                                                    values))

    @router.post("/api/jobs/curate")
    def curate_job(body: CurateBody):
        values = actions.confined(workdir, body)
        ids, keep_selected = values.pop("ids"), values.pop("keep_selected")
        return started(jobs, "curate", actions.curate_job(workdir, values, ids, keep_selected))

    return router


def evaluate_router(workdir: Workdir, jobs: Jobs, device: Optional[str]) -> APIRouter:
    router = APIRouter()

    @router.post("/api/jobs/eval")
    def eval_job(body: EvalBody):
        values = actions.confined(workdir, body)
        models, tasks, name, limit = (values.pop(key) for key in ("models", "tasks", "name", "limit"))
        return started(jobs, "eval", actions.eval_job(workdir, models, tasks, name, limit, device, values))

    @router.get("/api/eval/tasks")
    async def eval_tasks():
        return {"tasks": suite_tasks(), "include_path": str(EVAL_SUITE_DIR)}

    return router


def suite_tasks() -> list[str]:
    """The tasks of the shipped offline suite (configs/eval/*.yaml), by their `task:` names."""
    names = []
    for path in sorted(EVAL_SUITE_DIR.glob("*.yaml")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("task:"):
                names.append(line.split(":", 1)[1].strip())
    return names


def chat_router(workdir: Workdir, chats: ChatModels) -> APIRouter:
    router = APIRouter()

    @router.post("/api/chat")
    async def chat(body: ChatRequest):
        opened = await blocking(chats.open, workdir.relative(workdir.path(body.model, "model")))
        ticket = chats.ticket(opened, body)
        return StreamingResponse(chats.stream(opened, ticket), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return router


def export_router(workdir: Workdir, jobs: Jobs) -> APIRouter:
    router = APIRouter()

    @router.post("/api/jobs/export")
    def export_job(body: ExportBody):
        return started(jobs, "export", actions.export_job(workdir, actions.confined(workdir, body)))

    return router
