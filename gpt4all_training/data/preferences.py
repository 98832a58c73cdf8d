"""Preference pairs: one prompt and two answers to it, the chosen one preferred to the rejected one.

A cleaned preference record is `{"prompt", "chosen", "rejected", "source"}` in one of two shapes:
- text: the three are strings (the answers are what follows the prompt, as a response does in sft);
- messages: the prompt is a list of messages ending with a user turn, and each answer a list of messages that starts
  with an assistant turn (usually that turn alone), rendered through the chat template as conversations are.

Read from (`preference_record`): those shapes themselves (TRL's, with the prompt as a string or as messages);
conversations without a prompt field (TRL's implicit prompt, and UltraFeedback-binarized, whose `chosen` and
`rejected` are whole conversations beside a `prompt` string), where the messages the two share from the start are the
prompt; HH-RLHF transcripts (`"\\n\\nHuman: ...\\n\\nAssistant: ..."`), parsed into messages and split the same way;
and OpenAssistant trees, where the best-ranked reply to a prompt is preferred to each lower-ranked sibling
(`oasst_preferences`). Nothing here raises for bad data: a parser returns the record or the drop reason, which
clean.py counts.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from gpt4all_training.data.conversations import (OASST_ROLES, conversation_problem, is_text, message,
                                                 normalize_whitespace)

ANSWERS = ("chosen", "rejected")
PAIR_FIELDS = ("prompt", *ANSWERS)
HH_TURN = re.compile(r"\n\n(Human|Assistant): ?")
HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def is_preference(obj: dict[str, Any]) -> bool:
    """Whether a raw record holds a preference pair (it has a chosen or a rejected answer)."""
    return any(name in obj for name in ANSWERS)


# ---------------------------------------------------------------- checking a cleaned record

def answer_text(answer: str | list[dict[str, Any]]) -> str:
    """What an answer says: the text, or its assistant turns joined."""
    if isinstance(answer, str):
        return answer
    return "\n".join(m.get("content") or "" for m in answer if m.get("role") == "assistant")


def pair_problem(prompt: Any, chosen: Any, rejected: Any) -> str | None:
    """The drop reason for a pair in one of the two cleaned shapes, or None when it can be trained on."""
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        if not all(is_text(v) for v in (prompt, chosen, rejected)):
            return "invalid_unicode"
        if not prompt.strip():
            return "missing_prompt"
    elif all(isinstance(v, list) for v in (prompt, chosen, rejected)):
        if not prompt or not isinstance(prompt[-1], dict) or prompt[-1].get("role") != "user":
            return "missing_prompt"
        for answer in (chosen, rejected):
            if not answer or not isinstance(answer[0], dict) or answer[0].get("role") != "assistant":
                return "answer_not_assistant"
            problem = conversation_problem([*prompt, *answer])
            if problem == "empty_turn" and not answer_text(answer).strip():
                return "empty_answer"
            if problem:
                return problem
    else:
        return "mixed_shapes"
    if not answer_text(chosen).strip() or not answer_text(rejected).strip():
        return "empty_answer"
    if normalized(chosen) == normalized(rejected):
        return "identical_answers"
    return None


def normalized(value: str | list[dict[str, Any]]) -> Any:
    """A prompt or answer with its whitespace normalized: what duplicates and identical answers are compared by."""
    if isinstance(value, str):
        return normalize_whitespace(value)
    return tuple((m.get("role"), normalize_whitespace(m.get("content") or "")) for m in value)


def record_problem(record: dict[str, Any]) -> str | None:
    """What is wrong with a record training reads, in words for a one-line error, or None. Only the fields and their
    types: pairs that are well formed but untrainable are dropped and counted when they are tokenized."""
    for name in PAIR_FIELDS:
        if name not in record:
            present = ", ".join(map(str, record)) or "none"
            return f"no {name!r} field (fields: {present}); run clean.py on the raw preference data first"
    kinds = {name: type(record[name]).__name__ for name in PAIR_FIELDS}
    for name in PAIR_FIELDS:
        if not isinstance(record[name], (str, list)):
            return f"field {name!r} is {kinds[name]}, not text or a list of messages"
    if len({isinstance(record[name], str) for name in PAIR_FIELDS}) > 1:
        described = ", ".join(f"{name} {kind}" for name, kind in kinds.items())
        return f"prompt, chosen and rejected must all be text or all be lists of messages ({described})"
    return None


# ---------------------------------------------------------------- the shapes clean.py reads

def preference_record(obj: dict[str, Any], source: str) -> dict[str, Any] | str:
    """A raw record with chosen/rejected answers -> a cleaned preference record, or the drop reason."""
    chosen, rejected, prompt = obj.get("chosen"), obj.get("rejected"), obj.get("prompt")
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None:
            return f"missing_{name}"
        if not isinstance(value, (str, list)):
            return f"non_string_{name}"
    pair: tuple[Any, Any, Any] | str
    if isinstance(chosen, str) and isinstance(rejected, str) and isinstance(prompt, str):
        pair = (prompt, chosen, rejected)
    else:
        pair = message_pair(prompt, chosen, rejected)
        if isinstance(pair, str):
            return pair
    problem = pair_problem(*pair)
    if problem:
        return problem
    return {"prompt": pair[0], "chosen": pair[1], "rejected": pair[2], "source": source}


def message_pair(prompt: Any, chosen: Any, rejected: Any) -> tuple[list, list, list] | str:
    """(prompt, chosen, rejected) as messages: answers that are whole conversations (or HH-RLHF transcripts) are
    split where they part, the shared turns becoming the prompt (a given prompt is then the first of them, as in
    UltraFeedback-binarized); answers that start with the assistant's turn keep the given prompt (a string is the
    user's turn)."""
    answers = []
    for value in (chosen, rejected):
        parsed = transcript_messages(value) if isinstance(value, str) and prompt is None else as_messages(value)
        if isinstance(parsed, str):
            return parsed
        answers.append(parsed)
    starts = {bool(answer) and answer[0]["role"] == "assistant" for answer in answers}
    if starts == {False}:  # whole conversations
        return split_shared_prefix(*answers)
    if starts != {True}:
        return "answer_not_assistant"
    chosen, rejected = answers
    if isinstance(prompt, str):
        return [message("user", prompt, {})], chosen, rejected
    if prompt is None:
        return "missing_prompt"
    prompt = as_messages(prompt)
    return prompt if isinstance(prompt, str) else (prompt, chosen, rejected)


def as_messages(value: Any) -> list[dict[str, Any]] | str:
    """A string answer as the assistant's turn, a list as our messages; or the drop reason."""
    if isinstance(value, str):
        return [message("assistant", value, {})]
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        return "malformed_messages"
    return [message(m.get("role"), m.get("content"), m) for m in value]


def transcript_messages(text: str) -> list[dict[str, Any]] | str:
    """An HH-RLHF transcript ("\\n\\nHuman: ...\\n\\nAssistant: ...") as messages, or the drop reason: text with no
    turns marked is an answer without its prompt."""
    parts = HH_TURN.split(text)
    if len(parts) < 3:  # no turns marked: an answer without its prompt
        return "missing_prompt"
    if parts[0].strip():
        return "malformed_transcript"
    return [message(HH_ROLES[role], content, {}) for role, content in zip(parts[1::2], parts[2::2])]


def split_shared_prefix(chosen: list[dict[str, Any]], rejected: list[dict[str, Any]]
                        ) -> tuple[list, list, list] | str:
    """The turns the two conversations share from the start, up to the last user turn among them, are the prompt;
    what follows in each is its answer."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and normalized([chosen[shared]]) == normalized([rejected[shared]]):
        shared += 1
    if shared == len(chosen) == len(rejected):
        return "identical_answers"
    users = [i for i in range(shared) if chosen[i]["role"] == "user"]
    if not users:
        return "missing_prompt"
    cut = users[-1] + 1
    return chosen[:cut], chosen[cut:], rejected[cut:]


def oasst_preferences(tree: dict[str, Any]) -> Iterator[dict[str, Any] | str]:
    """An OpenAssistant tree as preference records and drop reasons: under every prompter message whose assistant
    replies carry ranks (`rank`, 0 best), the best-ranked reply is preferred to each other ranked reply, with the
    thread down to the prompter message as the prompt. Deleted and malformed replies are not ranked; a pair under a
    deleted message is dropped as `deleted_message`."""
    root = tree.get("prompt")
    if not isinstance(root, dict):
        yield "missing_prompt"
        return
    produced = False
    stack: list[tuple[Any, list[dict[str, Any]], bool]] = [(root, [], False)]
    while stack:
        node, thread, deleted = stack.pop()
        if not (isinstance(node, dict) and isinstance(node.get("text"), str) and node.get("role") in OASST_ROLES
                and isinstance(node.get("replies") or [], list)):
            yield "malformed_message"
            produced = True
            continue
        deleted = deleted or bool(node.get("deleted"))
        thread = [*thread, message(OASST_ROLES[node["role"]], node["text"], {})]
        replies = node.get("replies") or []
        if node["role"] == "prompter":
            ranked = sorted((r for r in replies if isinstance(r, dict) and isinstance(r.get("text"), str)
                             and r.get("role") == "assistant" and not r.get("deleted")
                             and isinstance(r.get("rank"), int)), key=lambda r: r["rank"])
            for worse in ranked[1:]:
                produced = True
                if deleted:
                    yield "deleted_message"
                    continue
                record = preference_record({"prompt": thread, "chosen": [{"role": "assistant",
                                                                            "content": ranked[0]["text"]}],
                                            "rejected": [{"role": "assistant", "content": worse["text"]}]}, "oasst")
                yield record
        stack.extend((reply, thread, deleted) for reply in reversed(replies))
    if not produced:
        yield "no_ranked_replies"
