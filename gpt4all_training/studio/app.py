"""The studio's HTTP side: the page (static files, package data) and the JSON API under /api/ that the page and
scripts use alike, plus /files/ for what the page shows or downloads from the workdir. Each page's routes are a
router of pages.py; here are the guard, the errors, the shell every page shares, and `create_app`, which assembles
them.

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

import contextlib
import hmac
import logging
import mimetypes
import secrets
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Optional

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from gpt4all_training.config.fields import PathName
from gpt4all_training.config.secrets import scrub
from gpt4all_training.errors import TrainingError, UserError
from gpt4all_training.files import MARKER
from gpt4all_training.run_folder import final_folder, step_folders
from gpt4all_training.serving.guard import BrowserGuard, allowed_hosts
from gpt4all_training.studio import actions, pages
from gpt4all_training.studio.chat import ChatModels
from gpt4all_training.studio.jobs import Jobs
from gpt4all_training.studio.pages import UPLOAD_PATH
from gpt4all_training.studio.runs import RunConflict, Runs
from gpt4all_training.studio.workdir import (CONFIGS_DIR, DATA_DIR, EXPORTS_DIR, MAPS_DIR, MODELS_DIR, Exists,
                                             OutsideWorkdir, Workdir)

log = logging.getLogger("gpt4all_training.studio")

STATIC = files("gpt4all_training.studio") / "static"
MAX_JSON_BYTES = 1 << 20
SESSION_COOKIE = "studio_session"
OPEN_PATHS = ("/api/login",)
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


def create_app(settings: StudioSettings) -> BrowserGuard:
    """The studio over `settings.workdir`, which must be the current folder: the commands the pages show run from
    it, and the package functions read the same relative paths. One router per page (pages.py), and the shell's."""
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
    add_error_handlers(app)
    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")
    for router in (shell_router(settings, workdir, runs, jobs, sessions), pages.data_router(workdir),
                   pages.train_router(workdir, runs, api_keys), pages.map_router(workdir, runs, jobs),
                   pages.evaluate_router(workdir, jobs, settings.device), pages.chat_router(workdir, chats),
                   pages.export_router(workdir, jobs)):
        app.include_router(router)
    return BrowserGuard(Guard(app, settings, sessions), allowed_hosts(settings.host), error_response, log)


def add_error_handlers(app: FastAPI) -> None:
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


class LoginBody(BaseModel):
    key: str = Field(max_length=4096)


def shell_router(settings: StudioSettings, workdir: Workdir, runs: Runs, jobs: Jobs, sessions: set[str]
                 ) -> APIRouter:
    """What every page shares: the page itself, the login, the workdir's files and the pickers' lists, and the
    state of a job any page started."""
    router = APIRouter()

    @router.get("/")
    async def index():
        return FileResponse(str(STATIC / "index.html"))

    @router.post("/api/login")
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

    @router.get("/files/{name:path}")
    async def workdir_file(name: PathName, download: bool = False):
        path = workdir.path(name)
        if not path.is_file():
            raise UserError(f"{name}: no such file in the workdir")
        media = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return FileResponse(str(path), media_type=media, filename=path.name if download else None,
                            content_disposition_type="attachment" if download else "inline",
                            headers={"X-Content-Type-Options": "nosniff"})

    @router.get("/api/status")
    async def status():
        return {"workdir": str(workdir.root), "auth": settings.api_key is not None,
                "max_upload_bytes": settings.max_upload_bytes}

    @router.get("/api/files")
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

    @router.get("/api/jobs/{job_id}")
    async def job(job_id: str):
        return jobs.get(job_id).as_dict()

    return router
