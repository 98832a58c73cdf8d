"""The studio's HTTP side: the page (static files, package data) and the JSON API under /api/ that the page and
scripts use alike, plus /files/ for what the page shows or downloads from the workdir.

Every request passes two guards first:
- the browser checks, the same as `serve`'s (serving/guard.py): the Host header must name this machine (a web page
  elsewhere cannot reach the studio through a DNS name that resolves to 127.0.0.1), and a request that changes
  something must not come from another site's page (its Origin, or the browser's Sec-Fetch-Site), so another site
  cannot post to it;
- with an API key, /api/ and /files/ need it: `Authorization: Bearer KEY` from scripts, or the session cookie the
  page gets from POST /api/login (an EventSource, an <iframe> and a download link cannot send a header). The page's
  own static files, which hold no data, load without it, so that it can ask for the key; and request bodies are
  bounded: uploads by --max-upload-mb, everything else by MAX_JSON_BYTES (a 413 in the studio's error shape, which
  FastAPI's own limit answers in plain text).

Errors are JSON `{"error": "error: <the CLI's line>"}`: 400 for a user's mistake (the same line the CLI prints),
401 without the key, 403 for a path outside the workdir or a request the browser checks refuse, 409 for a run that
conflicts with a running one or an upload to a name that is taken, 413 for a body too large.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import mimetypes
import secrets
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from gpt4all_training.config.fields import PathName
from gpt4all_training.config.secrets import scrub
from gpt4all_training.data.clean import Filters
from gpt4all_training.errors import TrainingError, UserError
from gpt4all_training.serving.guard import BrowserGuard, allowed_hosts
from gpt4all_training.studio import actions
from gpt4all_training.studio.chat import ChatModels, ChatRequest
from gpt4all_training.studio.configs import (EVAL_SUITE_DIR, form_schema, preset_values, presets, save_config,
                                             saved_name)
from gpt4all_training.studio.jobs import Jobs
from gpt4all_training.studio.runs import Launch, RunConflict, Runs, accelerate_configs
from gpt4all_training.studio.workdir import (CONFIGS_DIR, DATA_DIR, EXPORTS_DIR, MAPS_DIR, MODELS_DIR, Exists,
                                             OutsideWorkdir, Workdir)
from gpt4all_training.tracking.tracker import read_metrics
from gpt4all_training.files import MARKER
from gpt4all_training.run_folder import METRICS_FILE, final_folder, step_folders

log = logging.getLogger("gpt4all_training.studio")

STATIC = files("gpt4all_training.studio") / "static"
MAX_JSON_BYTES = 1 << 20
UPLOAD_PATH = "/api/upload"
SESSION_COOKIE = "studio_session"
OPEN_PATHS = ("/api/login",)
EVENTS_POLL_S = 0.5
STATUS = {OutsideWorkdir: 403, RunConflict: 409, Exists: 409}


@dataclass(frozen=True)
class StudioSettings:
    workdir: Path
    host: str = "127.0.0.1"
    api_key: Optional[str] = None
    max_upload_bytes: int = 1 << 30
    chat_dtype: str = "float32"
    device: Optional[str] = None
    key_variable: Optional[str] = None  # the environment variable holding the key: kept from the runs' environment


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": f"error: {scrub(message)}"}, status_code=status)


class Guard:
    """ASGI middleware: with an API key, /api/ and /files/ (but the login) need it, or a session cookie; and the
    bound on request bodies."""

    def __init__(self, app, settings: StudioSettings, sessions: set[str]):
        self.app, self.settings, self.sessions = app, settings, sessions

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if not self.allowed(scope["path"], headers):
            response = error_response(401, "this studio needs its API key: send `Authorization: Bearer KEY`, or "
                                           "log in on the page")
            return await response(scope, receive, send)
        limit = self.settings.max_upload_bytes if scope["path"] == UPLOAD_PATH else MAX_JSON_BYTES
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:  # refused before a byte of it is read
            return await error_response(413, too_large(scope["path"], self.settings))(scope, receive, send)
        return await self.app(scope, bounded(receive, limit, too_large(scope["path"], self.settings)), send)

    def allowed(self, path: str, headers: Headers) -> bool:
        if self.settings.api_key is None or path in OPEN_PATHS or not path.startswith(("/api/", "/files/")):
            return True
        given = headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.settings.api_key}".encode()):
            return True
        return session_of(headers.get("cookie", "")) in self.sessions


def session_of(cookie_header: str) -> Optional[str]:
    for part in cookie_header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == SESSION_COOKIE:
            return value
    return None


def bounded(receive, limit: int, message: str):
    """A receive that raises a 413 HTTPException (FastAPI passes those on to the app's handler, where it reads any
    other exception of the body as a 400) once the body passes `limit` bytes."""
    size = 0

    async def receive_bounded():
        nonlocal size
        received = await receive()
        if received["type"] == "http.request":
            size += len(received.get("body", b""))
            if size > limit:
                raise HTTPException(413, message)
        return received

    return receive_bounded


def too_large(path: str, settings: StudioSettings) -> str:
    """The line for a body past its limit: the upload's, which --max-upload-mb sets, or every other request's."""
    if path == UPLOAD_PATH:
        return (f"upload: larger than the limit of {settings.max_upload_bytes:,} bytes; start the studio with a "
                f"larger --max-upload-mb, or put the file in the workdir yourself")
    return f"the request body is larger than {MAX_JSON_BYTES:,} bytes"


# ---------------------------------------------------------------- request bodies
# A field that names a file or folder of the workdir is typed PathName, as a config's are: tests plant paths outside
# the workdir in each one the types mark (tests/hardening/test_studio_confinement.py).

class LoginBody(BaseModel):
    key: str = Field(max_length=4096)


class CleanBody(BaseModel):
    inputs: list[PathName]
    output_dir: PathName
    drop_ai_disclaimers: bool = False
    drop_refusals: bool = False
    min_response_chars: int = Field(0, ge=0)
    oasst: str = "paths"
    oasst_preferences: bool = False


class DataBody(BaseModel):
    config: str  # a preset's name, looked up among the presets (a saved config's is its path in the workdir)
    model_name: PathName
    dataset_path: PathName
    show: int = 3


class ConfigBody(BaseModel):
    name: str
    values: dict[str, Any]


class PlanBody(BaseModel):
    config: PathName
    gpus: int = 1


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


class CurateBody(BaseModel):
    input: PathName
    output: PathName
    ids: Optional[list[int]] = None
    keep_selected: bool = False
    near_duplicates: Optional[float] = None
    loss_above: Optional[float] = None
    loss_below: Optional[float] = None


class EvalBody(BaseModel):
    models: list[PathName]
    tasks: list[str]
    name: str
    limit: Optional[int] = None


class ExportBody(BaseModel):
    source: PathName
    to: PathName
    format: str
    dtype: Optional[str] = None


def unsent(rows: list[dict[str, Any]], sent: int, after: int) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl a run's event stream has still to send: those past the first `sent` (sent before),
    less those at or before step `after` (the page has them). Counted by place in the file, not by step: the rows a
    step logs after its training row (validation, per-layer gradient norms) share its step and often land a poll
    later."""
    return [row for row in rows[sent:] if row.get("step", 0) > after]


def suite_tasks() -> list[str]:
    """The tasks of the shipped offline suite (configs/eval/*.yaml), by their `task:` names."""
    names = []
    for path in sorted(EVAL_SUITE_DIR.glob("*.yaml")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("task:"):
                names.append(line.split(":", 1)[1].strip())
    return names


def create_app(settings: StudioSettings) -> BrowserGuard:
    """The studio over `settings.workdir`, which must be the current folder: the commands the pages show run from
    it, and the package functions read the same relative paths."""
    workdir = Workdir(settings.workdir)
    if Path.cwd().resolve() != workdir.root:
        raise UserError(f"the studio must run from its workdir {workdir.root} (it runs from {Path.cwd()})")
    workdir.remove_partial_uploads()
    hidden = (settings.key_variable,) if settings.key_variable else ()
    api_keys = (settings.api_key,) if settings.api_key else ()
    runs, jobs, chats = Runs(workdir, hidden, api_keys), Jobs(), ChatModels(settings.chat_dtype, settings.device)
    sessions: set[str] = set()

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        try:
            yield
        finally:
            chats.close()  # the runs go on: they belong to their supervisors, not to the studio

    app = FastAPI(title="gpt4all-training studio", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.exception_handler(UserError)
    async def user_error(_request, exc: UserError):
        return error_response(STATUS.get(type(exc), 400), str(exc))

    @app.exception_handler(TrainingError)
    async def training_error(_request, exc: TrainingError):
        return error_response(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request, exc: RequestValidationError):
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            return error_response(400, "the request body is not valid JSON")
        where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
        return error_response(400, f"{where}: {first['msg']}")

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        if isinstance(exc.__cause__, RecursionError):  # FastAPI's "error parsing the body" says less
            return error_response(400, "the request body is JSON nested too deeply to read")
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def server_error(_request, exc: Exception):  # a bug: one line for the page, the traceback for the log
        log.error("request failed", exc_info=exc)
        return error_response(500, f"the studio failed ({type(exc).__name__}); its log has the details")

    def blocking(function, *args, **kwargs):
        """Run a package function off the event loop: the page stays responsive while it works."""
        return run_in_threadpool(function, *args, **kwargs)

    # ------------------------------------------------------------ the page, files and login

    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")

    @app.get("/")
    async def index():
        return FileResponse(str(STATIC / "index.html"))

    @app.post("/api/login")
    async def login(body: LoginBody):
        if settings.api_key is None:
            return {"ok": True}
        if not hmac.compare_digest(body.key.encode(), settings.api_key.encode()):
            return error_response(401, "wrong API key")
        token = secrets.token_urlsafe(32)
        sessions.add(token)
        response = JSONResponse({"ok": True})
        response.set_cookie(SESSION_COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.get("/files/{name:path}")
    async def workdir_file(name: PathName, download: bool = False):
        path = workdir.path(name)
        if not path.is_file():
            raise UserError(f"{name}: no such file in the workdir")
        media = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return FileResponse(str(path), media_type=media, filename=path.name if download else None,
                            content_disposition_type="attachment" if download else "inline",
                            headers={"X-Content-Type-Options": "nosniff"})

    @app.get("/api/status")
    async def status():
        return {"workdir": str(workdir.root), "auth": settings.api_key is not None,
                "max_upload_bytes": settings.max_upload_bytes}

    @app.get("/api/files")
    def listing():
        """What the pickers offer: data files, configs, models (runs' final/ and checkpoints, model folders under
        models/), the packaged models every model picker offers besides, maps and exports."""
        models = workdir.listing(MODELS_DIR, folders=True)
        models = [m for m in models if (workdir.path(m) / "config.json").is_file()]
        for run in runs.list():
            folder = workdir.path(run["output_dir"])
            models += [workdir.relative(path) for _, path in step_folders(folder) if (path / MARKER).is_file()]
            if (final_folder(folder) / MARKER).is_file():
                models.append(workdir.relative(final_folder(folder)))
        maps = [workdir.relative(workdir.path(p).parent) for p in workdir.listing(MAPS_DIR, ("inference.parquet",))]
        return {"data": workdir.listing(DATA_DIR, (".jsonl",)), "configs": workdir.listing(CONFIGS_DIR, (".yaml",)),
                "models": models, "packaged": actions.packaged_models(), "maps": maps,
                "exports": workdir.listing(EXPORTS_DIR, (".gguf", ".safetensors"))}

    # ------------------------------------------------------------ data

    @app.post(UPLOAD_PATH)
    async def upload(request: Request, path: PathName):
        return await workdir.upload(path, request.stream())

    @app.post("/api/clean")
    def clean_data(body: CleanBody):
        filters = Filters(body.drop_ai_disclaimers, body.drop_refusals, body.min_response_chars)
        return actions.clean_data(workdir, body.inputs, body.output_dir, filters, body.oasst, body.oasst_preferences)

    @app.post("/api/data")
    def show_examples(body: DataBody):
        return actions.show_examples(workdir, body.config, body.model_name, body.dataset_path, body.show)

    # ------------------------------------------------------------ configs, plan, check

    @app.get("/api/form")
    async def form():
        return {"blocks": form_schema(), "presets": list(presets(workdir)),
                "accelerate_configs": accelerate_configs()}

    @app.get("/api/presets")
    def preset(name: str):
        return {"name": name, "config_name": saved_name(name), "values": preset_values(workdir, name)}

    @app.post("/api/configs")
    def save(body: ConfigBody):
        path, config = save_config(workdir, body.name, body.values, api_keys)
        return {"path": path, "output_dir": config.output_dir,
                "command": actions.command("train", "--config", path)}

    @app.post("/api/plan")
    def plan(body: PlanBody):
        return actions.plan_run(workdir, body.config, body.gpus)

    @app.post("/api/check")
    def check(body: PlanBody):
        return actions.check_run(workdir, body.config)

    # ------------------------------------------------------------ runs

    @app.get("/api/runs")
    def list_runs():
        return {"runs": runs.list()}

    @app.get("/api/runs/{name}")
    def run_detail(name: str):
        return runs.info(name)

    @app.post("/api/runs")
    def start_run(body: LaunchBody):
        return runs.start(Launch(**body.model_dump()))

    @app.post("/api/runs/{name}/stop")
    def stop_run(name: str):
        return runs.stop(name)

    @app.post("/api/runs/{name}/resume")
    def resume_run(name: str):
        return runs.resume(name)

    @app.get("/api/runs/{name}/events")
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

    # ------------------------------------------------------------ jobs

    def started(kind: str, planned) -> dict[str, Any]:
        commands, work = planned
        return jobs.start(kind, commands, work).as_dict()

    @app.post("/api/jobs/map")
    def map_job(body: MapBody):
        run = runs.info(body.run)
        return started("map", actions.map_job(workdir, runs.folder(body.run), body.model, body.layout,
                                              run["config"]))

    @app.post("/api/jobs/curate")
    def curate_job(body: CurateBody):
        return started("curate", actions.curate_job(workdir, body.input, body.output, body.ids, body.keep_selected,
                                                    body.near_duplicates, body.loss_above, body.loss_below))

    @app.post("/api/jobs/eval")
    def eval_job(body: EvalBody):
        return started("eval", actions.eval_job(workdir, body.models, body.tasks, body.name, body.limit,
                                                settings.device))

    @app.post("/api/jobs/export")
    def export_job(body: ExportBody):
        return started("export", actions.export_job(workdir, body.source, body.to, body.format, body.dtype))

    @app.get("/api/jobs/{job_id}")
    async def job(job_id: str):
        return jobs.get(job_id).as_dict()

    @app.get("/api/eval/tasks")
    async def eval_tasks():
        return {"tasks": suite_tasks(), "include_path": str(EVAL_SUITE_DIR)}

    # ------------------------------------------------------------ chat

    @app.post("/api/chat")
    async def chat(body: ChatRequest):
        opened = await blocking(chats.open, workdir.relative(workdir.path(body.model, "model")))
        ticket = chats.ticket(opened, body)
        return StreamingResponse(chats.stream(opened, ticket), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return BrowserGuard(Guard(app, settings, sessions), allowed_hosts(settings.host), error_response, log)
