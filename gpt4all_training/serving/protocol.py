"""The OpenAI API's shapes: the request bodies (validated), the error body, and the responses and stream chunks.

Fields of OpenAI's API that this server does not implement (logprobs, penalties, ...) are ignored, as several
OpenAI-compatible servers do, so existing clients keep working; but a request that asks for tools (`tools`,
`functions`, a tool message or an assistant turn with tool calls) is refused, since answering it without them would
silently be another answer than the one asked for. So is a role the chat templates do not know.

A body is refused before validation when it is not JSON, nests deeper than MAX_JSON_DEPTH, or holds a lone surrogate
(`"\ud800"` without its pair: JSON can spell it, but it is not Unicode text, and no tokenizer takes it).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP_STRINGS = 4  # as OpenAI
# Far deeper than any request of the API (a tool's JSON schema included); deeper bodies are refused unread.
MAX_JSON_DEPTH = 64
ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name for system
TOOL_FIELDS = ("tools", "functions", "tool_choice", "function_call")


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
    tool_calls: Optional[list[Any]] = None

    def as_dict(self) -> dict[str, str]:
        """The message as chat templates read it: text parts joined, no content as empty text, developer as
        system."""
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, list):
            return {"role": role, "content": "".join(part.text for part in self.content)}
        return {"role": role, "content": self.content or ""}


class ChatRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    def check_roles_and_tools(self, data: dict[str, Any]) -> None:
        """400 for what this server cannot honour: tools asked for (in the request's `data`, or a turn that calls
        or answers one), or a role the chat templates do not know."""
        for key in TOOL_FIELDS:
            if data.get(key):
                raise APIError(400, f"{key}: this server does not support tools (function calling) yet; send the "
                                    f"request without {key}", param=key)
        for i, message in enumerate(self.messages):
            if message.role == "tool" or message.tool_calls:
                raise APIError(400, f"messages.{i}: a tool call or its result; this server does not support tools "
                                    f"(function calling) yet", param="messages")
            if message.role not in ROLES:
                raise APIError(400, f"messages.{i}.role: {message.role!r} is not a role this server takes (one of "
                                    f"{', '.join(ROLES)})", param="messages")


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The request body as `model`, or a 400 APIError naming the first field that is wrong."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # RecursionError: nested past the parser
        raise APIError(400, "We could not parse the JSON body of your request: it is not valid JSON, or it is "
                            f"nested more than {MAX_JSON_DEPTH} levels deep.") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    check_json_text(data)
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise APIError(400, f"{where}: {error['msg']}", param=str(error["loc"][0]) if error["loc"] else None) \
            from None
    if isinstance(parsed, ChatRequest):
        parsed.check_roles_and_tools(data)
    return parsed


def check_json_text(data: dict[str, Any]) -> None:
    """400 for a body nested deeper than MAX_JSON_DEPTH, or with a lone surrogate in any key or string, naming
    where. Walked with a stack of its own: a body is no reason for Python's recursion."""
    stack: list[tuple[Any, list[str]]] = [(data, [])]
    while stack:
        value, path = stack.pop()
        where = ".".join(path) or "the body"
        if len(path) > MAX_JSON_DEPTH:
            raise APIError(400, f"{'.'.join(path[:3])}...: nested more than {MAX_JSON_DEPTH} levels deep",
                           param=path[0])
        if isinstance(value, dict):
            for key, item in value.items():
                if not is_text(key):
                    raise APIError(400, f"{where}: a key holds a lone surrogate (a \\ud800-\\udfff escape "
                                        f"without its pair), which is not Unicode text",
                                   param=path[0] if path else None)
                stack.append((item, [*path, key]))
        elif isinstance(value, list):
            stack.extend((item, [*path, str(i)]) for i, item in enumerate(value))
        elif isinstance(value, str) and not is_text(value):
            raise APIError(400, f"{where}: holds a lone surrogate (a \\ud800-\\udfff escape without its pair), which "
                                f"is not Unicode text", param=path[0] if path else None)


def is_text(value: str) -> bool:
    """False for a string with a lone surrogate, which no UTF-8 encoder (and no tokenizer) takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
