"""The HTTP side: FastAPI routes in OpenAI's API, and the guard every request passes first.

Routes: GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions (streamed as
server-sent events when asked), GET /metrics (the scheduler's counters: batch sizes, tokens) and GET /health (the
only route open without the API key).

Every request passes the browser checks first (serving/guard.py, shared with the studio: the Host header must name
this machine, and a request that changes something must not come from another site's page), then the API key.
Every request is bounded before any work is done: the body size, max_tokens, the prompt length (and prompt plus
max_tokens within the model's context), the rows of one request (prompts x n) and the queue of waiting requests.
Each mistake is a 4xx with OpenAI's error body. One log line per request: status, route, prompt and generated
tokens, the batch it was decoded in, latency; the prompt text only with log_prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from gpt4all_training.model.decoding import Sampling
from gpt4all_training.serving.chat import chat_encoder, end_of_turn_ids, opens_reasoning, render
from gpt4all_training.serving.engine import Choice, Delta, Engine, Failed, Finished, QueueFull, ShuttingDown, Ticket
from gpt4all_training.serving.guard import BrowserGuard, allowed_hosts
from gpt4all_training.serving.protocol import (APIError, ChatRequest, ChatShapes, CompletionRequest,
                                               CompletionShapes, Sampled, Shapes, error_body, parse, sse, usage)

log = logging.getLogger("gpt4all_training.serving")

MAX_BODY_BYTES = 1 << 20  # far above any prompt max_prompt_tokens allows; a bigger body is refused unread
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
OPEN_PATHS = ("/health",)
SEED_RANGE = 1 << 63


@dataclass(frozen=True)
class ServeSettings:
    model_id: str  # the name clients pass back as `model`
    max_batch_size: int = 8
    max_tokens_cap: int = 512
    max_prompt_tokens: int = 2048
    max_queue: int = 64
    api_key: Optional[str] = None
    log_prompts: bool = False
    host: str = "127.0.0.1"  # the address bound: requests must name it (or this machine's loopback names)


def context_length(model, tokenizer) -> Optional[int]:
    """The most positions the model takes, when its config says (or its tokenizer, within reason)."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "seq_length"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and limit < 10**7 else None


def eos_ids(model, tokenizer) -> set[int]:
    """Where a continuation ends: the tokenizer's EOS, the model's generation config's, and the chat template's
    end-of-turn token."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([configured] if isinstance(configured, int) else configured or [])
    return ids | end_of_turn_ids(tokenizer)


# ---------------------------------------------------------------- the guard: key, body size, the log line

def browser_refusal(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "invalid_request_error"), status_code=status)


def json_message(status: int, body: dict[str, Any]) -> list[dict[str, Any]]:
    data = json.dumps(body).encode()
    return [{"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]},
            {"type": "http.response.body", "body": data}]


class Guard:
    """ASGI middleware around the app: the API key (401 without it), the body size (413 past MAX_BODY_BYTES,
    refused before it is read further), and one log line per request once its response has ended."""

    def __init__(self, app, api_key: Optional[str], log_prompts: bool):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.log_prompts = log_prompts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        state = scope.setdefault("state", {})
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self.refusal(scope)
            body = None if refusal else await self.read_body(receive)
            if refusal is None and body is None:
                refusal = (413, error_body(f"The request body is larger than {MAX_BODY_BYTES} bytes.",
                                           "invalid_request_error"))
            if refusal:
                for message in json_message(*refusal):
                    await send_status(message)
                return
            await self.app(scope, self.replay(body, receive), send_status)
        finally:
            self.log_line(scope, state, status, time.perf_counter() - started)

    def refusal(self, scope) -> Optional[tuple[int, dict[str, Any]]]:
        if self.expected is None or scope["path"] in OPEN_PATHS:
            return None
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return None
        return 401, error_body("Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")

    @staticmethod
    async def read_body(receive) -> Optional[bytes]:
        """The whole body, or None once it passes MAX_BODY_BYTES."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # the client went away; the app sees an empty body
            size += len(message.get("body", b""))
            if size > MAX_BODY_BYTES:
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    def replay(body: bytes, receive):
        """A receive that hands the app the body already read, then listens for the disconnect as usual."""
        delivered = False

        async def replayed():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replayed

    def log_line(self, scope, state: dict[str, Any], status: int, seconds: float) -> None:
        parts = [str(status), scope["method"], scope["path"]]
        if "prompt_tokens" in state:
            parts += [f"prompt_tokens={state['prompt_tokens']}",
                      f"completion_tokens={state.get('completion_tokens', 0)}", f"batch={state.get('batch', 0)}"]
        parts.append(f"latency_ms={seconds * 1000:.0f}")
        if self.log_prompts and "prompt" in state:
            parts.append(f"prompt={state['prompt']!r}")
        log.info(" ".join(parts))


# ---------------------------------------------------------------- the app and its routers

def create_app(engine: Engine, tokenizer, settings: ServeSettings, context: Optional[int]):
    """The FastAPI app over `engine` (started and closed by the app's lifespan): the service routes and the OpenAI
    routes, errors in OpenAI's shape, wrapped in the browser checks and the Guard. A web app mounts its own router
    beside these."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            # Runs once uvicorn's graceful shutdown has let running requests finish: what is left is cancelled.
            engine.close()

    app = FastAPI(title="gpt4all-training serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    add_error_handlers(app)
    app.include_router(service_router(engine))
    app.include_router(openai_router(engine, tokenizer, settings, context))
    return BrowserGuard(Guard(app, settings.api_key, settings.log_prompts), allowed_hosts(settings.host),
                        browser_refusal, log)


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body: the API's own, unknown routes and methods, and a failure of the server."""

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(_request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(error_body(f"The server failed ({type(exc).__name__}).", "server_error"),
                            status_code=500)


def service_router(engine: Engine) -> APIRouter:
    """GET /health (open without the API key) and GET /metrics (the scheduler's counters)."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        return {"status": "ok"}

    @router.get("/metrics")
    async def metrics():
        return {**engine.stats.as_dict(), "waiting": len(engine.waiting), "running_rows": len(engine.rows)}

    return router


def openai_router(engine: Engine, tokenizer, settings: ServeSettings, context: Optional[int]) -> APIRouter:
    """OpenAI's routes over `engine`: GET /v1/models (and /v1/models/{id}), POST /v1/completions and POST
    /v1/chat/completions."""
    router = APIRouter()
    encoder = chat_encoder(tokenizer)
    card = {"id": settings.model_id, "object": "model", "created": int(time.time()), "owned_by": "gpt4all-training"}

    def check_model(name: str) -> None:
        if name != settings.model_id:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{settings.model_id}`.",
                           param="model", code="model_not_found")

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return card

    @router.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = parse(CompletionRequest, await request.body())
        check_model(body.model)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts:
            raise APIError(400, "prompt: give a string or a non-empty list of strings", param="prompt")
        ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
        max_tokens = body.max_tokens or min(DEFAULT_COMPLETION_TOKENS, settings.max_tokens_cap)
        if settings.log_prompts:
            request.state.prompt = prompts[0] if len(prompts) == 1 else prompts
        return await answer(request, body, ids, max_tokens, "max_tokens", "prompt", CompletionShapes())

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatRequest = parse(ChatRequest, await request.body())
        check_model(body.model)
        messages, tools = body.conversation()
        ids = [render(encoder, messages, tools)]
        assert encoder is not None  # render refused the request: the tokenizer has no chat template
        key = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # OpenAI's default: as long as the context allows
            room = context - len(ids[0]) if context else settings.max_tokens_cap
            max_tokens = max(1, min(settings.max_tokens_cap, room))
        if settings.log_prompts:
            request.state.prompt = messages
        return await answer(request, body, ids, max_tokens, key, "messages",
                            ChatShapes(opens_reasoning(encoder, messages, tools)))

    async def answer(request, body: Sampled, ids: list[list[int]], max_tokens: int, tokens_key: str,
                     prompt_key: str, shapes: Shapes):
        stop = body.stops()
        check_limits(settings, context, body, ids, max_tokens, tokens_key, prompt_key)
        base_seed = body.seed if body.seed is not None else secrets.randbelow(SEED_RANGE)
        sampling = Sampling(body.temperature, body.top_p)
        # Choice i of the request: prompt i // n; its seed is the request's plus i, so n choices differ.
        choices = [Choice(i, prompt, max_tokens, sampling, (base_seed + i) % SEED_RANGE)
                   for i, prompt in enumerate(p for p in ids for _ in range(body.n))]
        ticket = Ticket(choices, stop, body.stream, asyncio.get_running_loop())
        try:
            engine.submit(ticket)
        except ShuttingDown as exc:
            raise APIError(503, str(exc), "server_error") from None
        except QueueFull as exc:
            raise APIError(429, str(exc), "requests", code="rate_limit_exceeded") from None
        state = request.state
        state.prompt_tokens = sum(len(prompt) for prompt in ids)
        reply_id = shapes.id_prefix + secrets.token_hex(12)
        head = {"id": reply_id, "created": int(time.time()), "model": settings.model_id}
        if body.stream:
            events = stream(ticket, shapes, head, body.include_usage, state)
            return StreamingResponse(events, media_type="text/event-stream")
        finished = await collect(ticket, state)
        return {**head, "object": shapes.object,
                "choices": [shapes.choice(f.index, f.text, f.finish_reason) for f in finished],
                "usage": usage(state.prompt_tokens, state.completion_tokens)}

    return router


def check_limits(settings: ServeSettings, context: Optional[int], body: Sampled, ids: list[list[int]],
                 max_tokens: int, tokens_key: str, prompt_key: str) -> None:
    """A request past this server's bounds (max_tokens, rows, the prompt's length, the context) refused by key."""
    if max_tokens > settings.max_tokens_cap:
        raise APIError(400, f"{tokens_key} is {max_tokens}; this server generates at most "
                            f"{settings.max_tokens_cap} tokens per request.", param=tokens_key)
    rows = len(ids) * body.n
    if rows > settings.max_batch_size:
        raise APIError(400, f"n: {rows} completions in one request; this server decodes at most "
                            f"{settings.max_batch_size} together.", param="n")
    for prompt in ids:
        if not prompt:
            raise APIError(400, f"{prompt_key}: the prompt is empty", param=prompt_key)
        if len(prompt) > settings.max_prompt_tokens:
            raise APIError(400, f"{prompt_key}: {len(prompt)} tokens; this server takes at most "
                                f"{settings.max_prompt_tokens}.", param=prompt_key,
                           code="context_length_exceeded")
        if context and len(prompt) + max_tokens > context:
            raise APIError(400, f"This model's maximum context length is {context} tokens; the prompt has "
                                f"{len(prompt)} and {tokens_key} asks for {max_tokens}.", param=prompt_key,
                           code="context_length_exceeded")


async def collect(ticket: Ticket, state) -> list[Finished]:
    """A request's choices once all have finished (a failure is a 500); cancelled if the client goes first."""
    finished: dict[int, Finished] = {}
    try:
        while len(finished) < len(ticket.choices):
            event = await ticket.events.get()
            if isinstance(event, Failed):
                raise APIError(500, event.message, "server_error")
            if isinstance(event, Finished):
                finished[event.index] = event
    finally:
        ticket.cancelled = len(finished) < len(ticket.choices)
        note_usage(state, ticket, finished.values())
    return [finished[i] for i in sorted(finished)]


async def stream(ticket: Ticket, shapes: Shapes, head: dict[str, Any], include_usage: bool,
                 state) -> AsyncIterator[str]:
    """A request's choices as server-sent events while they decode; cancelled if the client goes first."""
    def chunk(choices: list[dict[str, Any]]) -> str:
        return sse({**head, "object": shapes.chunk_object, "choices": choices})

    finished: dict[int, Finished] = {}
    try:
        for choice in ticket.choices:
            if (opening := shapes.opening(choice.index)) is not None:
                yield chunk([opening])
        while len(finished) < len(ticket.choices):
            event = await ticket.events.get()
            if isinstance(event, Delta):
                yield chunk([shapes.delta(event.index, event.text, None)])
            elif isinstance(event, Finished):
                finished[event.index] = event
                yield chunk([shapes.delta(event.index, "", event.finish_reason)])
            else:
                yield sse(error_body(event.message, "server_error"))
                break
        if include_usage:
            note_usage(state, ticket, finished.values())
            yield sse({**head, "object": shapes.chunk_object, "choices": [],
                       "usage": usage(state.prompt_tokens, state.completion_tokens)})
        yield sse("[DONE]")
    finally:
        ticket.cancelled = len(finished) < len(ticket.choices)
        note_usage(state, ticket, finished.values())


def note_usage(state, ticket: Ticket, finished) -> None:
    """The request's tokens and batch, for its log line and its `usage`."""
    state.completion_tokens = sum(f.completion_tokens for f in finished)
    state.batch = ticket.batch_rows
