"""The chat panel: a conversation with any final/ or step_N/ checkpoint, streamed token by token through the serving
engine (`gpt4all-training serve` decodes with the same Engine, prompt rendering and stopping rules).

One model is open at a time; choosing another closes the first. Its replies arrive as server-sent events:
`{"delta": text}` as text is decoded, then `{"done": true, "finish_reason", "completion_tokens"}`, or
`{"error": message}`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

import torch
from pydantic import BaseModel, Field

from gpt4all_training.config.fields import PathName
from gpt4all_training.errors import UserError
from gpt4all_training.model.decoding import Sampling
from gpt4all_training.model.trained import DTYPES, open_model
from gpt4all_training.serving.app import context_length, eos_ids
from gpt4all_training.serving.chat import chat_encoder, render
from gpt4all_training.serving.engine import Choice, Delta, Engine, Failed, Finished, Ticket
from gpt4all_training.serving.protocol import APIError

MAX_BATCH_SIZE = 4
MAX_QUEUE = 16
MAX_TOKENS = 1024
SEED_RANGE = 1 << 63


class ChatMessage(BaseModel):
    role: str = Field(pattern="^(system|user|assistant)$")
    content: str = Field(max_length=100_000)


class ChatRequest(BaseModel):
    model: PathName
    messages: list[ChatMessage] = Field(min_length=1, max_length=200)
    max_tokens: int = Field(128, ge=1, le=MAX_TOKENS)
    temperature: float = Field(0.7, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: Optional[int] = Field(None, ge=0, lt=SEED_RANGE)


@dataclass
class OpenModel:
    name: str
    engine: Engine
    encoder: Any
    context: Optional[int]


def sse(value: dict[str, Any]) -> str:
    return f"data: {json.dumps(value)}\n\n"


class ChatModels:
    def __init__(self, dtype: str = "float32", device: Optional[str] = None):
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.current: Optional[OpenModel] = None
        self.lock = threading.Lock()

    def open(self, name: str) -> OpenModel:
        """The engine of model `name` (a path as `serve --model` takes it), loading it (and closing the one open
        before) when needed."""
        with self.lock:
            if self.current is None or self.current.name != name:
                self.close_current()
                model, tokenizer = open_model(name, self.dtype, self.device)
                engine = Engine(model, tokenizer, eos_ids(model, tokenizer), MAX_BATCH_SIZE, MAX_QUEUE)
                engine.start()
                self.current = OpenModel(name, engine, chat_encoder(tokenizer), context_length(model, tokenizer))
            return self.current

    def close_current(self) -> None:
        if self.current is not None:
            self.current.engine.close()
            self.current = None

    def close(self) -> None:
        with self.lock:
            self.close_current()

    def ticket(self, opened: OpenModel, request: ChatRequest) -> Ticket:
        """The request as the engine's ticket; UserError when the model cannot take it."""
        try:
            ids = render(opened.encoder, [message.model_dump() for message in request.messages])
        except APIError as exc:
            raise UserError(f"chat with {opened.name}: {exc.message}") from None
        if opened.context and len(ids) + request.max_tokens > opened.context:
            raise UserError(f"chat with {opened.name}: the conversation has {len(ids)} tokens and max_tokens asks for "
                            f"{request.max_tokens}; the model takes {opened.context}: start a new conversation")
        seed = request.seed if request.seed is not None else secrets.randbelow(SEED_RANGE)
        choice = Choice(0, ids, request.max_tokens, Sampling(request.temperature, request.top_p), seed)
        return Ticket([choice], (), True, asyncio.get_running_loop())

    async def stream(self, opened: OpenModel, ticket: Ticket) -> AsyncIterator[str]:
        opened.engine.submit(ticket)
        done = False
        try:
            while not done:
                event = await ticket.events.get()
                if isinstance(event, Delta):
                    yield sse({"delta": event.text})
                elif isinstance(event, Finished):
                    done = True
                    yield sse({"done": True, "finish_reason": event.finish_reason,
                               "completion_tokens": event.completion_tokens})
                elif isinstance(event, Failed):
                    done = True
                    yield sse({"error": f"error: {event.message}"})
        finally:
            ticket.cancelled = not done  # the page went away: the engine drops the row at its next step
