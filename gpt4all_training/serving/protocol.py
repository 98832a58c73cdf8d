"""The OpenAI API's shapes: the request bodies (validated), the error body, and the responses and stream chunks.

Fields of OpenAI's API that this server does not implement (logprobs, penalties, ...) are ignored, as several
OpenAI-compatible servers do, so existing clients keep working. Tools are taken as training takes them: `tools` and
the conversation's tool calls (arguments a JSON object, decoded once, as in training) and tool results go to the chat
template (serving/chat.py answers 400 where the model's template leaves them out of its text). What would silently
be another answer than the one asked for is refused: the legacy `functions`, a `tool_choice` that forces a call
(the reply is the model's own; tool calls stay text in its content), a role the chat templates do not know.
Reasoning the reply opens with comes back apart from its content (`reasoning_content`, serving/reasoning.py).

A body is refused before validation when it is not JSON, nests deeper than MAX_JSON_DEPTH, or holds a lone surrogate
(`"\ud800"` without its pair: JSON can spell it, but it is not Unicode text, and no tokenizer takes it).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpt4all_training.data.conversations import field_problem, template_messages, tools_problem
from gpt4all_training.serving.reasoning import ReasoningStream, split_reasoning

MAX_STOP_STRINGS = 4  # as OpenAI
# Far deeper than any request of the API (a tool's JSON schema included); deeper bodies are refused unread.
MAX_JSON_DEPTH = 64
ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer name for system
LEGACY_TOOL_FIELDS = ("functions", "function_call")
TOOL_CHOICES = ("auto", "none")  # what the model may do anyway; "required" or a named function would force a call


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
    tool_call_id: Optional[str] = None
    name: Optional[str] = None
    reasoning_content: Optional[str] = None

    def as_dict(self) -> dict[str, Any]:
        """The message as training's records hold it: text parts joined, no content as empty text, developer as
        system; tool calls and reasoning on an assistant turn, the call's id and name on a tool result."""
        role = "system" if self.role == "developer" else self.role
        content = "".join(part.text for part in self.content) if isinstance(self.content, list) else self.content
        message: dict[str, Any] = {"role": role, "content": content or ""}
        kept = {"assistant": ("tool_calls", "reasoning_content"), "tool": ("tool_call_id", "name")}.get(role, ())
        message.update({key: getattr(self, key) for key in kept if getattr(self, key)})
        return message


class ChatRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None

    def check_roles_and_tools(self, data: dict[str, Any]) -> None:
        """400 for what this server cannot honour: the legacy function fields (in the request's `data`), a
        tool_choice that forces a call, malformed tools or tool calls (arguments that are not a JSON object
        included), or a role the chat templates do not know."""
        for key in LEGACY_TOOL_FIELDS:
            if data.get(key):
                raise APIError(400, f"{key}: the legacy function-calling fields are not supported; send tools (and "
                                    f"tool_choice) instead", param=key)
        if self.tool_choice is not None and self.tool_choice not in TOOL_CHOICES:
            raise APIError(400, f"tool_choice: this server does not force tool calls; send {' or '.join(TOOL_CHOICES)}",
                           param="tool_choice")
        if self.tools:
            problem = tools_problem(self.tools)
            if problem:
                raise APIError(400, problem if problem.startswith("field") else f"tools: {problem}", param="tools")
        for i, message in enumerate(self.messages):
            if message.role not in ROLES:
                raise APIError(400, f"messages.{i}.role: {message.role!r} is not a role this server takes (one of "
                                    f"{', '.join(ROLES)})", param="messages")
            found = field_problem(message.as_dict())
            if found:
                raise APIError(400, f"messages.{i}: {found[1]}", param="messages")

    def conversation(self) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
        """(the messages, the tools or None) as training gives them to the chat template."""
        return template_messages([message.as_dict() for message in self.messages]), self.tools or None


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
    """The chat bodies, the reply's reasoning apart from its content; `opens_reasoning`: the prompt ends inside a
    <think> block, so the reply starts as reasoning."""
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def __init__(self, opens_reasoning: bool = False):
        self.opens_reasoning = opens_reasoning
        self.streams: dict[int, ReasoningStream] = {}

    def choice(self, index, text, finish_reason):
        reasoning, content = split_reasoning(text, self.opens_reasoning)
        message = {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}
        return {"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason}

    def delta(self, index, text, finish_reason):
        stream = self.streams.setdefault(index, ReasoningStream(self.opens_reasoning))
        reasoning, content = stream.feed(text, final=finish_reason is not None)
        delta = {key: value for key, value in (("reasoning_content", reasoning), ("content", content)) if value}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def opening(self, index):
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}


def sse(data: Union[dict[str, Any], str]) -> str:
    """One server-sent event as OpenAI sends them: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
