"""What the web-app hardening tests share: the studio's app in this process (starlette's TestClient drives its real
HTTP stack, guards included), run from a workdir as `gpt4all-training studio` runs it; the one-line error body both
apps must answer; and every route of an app with the parameters its types mark as local paths."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.testclient import TestClient

from gpt4all_training.config.fields import LocalPath, path_mark
from gpt4all_training.studio.app import StudioSettings, create_app

STUDIO_URL = "http://127.0.0.1:7860"


def studio_client(workdir: Path, **settings) -> TestClient:
    """The studio over `workdir` (the current folder, as the CLI makes it), addressed as the browser addresses it."""
    return TestClient(create_app(StudioSettings(workdir=workdir, **settings)), base_url=STUDIO_URL,
                      raise_server_exceptions=False)


def studio_error(response, status: int) -> str:
    """The studio's error line: `status`, a body of exactly {"error": "error: ..."}, one line, no traceback."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and body["error"].startswith("error: "), body
    assert "\n" not in body["error"] and "Traceback" not in body["error"]
    return body["error"]


def fastapi_app(app: Any) -> FastAPI:
    """The FastAPI app inside the guards (each middleware keeps the app it wraps as `.app`)."""
    while not isinstance(app, FastAPI):
        app = app.app
    return app


def api_routes(app: Any) -> list[APIRoute]:
    """Every route of the app, those of the routers it includes too (FastAPI keeps an included router whole)."""
    def walk(routes: list[Any]) -> Iterator[APIRoute]:
        for route in routes:
            if isinstance(route, APIRoute):
                yield route
            elif hasattr(route, "original_router"):
                yield from walk(route.original_router.routes)

    return list(walk(fastapi_app(app).routes))


@dataclass(frozen=True)
class Parameter:
    """One value a request gives: a body field (`where` "body", `name` the dotted path in the body, list entries as
    0), a query parameter or a path parameter; `path` when its type marks it as a local path."""
    route: str
    method: str
    where: str
    name: str
    annotation: Any
    path: bool


def marked(annotation: Any, metadata: list[Any]) -> bool:
    return path_mark(annotation) is not None or any(isinstance(m, LocalPath) for m in metadata)


def holds_text(annotation: Any) -> bool:
    """Whether values of this type can be text (the types a path could hide in: strings, and mappings of any
    values); Literal choices cannot."""
    if annotation in (str, dict) or annotation is Any:
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return False
    return any(holds_text(arg) for arg in typing.get_args(annotation))


def model_fields(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, Any, bool]]:
    """(dotted name, annotation, marked) of every field of `model` and of the models inside it."""
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field.annotation, marked(field.annotation, field.metadata)
        for inner in models_in(field.annotation):
            listed = typing.get_origin(field.annotation) is list
            yield from model_fields(inner, f"{prefix}{name}.{'0.' if listed else ''}")


def models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]


def parameters(app: Any) -> list[Parameter]:
    """Every parameter of every route of `app`: body fields (of nested models too), query and path parameters."""
    found = []
    for route in api_routes(app):
        [method] = route.methods
        for where, params in (("query", route.dependant.query_params), ("path", route.dependant.path_params)):
            found += [Parameter(route.path, method, where, p.name, p.field_info.annotation,
                                marked(p.field_info.annotation, p.field_info.metadata)) for p in params]
        for body in route.dependant.body_params:
            found += [Parameter(route.path, method, "body", name, annotation, mark)
                      for name, annotation, mark in model_fields(body.field_info.annotation, "")]
    return found
