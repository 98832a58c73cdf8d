"""`gpt4all-training serve`: the pure pieces (sampling, the text a stream may send, request validation) in process,
then one real uvicorn server on the tiny chat model, started as a subprocess for the whole module and spoken to
with the official `openai` client (and raw HTTP where the client would not send what is tested)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import secrets
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import torch

from support.launch import free_port
from support.models import build_tiny_gptj
from support.paths import PYTHON, REPO
from gpt4all_training.data.chat import encode_for_generation
from gpt4all_training.model.decoding import Sampling, Sequence, next_tokens
from gpt4all_training.serving.chat import chat_encoder, end_of_turn_ids, render
from gpt4all_training.serving.engine import Choice, Engine, QueueFull, Ticket
from gpt4all_training.serving.protocol import APIError, ChatRequest, CompletionRequest, parse
from gpt4all_training.serving.streaming import TextStream, held_back

STARTUP_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 60
PROMPTS = [f"Question {i}: what does the {word} do" + " and then" * (i % 5)
           for i, word in enumerate(["river", "garden", "teacher", "camel", "engine", "violin", "harbor", "tiger",
                                     "bridge", "lantern", "castle", "pencil", "rocket", "meadow", "falcon", "copper"])]


# ---------------------------------------------------------------- pure pieces

PIECES = ["a", "b", "S", "T", "x", "S", "TOP", "zz"]


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One row's token, drawn alone."""
    return int(next_tokens(logits[None], torch.zeros_like(logits[None], dtype=torch.bool), [sampling], [generator]))


def test_a_stream_holds_back_what_a_stop_string_may_still_become():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["world"]) == 0
    assert held_back("abc\ufffd", []) == 1  # a partial UTF-8 character waits for its last byte
    sequence = Sequence([0], 100, stop=("STOP",), live_text=True)
    stream = TextStream(sequence)
    sent = []
    for token in range(len(PIECES)):  # token i is PIECES[i]
        sequence.add(token, None, (), lambda ids: "".join(PIECES[i] for i in ids))
        sent.append(stream.sendable())
        if sequence.finished:
            break
    assert sent == ["a", "b", "", "", "STx", "", ""]
    assert sequence.text == "abSTx" and sequence.finish_reason == "stop" and stream.sendable() == ""


def test_each_row_samples_with_its_own_generator_and_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    hot = Sampling(temperature=1.0)
    alone = sample(logits[1], hot, torch.Generator().manual_seed(7))
    rows = next_tokens(logits, torch.zeros_like(logits, dtype=torch.bool), [Sampling(0.0), hot, hot],
                       [None, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]).tolist()
    assert rows[0] == int(logits[0].argmax()) and rows[1] == alone


def test_top_p_keeps_the_most_likely_tokens_up_to_its_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    draws = {sample(logits, Sampling(1.0, top_p=0.7), torch.Generator().manual_seed(s)) for s in range(200)}
    assert draws == {0, 1}


@pytest.mark.parametrize("body, param", [
    (b"{not json", None), (b"[1, 2]", None), (b'{"model": "m"}', "prompt"),
    (b'{"model": "m", "prompt": "x", "temperature": "hot"}', "temperature"),
    (b'{"model": "m", "prompt": "x", "max_tokens": 0}', "max_tokens"),
])
def test_bad_request_bodies_are_400_naming_the_field(body, param):
    with pytest.raises(APIError) as caught:
        parse(CompletionRequest, body)
    assert caught.value.status == 400 and caught.value.param == param


def test_chat_messages_render_with_the_template_and_its_end_of_turn_is_found(chat_tokenizer):
    body = parse(ChatRequest, json.dumps({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]}).encode())
    ids = render(chat_encoder(chat_tokenizer), [m.as_dict() for m in body.messages])
    assert chat_tokenizer.decode(ids) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert end_of_turn_ids(chat_tokenizer) == {chat_tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_typed_control_text_is_not_a_control_token_and_the_ids_are_training_s(chat_tokenizer):
    messages = [{"role": "user", "content": "end here<|im_end|> then"}]
    ids = render(chat_encoder(chat_tokenizer), messages)
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_end) == 1  # the template's own, after the user turn
    assert ids == encode_for_generation(chat_tokenizer, [messages])[0]


def test_a_tokenizer_without_a_template_serves_completions_only(tokenizer):
    assert chat_encoder(tokenizer) is None and end_of_turn_ids(tokenizer) == set()
    with pytest.raises(APIError) as caught:
        render(None, [{"role": "user", "content": "Hi"}])
    assert caught.value.status == 400 and caught.value.param == "messages"


def test_a_full_queue_refuses_the_next_request(chat_tokenizer):
    engine = Engine(build_tiny_gptj(chat_tokenizer), chat_tokenizer, set(), max_batch_size=2, max_queue=1)
    loop = asyncio.new_event_loop()
    try:
        ticket = Ticket([Choice(0, [1, 2], 4, Sampling(0.0), 0)], (), False, loop)
        engine.submit(ticket)  # the engine is not started: it stays waiting
        with pytest.raises(QueueFull):
            engine.submit(Ticket([Choice(0, [1, 2], 4, Sampling(0.0), 0)], (), False, loop))
    finally:
        loop.close()


def test_a_web_app_mounts_the_openai_routes_beside_its_own(chat_tokenizer):
    """The OpenAI routes are a router: another app includes them beside its own pages, errors in OpenAI's shape."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from gpt4all_training.serving.app import ServeSettings, add_error_handlers, openai_router

    engine = Engine(build_tiny_gptj(chat_tokenizer), chat_tokenizer, set(), max_batch_size=2, max_queue=1)
    app = FastAPI()
    add_error_handlers(app)
    app.include_router(openai_router(engine, chat_tokenizer, ServeSettings(model_id="tiny"), 512))
    app.get("/")(lambda: {"page": "home"})
    with TestClient(app) as client:
        assert client.get("/").json() == {"page": "home"}
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
        missing = client.get("/v1/models/other")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------- tools and reasoning, pure

# (reply, whether the prompt opened a <think> block, the reasoning and content a client gets)
REPLIES = [
    ("<think>\nSix times seven.\nThat is 42.\n</think>\n\nIt is 42.", False, ("Six times seven.\nThat is 42.",
                                                                           "It is 42.")),
    ("It is 42.", False, ("", "It is 42.")),
    ("<thi", False, ("", "<thi")),
    ("A <think> later is text.", False, ("", "A <think> later is text.")),
    ("<think>\nCut off before the end\n", False, ("Cut off before the end", "")),
    ("Opened by the prompt.\n</think>\n\nDone.", True, ("Opened by the prompt.", "Done.")),
    ("\n</think>\n\nNo thought.", True, ("", "No thought.")),
]


@pytest.mark.parametrize("reply, opened, expected", REPLIES)
def test_a_reply_s_reasoning_comes_apart_from_its_content_whole_and_streamed(reply, opened, expected):
    """Streamed in pieces of every size from 1 to 4 characters, the deltas join to the whole reply's split."""
    from gpt4all_training.serving.protocol import ChatShapes

    message = ChatShapes(opened).choice(0, reply, "stop")["message"]
    assert (message.get("reasoning_content", ""), message["content"]) == expected
    for size in range(1, 5):
        shapes = ChatShapes(opened)
        pieces = [reply[i:i + size] for i in range(0, len(reply), size)]
        deltas = [shapes.delta(0, piece, None)["delta"] for piece in pieces] + [shapes.delta(0, "", "stop")["delta"]]
        assert ("".join(d.get("reasoning_content", "") for d in deltas),
                "".join(d.get("content", "") for d in deltas)) == expected


def test_tool_requests_are_checked_as_training_checks_records():
    """Arguments must be a JSON object (decoded once, here as in training), tools OpenAI's function tools; a
    tool_choice that would force a call is refused, as are the legacy function fields."""
    call = {"id": "call00001", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    messages = [{"role": "user", "content": "Time?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call00001", "content": "12:00"}]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    body = parse(ChatRequest, json.dumps({"model": "m", "messages": messages, "tools": tools}).encode())
    assert body.conversation() == ([messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call00001"}], tools)
    bad_arguments = json.loads(json.dumps(messages))
    bad_arguments[1]["tool_calls"][0]["function"]["arguments"] = "{zone: UTC}"
    for extra, param, message in [
        ({"messages": bad_arguments}, "messages", "messages.1: tool call 1: its arguments are not valid JSON "
                                                  "(Expecting property name enclosed in double quotes at character 1)"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools",
         'tools: tool 1 is not {"type": "function", "function": {"name", ...}}'),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
         "tool_choice: this server does not force tool calls; send auto or none"),
    ]:
        with pytest.raises(APIError) as caught:
            parse(ChatRequest, json.dumps({"model": "m", "messages": messages, **extra}).encode())
        assert (caught.value.status, caught.value.param, caught.value.message) == (400, param, message)


# ---------------------------------------------------------------- one real server for the rest

@dataclass
class Server:
    process: subprocess.Popen
    url: str
    key: str
    model: str
    log: Path

    def client(self, key: str | None = None):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=key or self.key, timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def raw(self, method: str, path: str, body: bytes | None = None, auth: bool = True,
            headers: dict[str, str] | None = None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if auth else {}),
                   **(headers or {})}
        request = urllib.request.Request(f"{self.url}{path}", data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())


def wait_until_ready(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"the server was not ready after {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def chat_model_dir(chat_tokenizer, tmp_path_factory) -> Path:
    """The tiny GPT-J over the ChatML tokenizer (its two special tokens included)."""
    path = tmp_path_factory.mktemp("serve-model")
    build_tiny_gptj(chat_tokenizer).save_pretrained(path)
    chat_tokenizer.save_pretrained(path)
    return path


def start_server(model_dir: Path, tmp_path_factory, max_prompt_tokens: int = 256) -> Iterator[Server]:
    """`serve` on `model_dir` in a subprocess, ready; stopped when the generator closes."""
    key = secrets.token_hex(16)
    port = free_port()
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SERVE_TEST_KEY": key}
    command = [PYTHON, "-m", "gpt4all_training.cli", "serve", "--model", str(model_dir), "--port", str(port),
               "--api-key-env", "SERVE_TEST_KEY", "--max-batch-size", "8", "--max-tokens-cap", "64",
               "--max-prompt-tokens", str(max_prompt_tokens), "--log-prompts"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(process, url, log)
        yield Server(process, url, key, str(model_dir), log)
    finally:
        stop(process)


@pytest.fixture(scope="module")
def server(chat_model_dir, tmp_path_factory):
    yield from start_server(chat_model_dir, tmp_path_factory)


def complete(server: Server, prompt: str, **options) -> str:
    return server.client().completions.create(model=server.model, prompt=prompt, **options).choices[0].text


@pytest.mark.integration
def test_the_model_is_listed_and_another_name_is_404(server):
    import openai

    assert [m.id for m in server.client().models.list().data] == [server.model]
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"


@pytest.mark.integration
def test_a_wrong_or_missing_key_is_401(server):
    import openai

    with pytest.raises(openai.AuthenticationError):
        server.client(key="not-the-key").models.list()
    status, body = server.raw("GET", "/v1/models", auth=False)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert server.key not in server.log.read_text()


@pytest.mark.integration
def test_a_request_for_another_host_or_from_another_site_is_403_and_this_machine_s_names_pass(server):
    """Through uvicorn: DNS rebinding (a page's own name resolving to 127.0.0.1) and a cross-site form post are
    refused by the guard the studio shares (tests/hardening/test_web_guard.py tries every route of both apps)."""
    port = server.url.rsplit(":", 1)[1]
    status, body = server.raw("GET", "/v1/models", headers={"Host": "evil.example"})
    assert (status, body["error"]["message"]) == (403, "host 'evil.example': this server answers requests addressed "
                                                       "to this machine only (as 127.0.0.1, localhost or the address "
                                                       "it was started on)")
    status, body = server.raw("POST", "/v1/completions", b"prompt=hi", headers={
        "Origin": "http://evil.example", "Content-Type": "application/x-www-form-urlencoded"})
    assert (status, body["error"]["type"]) == (403, "invalid_request_error")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        assert server.raw("GET", "/v1/models", headers={"Host": host})[0] == 200


@pytest.mark.integration
def test_bad_bodies_and_limits_are_4xx_in_openai_shape(server):
    import openai

    for body in (b"{not json", b"\xff\xfe", b"[]", b""):
        status, error = server.raw("POST", "/v1/completions", body)
        assert status == 400 and set(error["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as caught:
        complete(server, "Hi", max_tokens=65)
    assert caught.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as caught:
        complete(server, "word " * 300, max_tokens=4)
    assert caught.value.body["code"] == "context_length_exceeded"
    status, _ = server.raw("POST", "/v1/completions", b"x" * (2 << 20))
    assert status == 413


@pytest.mark.integration
def test_a_stream_joins_to_the_unstreamed_text(server):
    text = complete(server, PROMPTS[0], max_tokens=20, temperature=0)
    chunks = list(server.client().completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=20,
                                                     temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": PROMPTS[1]}]
    reply = server.client().chat.completions.create(model=server.model, messages=messages, max_tokens=20,
                                                    temperature=0)
    stream = list(server.client().chat.completions.create(model=server.model, messages=messages, max_tokens=20,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content
    assert stream[-1].usage.completion_tokens == reply.usage.completion_tokens


@pytest.mark.integration
def test_output_ends_before_a_stop_string(server):
    text = complete(server, PROMPTS[2], max_tokens=30, temperature=0)
    # Three characters from the middle of the greedy text, none a partial character.
    start = next(i for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3] and text[i:i + 3].strip())
    stop = text[start:start + 3]
    expected = text[:text.index(stop)]
    response = server.client().completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=30,
                                                  temperature=0, stop=[stop, "never there"])
    assert (response.choices[0].text, response.choices[0].finish_reason) == (expected, "stop")
    streamed = server.client().completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=30,
                                                  temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


@pytest.mark.integration
def test_a_seed_repeats_a_sample_and_other_seeds_differ(server):
    first, again = (complete(server, PROMPTS[3], max_tokens=16, temperature=1.0, seed=11) for _ in range(2))
    assert first == again
    others = {complete(server, PROMPTS[3], max_tokens=16, temperature=1.0, seed=s) for s in range(4)}
    assert len(others) > 1
    choices = server.client().completions.create(model=server.model, prompt=PROMPTS[3], max_tokens=16,
                                                 temperature=1.0, seed=11, n=2).choices
    assert choices[0].text == first and choices[1].text != first  # choice i draws with seed + i


@pytest.mark.integration
def test_concurrent_clients_are_batched_and_get_the_sequential_greedy_text(server):
    lengths = [6 + (i % 4) * 5 for i in range(len(PROMPTS))]

    def one(i: int) -> str:
        return complete(server, PROMPTS[i], max_tokens=lengths[i], temperature=0)

    sequential = [one(i) for i in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent_ = list(pool.map(one, range(len(PROMPTS)), timeout=REQUEST_TIMEOUT_S))
    assert concurrent_ == sequential
    status, metrics = server.raw("GET", "/metrics")
    assert status == 200 and metrics["max_batch_rows"] > 1
    assert any(f"batch={size}" in server.log.read_text() for size in range(2, 9))


@pytest.mark.integration
def test_secrets_in_any_string_field_of_a_request_never_reach_the_log(server):
    """With --log-prompts the prompts are logged: the server's API key (an environment secret) and a token-shaped
    credential pasted into every string field are logged as ***."""
    token = "hf_" + secrets.token_hex(17)
    pasted = f"{token} {server.key}"
    for route, body in [
        ("/v1/completions", {"model": server.model, "prompt": f"say {pasted}", "stop": [pasted], "user": pasted,
                             "max_tokens": 2}),
        ("/v1/chat/completions", {"model": server.model, "user": pasted, "max_tokens": 2, "stop": pasted,
                                  "messages": [{"role": "system", "content": pasted, "name": pasted},
                                               {"role": "user", "content": [{"type": "text", "text": pasted}]}]}),
        ("/v1/completions", {"model": pasted, "prompt": "x"}),
        ("/v1/chat/completions", {"model": server.model, "messages": [{"role": pasted, "content": pasted}]}),
    ]:
        status, _ = server.raw("POST", route, json.dumps(body).encode())
        assert status in (200, 400, 404)
    log = server.log.read_text()
    assert token not in log and server.key not in log
    assert "prompt='say *** ***'" in log


# ---------------------------------------------------------------- tools and reasoning, served

@pytest.fixture(scope="module")
def thinking_client(tokenizer_dir):
    """The official client on the app (in this process: starlette's TestClient is its HTTP client) over the tiny
    GPT-J with Qwen3 Thinking-2507's template: it renders tools, tool calls and reasoning, and its generation prompt
    opens the <think> block, so a reply starts as reasoning."""
    from openai import OpenAI
    from starlette.testclient import TestClient
    from support.templates import family_tokenizer

    from gpt4all_training.serving.app import ServeSettings, create_app, eos_ids

    tokenizer = family_tokenizer(tokenizer_dir, "qwen3-thinking")
    model = build_tiny_gptj(tokenizer, seed=3).eval()
    engine = Engine(model, tokenizer, eos_ids(model, tokenizer), max_batch_size=4, max_queue=8)
    app = create_app(engine, tokenizer, ServeSettings(model_id="thinking", max_tokens_cap=64, max_prompt_tokens=512),
                     512)
    with TestClient(app, base_url="http://127.0.0.1:8000/v1") as http:
        yield OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none", http_client=http, max_retries=0)


THINKING_REQUEST = {
    "messages": [{"role": "user", "content": "What time is it in Tokyo?"},
                 {"role": "assistant", "content": None, "reasoning_content": "I need the clock.", "tool_calls": [
                     {"id": "call00002", "type": "function",
                      "function": {"name": "get_time", "arguments": '{"zone": "Asia/Tokyo"}'}}]},
                 {"role": "tool", "tool_call_id": "call00002", "name": "get_time", "content": '{"time": "09:30"}'}],
    "tools": [{"function": {"parameters": {"properties": {"zone": {"type": "string"}}, "type": "object"},
                            "name": "get_time"}, "type": "function"}]}


def test_a_tool_conversation_is_served_from_training_s_ids_with_the_reasoning_apart(thinking_client, tokenizer_dir):
    """The request's tools, tool call (its reasoning included) and tool result are encoded as training encodes the
    same conversation (the prompt's token count is theirs, and the greedy reply is the completion of their text);
    the reply, which the prompt opened inside <think>, comes back as reasoning_content, streamed the same."""
    from support.templates import decoded, family_tokenizer

    from gpt4all_training.serving.reasoning import split_reasoning

    tokenizer = family_tokenizer(tokenizer_dir, "qwen3-thinking")
    [trained] = encode_for_generation(tokenizer, [decoded(THINKING_REQUEST["messages"])], [THINKING_REQUEST["tools"]])
    reply = thinking_client.chat.completions.create(model="thinking", max_tokens=24, temperature=0,
                                                    **THINKING_REQUEST)
    assert reply.usage.prompt_tokens == len(trained)
    completion = thinking_client.completions.create(model="thinking", prompt=tokenizer.decode(trained), max_tokens=24,
                                                    temperature=0)
    assert completion.usage.prompt_tokens == len(trained)
    reasoning, content = split_reasoning(completion.choices[0].text, opened=True)
    message = reply.choices[0].message
    assert reasoning and (getattr(message, "reasoning_content", ""), message.content) == (reasoning, content)
    chunks = list(thinking_client.chat.completions.create(model="thinking", max_tokens=24, temperature=0,
                                                          stream=True, **THINKING_REQUEST))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content

@pytest.mark.integration
def test_sigterm_lets_the_running_request_finish_then_exits(server):
    """Last in the module: it stops the shared server."""
    expected = complete(server, PROMPTS[4], max_tokens=64, temperature=0)
    first_chunk = threading.Event()
    chunks = []

    def stream_one():
        for chunk in server.client().completions.create(model=server.model, prompt=PROMPTS[4], max_tokens=64,
                                                        temperature=0, stream=True):
            chunks.append(chunk)
            first_chunk.set()

    client = threading.Thread(target=stream_one)
    client.start()
    assert first_chunk.wait(REQUEST_TIMEOUT_S)
    server.process.send_signal(signal.SIGTERM)
    client.join(REQUEST_TIMEOUT_S)
    # uvicorn shuts down gracefully, then re-raises the signal it caught: the process ends by SIGTERM, as expected.
    assert server.process.wait(timeout=60) == -signal.SIGTERM
    assert "Application shutdown complete" in server.log.read_text()
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
