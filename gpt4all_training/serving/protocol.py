"""The OpenAI API's shapes: the request bodies (validated), the error body, and the responses and stream chunks.

Fields of OpenAI's API that this server does not implement (logprobs, penalties, tools, ...) are ignored, as
several OpenAI-compatible servers do, so existing clients keep working.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP_STRINGS = 4  # as OpenAI


class APIError(Exception):
    """An error response: `status` and OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampled(BaseModel):
    """The fields both endpoints take."""
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
        return tuple(stops)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Sampled):
    prompt: Union[str, list[str]]
    max_tokens: Optional[int] = Field(None, ge=1)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Union[str, list[TextPart], None] = None

    def as_dict(self) -> dict[str, str]:
        """The message as chat templates read it: text parts joined, no content as empty text."""
        if isinstance(self.content, list):
            return {"role": self.role, "content": "".join(part.text for part in self.content)}
        return {"role": self.role, "content": self.content or ""}


class ChatRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # OpenAI's newer name for max_tokens


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The request body as `model`, or a 400 APIError naming the first field that is wrong."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise APIError(400, "We could not parse the JSON body of your request: it is not valid JSON.") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise APIError(400, f"{where}: {error['msg']}", param=str(error["loc"][0]) if error["loc"] else None) \
            from None


# ---------------------------------------------------------------- responses

def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Shapes:
    """The response and chunk bodies of one endpoint."""
    object: str
    chunk_object: str
    id_prefix: str

    def choice(self, index: int, text: str, finish_reason: Optional[str]) -> dict[str, Any]:
        raise NotImplementedError

    def delta(self, index: int, text: str, finish_reason: Optional[str]) -> dict[str, Any]:
        raise NotImplementedError

    def opening(self, index: int) -> Optional[dict[str, Any]]:
        """The chunk a stream starts each choice with, if any."""
        return None


class CompletionShapes(Shapes):
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    def choice(self, index, text, finish_reason):
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    delta = choice


class ChatShapes(Shapes):
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def choice(self, index, text, finish_reason):
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def delta(self, index, text, finish_reason):
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                "finish_reason": finish_reason}

    def opening(self, index):
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}


def sse(data: Union[dict[str, Any], str]) -> str:
    """One server-sent event as OpenAI sends them: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
