"""Issue 28, class 4, and issue 27's server items: every field of every HTTP route, given a lone surrogate or a
body nested past reason, is a 400 with OpenAI's error body, and the server goes on answering; an unknown role or a
request for tools the model's chat template cannot render is a 400 that says so; a port in use is one line before the
model loads.

The fields are read from the request models (`request_fields`), so a field added later is tried too. The app is
the real one (`serving.app.create_app` over the engine and the tiny chat model), spoken to in this process through
starlette's TestClient.
"""

from __future__ import annotations

import json
import socket
import time
import typing
from typing import Any, Union

import pytest
from pydantic import BaseModel
from starlette.testclient import TestClient
from support.models import build_tiny_gptj

from gpt4all_training.serving.app import ServeSettings, create_app, eos_ids
from gpt4all_training.serving.engine import Engine
from gpt4all_training.serving.protocol import MAX_JSON_DEPTH, ChatRequest, CompletionRequest

from .entry_points import clean_failure

MODEL = "tiny-chat"
HOLE = "<<the value under test>>"


def request_fields(model: type[BaseModel], path: tuple = ()) -> list[tuple]:
    """The path of every field of `model` and of the models inside it (a list's models at index 0)."""
    out = []
    for name, field in model.model_fields.items():
        out.append((*path, name))
        for inner in models_in(field.annotation):
            out += request_fields(inner, (*path, name, *((0,) if list_of(field.annotation) else ())))
    return out


def models_in(tp: Any) -> list[type[BaseModel]]:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for arg in typing.get_args(tp) for m in models_in(arg)]


def list_of(tp: Any) -> bool:
    return typing.get_origin(tp) is list or any(list_of(arg) for arg in typing.get_args(tp)
                                                if typing.get_origin(tp) is Union)


BASES = {
    "/v1/completions": (CompletionRequest, {"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                                            "stream_options": {"include_usage": True}}),
    "/v1/chat/completions": (ChatRequest, {"model": MODEL, "max_tokens": 2, "stream_options": {"include_usage": True},
                                           "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}],
                                                         "tool_calls": None}]}),
}
# Every field of both routes, and one field the server ignores (OpenAI's `user`).
CASES = [(route, path) for route, (model, _) in BASES.items() for path in [*request_fields(model), ("user",)]]
# A lone surrogate as a value, as a key, and JSON nested 100,000 levels (past the parser) and 100 levels (parsed).
VALUES = {"surrogate": "a\ud800b", "surrogate key": {"\udfff": 1}, "deep": "[" * 100_000 + "]" * 100_000,
          "nested": "[" * 100 + "]" * 100}


def body_with(route: str, path: tuple, value: Any) -> bytes:
    """The route's valid body with the field at `path` replaced by `value` (a string of brackets goes in raw)."""
    body = json.loads(json.dumps(BASES[route][1]))
    holder = body
    for step in path[:-1]:
        holder = holder[step]
    raw = isinstance(value, str) and value.startswith("[")
    holder[path[-1]] = HOLE if raw else value
    text = json.dumps(body)  # ensure_ascii: a lone surrogate is written as its \ud800 escape, as a client would
    return text.replace(json.dumps(HOLE), value).encode() if raw else text.encode()


@pytest.fixture(scope="module")
def client(chat_tokenizer):
    model = build_tiny_gptj(chat_tokenizer).eval()
    engine = Engine(model, chat_tokenizer, eos_ids(model, chat_tokenizer), max_batch_size=4, max_queue=8)
    app = create_app(engine, chat_tokenizer, ServeSettings(model_id=MODEL, max_tokens_cap=8), 512)
    with TestClient(app, base_url="http://127.0.0.1:8000", raise_server_exceptions=False) as test_client:
        yield test_client


def assert_openai_error(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and list(body["error"]) == ["message", "type", "param", "code"]
    assert body["error"]["type"] == "invalid_request_error" and "\n" not in body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("kind", list(VALUES))
@pytest.mark.parametrize("route, path", CASES, ids=[f"{r}-{'.'.join(map(str, p))}" for r, p in CASES])
def test_every_field_with_a_lone_surrogate_or_deep_nesting_is_400(client, route, path, kind):
    error = assert_openai_error(client.post(route, content=body_with(route, path, VALUES[kind]),
                                            headers={"content-type": "application/json"}))
    if kind.startswith("surrogate"):
        assert "lone surrogate" in error["message"] and error["param"] == path[0]
    elif kind == "nested":
        assert f"nested more than {MAX_JSON_DEPTH} levels deep" in error["message"] and error["param"] == path[0]
    else:
        assert error["message"].startswith("We could not parse the JSON body of your request")


def test_the_server_still_answers_after_the_bad_requests(client):
    for route in BASES:
        client.post(route, content=body_with(route, ("model",), "a\ud800b"))
    response = client.post("/v1/chat/completions", json=BASES["/v1/chat/completions"][1])
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
    assert client.get("/v1/models/%ED%A0%80").status_code == 404  # the path: percent-escaped surrogate bytes


@pytest.mark.parametrize("role", ["wizard", "function", "", "USER"])
def test_an_unknown_role_is_400_naming_it(client, role):
    """It was rendered by the template as whatever the template did with it, and answered 200."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}, {"role": role, "content": "x"}]}
    error = assert_openai_error(client.post("/v1/chat/completions", json=body))
    assert error["message"] == (f"messages.1.role: {role!r} is not a role this server takes (one of system, "
                                f"developer, user, assistant, tool)") and error["param"] == "messages"


@pytest.mark.parametrize("extra, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools",
     "tools: this model's chat template does not render tool definitions, so the model would not see them; send the "
     "request without them"),
    ({"functions": [{"name": "f"}]}, "functions",
     "functions: the legacy function-calling fields are not supported; send tools (and tool_choice) instead"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice: this server does not force tool calls; send auto or none"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                         "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "1", "content": "42"}]}, "messages",
     "messages: this model's chat template does not render tool calls, so the model would not see them; send the "
     "request without them"),
])
def test_tools_the_template_cannot_render_are_400_not_an_answer_without_them(client, extra, param, message):
    """The tiny chat model's template writes each message's content only: tools and tool calls would be answered
    without the model seeing them (issue 30: a template that renders them is given them, tests/test_serve.py)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **extra}
    error = assert_openai_error(client.post("/v1/chat/completions", json=body))
    assert (error["message"], error["param"]) == (message, param)


def test_developer_is_system_and_empty_tools_are_no_tools(client):
    body = {"model": MODEL, "max_tokens": 2, "tools": [], "messages": [{"role": "developer", "content": "Be brief."},
                                                                       {"role": "user", "content": "Hi"}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path, capsys):
    """The model named does not exist: had the port been checked after loading, the line would be about it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        line = clean_failure(capsys, ["serve", "--model", str(tmp_path / "no-model"), "--port", str(port)])
    assert line.startswith(f"error: --port {port}: cannot listen on 127.0.0.1:{port} (")
    assert line.endswith("); stop what uses it or choose another --port") and time.monotonic() - started < 5
