"""Conversations: the one record shape for multi-turn chat, read from the common shapes and checked.

A conversation record is `{"messages": [{"role", "content"}, ...], "source": ...}` with roles `system`, `user`,
`assistant` and `tool`, and optionally `tools`, the tool definitions the conversation offers the model, in OpenAI's
format (`[{"type": "function", "function": {"name", "description", "parameters"}}]`). A message may also carry what
chat templates read (`tool_calls` and `reasoning_content` on an assistant turn, `name` and `tool_call_id` on a tool
turn) and our own `"train": false`, which keeps an assistant turn as context only.

A tool call's `arguments` are stored as OpenAI sends them, a JSON string (an object would give the dataset a column
type that differs from line to line), and must decode to a JSON object: templates are given the object
(`template_messages`, the one place they are decoded), since a template that writes `arguments | tojson` would write
a string's quotes and escapes, text the model never sees at inference.

Read from: OpenAI `messages`, ShareGPT `conversations` (`from`/`value`), TRL's conversational prompt/completion, and
OpenAssistant message trees as whole threads. Nothing here raises for bad data: a parser returns a list of messages
or the drop reason (a string), which clean.py counts and data.py counts the same way.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's `from`, lower-cased, to our role. ShareGPT dumps write "gpt" (and "chatgpt" in some) for the model.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "assistant": "assistant", "system": "system", "tool": "tool"}
OASST_ROLES = {"prompter": "user", "assistant": "assistant"}
# OpenAssistant trees: every root-to-leaf thread (each reply trained once), or only the best-ranked one.
OASST_THREAD_MODES = ("paths", "best")
# The roles an assistant turn, a tool turn and a user turn may follow. Two user turns in a row pass here: only the
# chat template knows whether it can render them (data.py drops what the template refuses).
MAY_FOLLOW = {"assistant": ("user", "tool"), "tool": ("assistant", "tool"), "user": (None, "system", "user",
                                                                                     "assistant")}


def encodable(text: str) -> bool:
    """False for a lone surrogate, which JSON may escape ("\\ud800"): valid JSON, but no UTF-8 file can hold it,
    and no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def normalize_whitespace(text: str) -> str:
    """`text` with every run of whitespace one space: what duplicates are compared by."""
    return " ".join(text.split())


def is_text(value: Any) -> bool:
    """A string that can be written as UTF-8 and tokenised."""
    return isinstance(value, str) and encodable(value)


def trained(message: dict[str, Any]) -> bool:
    """An assistant turn is trained unless it says `"train": false`."""
    return message.get("role") == "assistant" and message.get("train") is not False


# The record schema's message fields and the type each takes (a field that is absent or null is always allowed);
# `tool_calls` is a list of OpenAI's {"function": {"name", "arguments"}} (arguments as a JSON string or an object).
MESSAGE_FIELDS = {"content": (str, "text"), "name": (str, "text"), "tool_call_id": (str, "text"),
                  "reasoning_content": (str, "text"), "train": (bool, "true or false")}


def well_formed_call(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str) \
        and isinstance(function.get("arguments"), (str, dict))


def arguments_problem(arguments: str | dict) -> str | None:
    """Why a tool call's arguments are not a JSON object (in words), or None."""
    if isinstance(arguments, dict):
        return None
    try:
        decoded = json.loads(arguments)
    except json.JSONDecodeError as exc:
        return f"not valid JSON ({exc.msg} at character {exc.pos})"
    return None if isinstance(decoded, dict) else f"JSON {type(decoded).__name__}, not an object"


def tools_problem(tools: Any) -> str | None:
    """What is wrong with a record's `tools` (in words), or None when it is a list of OpenAI function tools."""
    if not isinstance(tools, list):
        return f"field 'tools' is {type(tools).__name__}, not a list of tool definitions"
    for number, tool in enumerate(tools, start=1):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            return f'tool {number} is not {{"type": "function", "function": {{"name", ...}}}}'
    return None


def field_problem(message: dict[str, Any]) -> tuple[str, str] | None:
    """The message's first field of the wrong type, as (the drop reason clean.py counts, the words training's record
    reader refuses it with), or None. Every field's type is checked here, once."""
    for key, (kind, words) in MESSAGE_FIELDS.items():
        value = message.get(key)
        if value is not None and not isinstance(value, kind):
            reason = f"non_{'boolean' if kind is bool else 'string'}_{key}"
            return reason, f"field {key!r} is {type(value).__name__} ({json.dumps(value)[:40]}), not {words}"
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(well_formed_call(c) for c in calls)):
        return "malformed_tool_calls", 'field \'tool_calls\' is not a list of {"function": {"name", "arguments"}}'
    for number, call in enumerate(calls or [], start=1):
        problem = arguments_problem(call["function"]["arguments"])
        if problem:
            return "invalid_tool_arguments", f"tool call {number}: its arguments are {problem}"
    return None


def record_type_problem(record: dict[str, Any]) -> str | None:
    """What is of the wrong type in a record's messages or tools, in words for a one-line error, or None."""
    problem = messages_type_problem(record.get("messages"))
    if problem is None and record.get("tools") is not None:
        problem = tools_problem(record["tools"])
    return problem


def messages_type_problem(messages: Any) -> str | None:
    """What is of the wrong type in a record's messages, in words for a one-line error, or None."""
    if messages is None:
        return None
    if not isinstance(messages, list):
        return f"field 'messages' is {type(messages).__name__}, not a list of messages"
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            return f"message {number} is {type(message).__name__}, not an object"
        problem = field_problem(message)
        if problem:
            return f"message {number}: {problem[1]}"
    return None


def conversation_problem(messages: Any) -> str | None:
    """The drop reason for a list of messages, or None when it is a conversation data.py can train on."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return "malformed_messages"
    roles = [m.get("role") for m in messages]
    if any(role not in ROLES for role in roles):
        return "unknown_role"
    for message in messages:
        problem = field_problem(message)
        if problem:
            return problem[0]
        content = message.get("content")
        if content is not None and not is_text(content):
            return "invalid_unicode"
        if not (content or "").strip() and not (message["role"] == "assistant" and message.get("tool_calls")):
            return "empty_turn"
    for index, role in enumerate(roles):
        in_order = index == 0 if role == "system" else (roles[index - 1] if index else None) in MAY_FOLLOW[role]
        if not in_order:
            return "roles_out_of_order"
    if roles[-1] != "assistant":
        return "last_turn_not_assistant"
    return None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates are given them: each tool call's arguments decoded from their JSON string
    into the object (checked by conversation_problem first)."""
    def decoded(call: dict[str, Any]) -> dict[str, Any]:
        arguments = call["function"]["arguments"]
        if not isinstance(arguments, str):
            return call
        return {**call, "function": {**call["function"], "arguments": json.loads(arguments)}}

    return [{**m, "tool_calls": [decoded(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


# ---------------------------------------------------------------- the shapes clean.py reads

def message(role: str, content: Any, source: dict[str, Any]) -> dict[str, Any]:
    """Our message: role and content first, then the template fields the source has (and `train` unless true, the
    default). A field of the wrong type is kept, for conversation_problem to count."""
    out: dict[str, Any] = {"role": role, "content": "" if content is None and role == "assistant" else content}
    calls = source.get("tool_calls")
    if role == "assistant" and calls is not None and calls != []:
        out["tool_calls"] = [tool_call(call) for call in calls] if isinstance(calls, list) else calls
    if role == "assistant" and source.get("reasoning_content") is not None:
        out["reasoning_content"] = source["reasoning_content"]
    if role == "tool":
        out.update({key: source[key] for key in ("name", "tool_call_id") if source.get(key) is not None})
    if source.get("train") is not None and source["train"] is not True:
        out["train"] = source["train"]
    return out


def tool_call(call: Any) -> Any:
    """OpenAI's tool call, with `arguments` as the JSON string OpenAI sends: an object there would give the dataset
    a column type that differs from line to line."""
    if isinstance(call, dict) and isinstance(call.get("function"), dict) \
            and not isinstance(call["function"].get("arguments"), str):
        call = {**call, "function": {**call["function"], "arguments": json.dumps(call["function"].get("arguments"))}}
    return call


def record_tools(obj: dict[str, Any]) -> list[dict[str, Any]] | str | None:
    """A record's `tools` (None without them), decoded once when a dataset stores them as a JSON string (as
    ShareGPT-style function-calling sets do), or the drop reason: `invalid_tools_json`, `malformed_tools`."""
    tools = obj.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            return "invalid_tools_json"
    if tools is None or tools == []:
        return None
    return "malformed_tools" if tools_problem(tools) else tools


def openai_messages(obj: dict[str, Any]) -> list[dict[str, Any]] | str:
    """`{"messages": [{"role", "content"}, ...]}` -> our messages (OpenAI's roles are ours), or a drop reason."""
    raw = obj["messages"]
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        return "malformed_messages"
    messages = [message(m.get("role"), m.get("content"), m) for m in raw]
    return conversation_problem(messages) or messages


def sharegpt_messages(obj: dict[str, Any]) -> list[dict[str, Any]] | str:
    """`{"conversations": [{"from", "value"}, ...]}` -> our messages (`from` in any case), or a drop reason."""
    raw = obj["conversations"]
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        return "malformed_messages"
    messages = []
    for turn in raw:
        speaker = turn.get("from")
        role = SHAREGPT_ROLES.get(speaker.lower()) if isinstance(speaker, str) else None
        if role is None:
            return "unknown_role"
        messages.append(message(role, turn.get("value"), turn))
    return conversation_problem(messages) or messages


def prompt_completion_messages(obj: dict[str, Any]) -> list[dict[str, Any]] | str:
    """TRL's conversational prompt/completion (two lists of messages; a string is the user's turn, or the assistant's
    answer) -> one conversation, or a drop reason. The prompt's assistant turns are context ("train": false): TRL
    trains the completion only."""
    parts = []
    for name, role in (("prompt", "user"), ("completion", "assistant")):
        value = obj.get(name)
        if value is None:
            return f"missing_{name}"
        if isinstance(value, str):
            parts.append([message(role, value, {})])
        elif isinstance(value, list) and all(isinstance(m, dict) for m in value):
            parts.append([message(m.get("role"), m.get("content"), m) for m in value])
        else:
            return "malformed_messages"
    prompt, completion = parts
    messages = [{**m, "train": False} if m["role"] == "assistant" else m for m in prompt] + completion
    return conversation_problem(messages) or messages


def oasst_threads(tree: dict[str, Any], mode: str) -> Iterator[list[dict[str, Any]] | str]:
    """An OpenAssistant tree as conversations (each a list of messages) and drop reasons.

    `paths`: one conversation per assistant reply that has no assistant reply below it, from the root down to it,
    so every reply lies on some conversation. A reply on several paths is trained in the first (depth first) and is
    `"train": false` context in the others: each reply weighs once, however much the tree branches below it.
    `best`: one conversation per tree, following the best-ranked reply (OpenAssistant's `rank`, 0 best) at every turn.

    A deleted message and everything below it are left out; each conversation that would have ended there is
    dropped as `deleted_message`. A malformed message is dropped once, with everything below it.
    """
    root = tree.get("prompt")
    if not isinstance(root, dict):
        yield "missing_prompt"
        return
    trained_ids: set[int] = set()
    produced = False
    for item in _walk(root, [], False, mode, trained_ids):
        produced = True
        yield item
    if not produced:
        yield "no_threads"


def _well_formed(node: Any) -> bool:
    return isinstance(node, dict) and isinstance(node.get("text"), str) and node.get("role") in OASST_ROLES \
        and isinstance(node.get("replies") or [], list)


def _rank(node: dict[str, Any]) -> float:
    rank = node.get("rank")
    return rank if isinstance(rank, (int, float)) else float("inf")


def _walk(node: Any, path: list[dict[str, Any]], deleted: bool, mode: str, trained_ids: set[int]
          ) -> Iterator[list[dict[str, Any]] | str]:
    """Depth first below `node`; `path` is the thread above it and `deleted` whether a message on it is deleted."""
    if not _well_formed(node):
        yield "malformed_message"
        return
    deleted = deleted or bool(node.get("deleted"))
    path = [*path, node]
    replies = node.get("replies") or []
    if mode == "best":
        usable = [r for r in replies if _well_formed(r) and not r.get("deleted")]
        replies = [min(usable, key=_rank)] if usable else []
    below: list[list[dict[str, Any]] | str] = []
    for reply in replies:
        below.extend(_walk(reply, path, deleted, mode, trained_ids))
    # A reply ends a conversation when no conversation ends below it. Under a deleted message nothing is kept, and a
    # reply there ends what would have been a conversation when no such would-be conversation ends below it.
    ends_below = "deleted_message" in below if deleted else any(isinstance(item, list) for item in below)
    if node["role"] == "assistant" and not ends_below:
        yield "deleted_message" if deleted else _thread(path, trained_ids)
    yield from below


def _thread(path: list[dict[str, Any]], trained_ids: set[int]) -> list[dict[str, Any]]:
    messages = []
    for node in path:
        turn = {"role": OASST_ROLES[node["role"]], "content": node["text"]}
        if turn["role"] == "assistant":
            if id(node) in trained_ids:
                turn["train"] = False
            trained_ids.add(id(node))
        messages.append(turn)
    return messages
