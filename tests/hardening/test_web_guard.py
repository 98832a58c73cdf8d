"""Issue 40, class 2: `serve` and the studio answer browsers through one piece of code, serving/guard.py's
BrowserGuard, tested here on both apps (in this process, through their real HTTP stack: starlette's TestClient).

Against DNS rebinding, a request whose Host header is not this machine's is a 403; against cross-site requests, a
request that may change something (every route but GET and HEAD) from another site's page is a 403: an Origin of
another site or `null`, or the browser's Sec-Fetch-Site saying so, with any body type a page can send without a CORS
preflight (a form, text/plain, multipart) and JSON. Each instance is generated over every route of each app; each
answer is the app's own one-line error, and nothing changed: the studio's workdir is byte for byte the same, and the
server's engine counted no request. Legitimate clients pass: the openai client (no Origin; Host 127.0.0.1:port or
localhost:port) and the studio's own page (an Origin equal to the Host), and a server bound elsewhere (--host) takes
requests addressed to what it was bound to.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from support.launch import free_port
from support.models import build_tiny_gptj

from gpt4all_training.cli.main import main
from gpt4all_training.serving.app import ServeSettings, create_app, eos_ids
from gpt4all_training.serving.engine import Engine
from gpt4all_training.serving.guard import BrowserGuard, allowed_hosts, machine_names

from .entry_points import snapshot
from .web_apps import STUDIO_URL, api_routes, studio_client

MODEL = "tiny-chat"
SERVE_URL = "http://127.0.0.1:8000"
KEY = "serve-guard-key-0123456789"
FORGED_HOSTS = ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil.example:8000",
                "[::1", "", "0x7f000001.example"]
OTHER_ORIGINS = ["http://evil.example", "http://evil.example:8000", "null", "http://127.0.0.1:9999",
                 "https://127.0.0.1:8000.evil.example"]
# What a page of another site can send without a CORS preflight, and JSON (which it cannot, but a refusal must not
# depend on that).
BODY_TYPES = {"application/x-www-form-urlencoded": b"config=configs%2Fa.yaml", "text/plain": b'{"config": "x"}',
              "multipart/form-data; boundary=b": b'--b\r\nContent-Disposition: form-data; name="x"\r\n\r\n1\r\n--b--',
              "application/json": b'{"model": "tiny-chat", "prompt": "Hi", "max_tokens": 1}'}


def serve_app_on(tokenizer, **settings):
    """serve's app over the tiny chat model (its engine starts and stops with one TestClient)."""
    model = build_tiny_gptj(tokenizer).eval()
    engine = Engine(model, tokenizer, eos_ids(model, tokenizer), max_batch_size=4, max_queue=8)
    return create_app(engine, tokenizer, ServeSettings(model_id=MODEL, max_tokens_cap=8, **settings), 512)


@pytest.fixture(scope="module")
def serve_app(chat_tokenizer):
    return serve_app_on(chat_tokenizer, api_key=KEY)


@pytest.fixture(scope="module")
def serve(serve_app):
    with TestClient(serve_app, base_url=SERVE_URL, headers={"Authorization": f"Bearer {KEY}"},
                    raise_server_exceptions=False) as client:
        yield client


@pytest.fixture
def studio(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"text": "x"}\n')
    monkeypatch.chdir(tmp_path)
    with studio_client(tmp_path) as client:
        yield client


def concrete(path: str) -> str:
    """A route's path with each parameter filled in."""
    return (path.replace("{name:path}", "data/a.jsonl").replace("{model_id:path}", MODEL).replace("{name}", "r")
            .replace("{job_id}", "j"))


def routes(app) -> list[tuple[str, str]]:
    return [(next(iter(route.methods)), concrete(route.path)) for route in api_routes(app)]


def serve_error(response) -> str:
    """OpenAI's error body, one line; its message."""
    assert response.status_code == 403, response.text
    body = response.json()
    assert list(body) == ["error"] and list(body["error"]) == ["message", "type", "param", "code"]
    assert body["error"]["type"] == "invalid_request_error" and "\n" not in body["error"]["message"]
    return body["error"]["message"]


def studio_line(response) -> str:
    assert response.status_code == 403, response.text
    body = response.json()
    assert list(body) == ["error"] and body["error"].startswith("error: ") and "\n" not in body["error"]
    return body["error"].removeprefix("error: ")


def requests_of(client, message, method: str, path: str, headers_list: list[dict[str, str]], body: bytes = b""):
    """Each request refused with the app's one line; the lines."""
    return [message(client.request(method, path, headers=headers, content=body or None)) for headers in headers_list]


def test_both_apps_answer_browsers_through_the_one_guard(serve_app, studio):
    assert isinstance(serve_app, BrowserGuard) and isinstance(studio.app, BrowserGuard)


def test_a_forged_host_is_403_on_every_route_of_both_apps(serve, studio):
    workdir = Path.cwd()
    before, counted = snapshot(workdir), serve.get("/metrics").json()
    for client, message in ((serve, serve_error), (studio, studio_line)):
        for method, path in routes(client.app):
            lines = requests_of(client, message, method, path, [{"Host": host} for host in FORGED_HOSTS])
            assert lines == [f"host {host!r}: this server answers requests addressed to this machine only (as "
                             f"127.0.0.1, localhost or the address it was started on)" for host in FORGED_HOSTS]
    assert snapshot(workdir) == before and serve.get("/metrics").json() == counted


@pytest.mark.parametrize("body_type", list(BODY_TYPES))
def test_a_cross_site_request_that_changes_something_is_403_on_every_route_of_both_apps(serve, studio, body_type):
    workdir = Path.cwd()
    before, counted = snapshot(workdir), serve.get("/metrics").json()
    for client, message in ((serve, serve_error), (studio, studio_line)):
        for method, path in routes(client.app):
            if method in ("GET", "HEAD"):
                continue
            sent = [{"Origin": origin, "Content-Type": body_type} for origin in OTHER_ORIGINS]
            sent.append({"Sec-Fetch-Site": "cross-site", "Content-Type": body_type})
            sent.append({"Sec-Fetch-Site": "same-site", "Content-Type": body_type})
            lines = requests_of(client, message, method, path, sent, BODY_TYPES[body_type])
            assert lines == [
                *(f"origin {origin!r}: requests that change something must come from this server's own page"
                  for origin in OTHER_ORIGINS),
                *(f"sec-fetch-site {site!r}: requests that change something must come from this server's own page"
                  for site in ("cross-site", "same-site"))]
    assert snapshot(workdir) == before and serve.get("/metrics").json() == counted


def test_reads_from_another_site_pass_the_guard_and_cannot_be_read_back(serve, studio):
    """A page elsewhere may load what a GET returns (it cannot read it without CORS headers, which neither sends)."""
    for client, path in ((serve, "/v1/models"), (studio, "/api/status")):
        response = client.get(path, headers={"Origin": "http://evil.example"})
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


@pytest.mark.parametrize("base", ["http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000"])
def test_the_openai_client_on_this_machine_is_served(chat_tokenizer, base):
    """No Origin, Host 127.0.0.1:port, localhost:port or [::1]:port: what the openai python client sends."""
    from openai import OpenAI

    with TestClient(serve_app_on(chat_tokenizer, api_key=KEY), base_url=base) as http:
        client = OpenAI(base_url=f"{base}/v1", api_key=KEY, http_client=http, max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens >= 1


def test_the_studio_page_itself_may_change_things(studio):
    """Its own requests carry an Origin equal to the Host (any spelling of this machine, in any case)."""
    same = {"Origin": STUDIO_URL, "Sec-Fetch-Site": "same-origin"}
    assert studio.post("/api/login", json={"key": "x"}, headers=same).json() == {"ok": True}
    response = studio.post("/api/login", json={"key": "x"}, headers={"Host": "LOCALHOST:7860",
                                                                     "Origin": "http://localhost:7860"})
    assert response.status_code == 200


def test_a_server_bound_elsewhere_takes_requests_for_its_address(chat_tokenizer):
    assert allowed_hosts("127.0.0.1") == {"127.0.0.1", "localhost", "::1"}
    assert allowed_hosts("10.20.30.40") >= {"127.0.0.1", "localhost", "::1", "10.20.30.40"}
    assert allowed_hosts("::") >= {"::", socket.gethostname().lower()} | machine_names()
    with TestClient(serve_app_on(chat_tokenizer, host="0.0.0.0"), base_url="http://127.0.0.1:8000", raise_server_exceptions=False) as client:
        for host in (socket.gethostname(), f"{socket.gethostname()}:8000", "0.0.0.0:8000", "127.0.0.1:8000"):
            assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
        assert client.get("/v1/models", headers={"Host": "evil.example"}).status_code == 403


def test_serve_s_host_option_is_what_its_guard_takes(chat_tokenizer, tmp_path, monkeypatch):
    """`serve --host 127.0.0.2` (a loopback address of its own): the app it runs answers requests addressed to
    127.0.0.2, and still refuses another name."""
    import logging

    import uvicorn

    request_log = logging.getLogger("gpt4all_training.serving")  # serve sets up its log line: undone after
    for attribute in ("handlers", "propagate", "level"):
        monkeypatch.setattr(request_log, attribute, getattr(request_log, attribute))
    folder = tmp_path / "model"
    build_tiny_gptj(chat_tokenizer).save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: served.update(app=app, **options))
    port = free_port()
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", str(folder), "--host", "127.0.0.2", "--port", str(port)])
    assert exited.value.code == 0 and served["host"] == "127.0.0.2"
    with TestClient(served["app"], base_url=f"http://127.0.0.2:{port}", raise_server_exceptions=False) as client:
        assert client.get("/v1/models").status_code == 200
        assert client.get("/v1/models", headers={"Host": "evil.example"}).status_code == 403
