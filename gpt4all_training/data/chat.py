"""Conversations rendered with the model's own chat template, with labels on the assistant's turns only.

The masking rule: an assistant turn is trained from the end of the template's generation prompt (ChatML's
`<|im_start|>assistant\\n`) through the last special token the template writes in that turn, its end-of-turn token
(ChatML's `<|im_end|>`). That is exactly what a model must generate once inference has written the generation
prompt: the content, anything the template puts between it and the end-of-turn token, and the end-of-turn token
itself. System, user and tool turns, role headers and what follows the end-of-turn token (ChatML's newline) are not
trained. `train_turns: last` trains only the final assistant turn; a message with `"train": false` is never trained.

The input ids are those of the whole rendered conversation, encoded as `apply_chat_template(messages, tokenize=True,
sanitize_control_tokens=True)` encodes it: special-token text a user typed ("<|im_end|>" in a question) stays text,
and only the template writes special tokens. The same encoding serves generation (`encode_conversations` with the
generation prompt), so training and inference see the same ids: for every trained assistant turn k, the ids before
it are the encoding of `messages[:k]` with the generation prompt. Where a template and tokenizer break that (a turn
boundary that the tokenizer merges across), the conversation is dropped as `prefix_mismatch` rather than trained on
ids inference never produces.

A conversation whose tool calls, or whose messages of a role other than user and assistant, the template leaves out
of its text (SmolLM2's writes only each message's content) would train a tool-call turn as an empty answer: it is
marked `unrendered_<part>`, which data.py refuses in one line rather than drops (`unrendered_part`).

An over-long conversation loses whole rounds (a user turn and what answers it) from the start, the system message
kept, until it fits; only a last round that alone is too long is cut at max_length, and its cut assistant turn gets
no end-of-turn label.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from gpt4all_training.batch import IGNORE
from gpt4all_training.data.conversations import conversation_problem, trained
from gpt4all_training.errors import UserError

# Private-use characters: transformers marks typed special tokens with two of them and strips any a user typed, so
# text holding one goes the way apply_chat_template's own sanitizing goes.
PRIVATE_USE = "\ue000-\uf8ff\U000f0000-\U000ffffd\U00100000-\U0010fffd"
PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


@dataclass
class ConversationExample:
    input_ids: list[int]
    labels: list[int]
    dropped_rounds: int  # rounds dropped from the start to fit max_length
    cut_turn: bool  # an assistant turn cut at max_length (it lost its end-of-turn label)

    @property
    def n_trained(self) -> int:
        return sum(label != IGNORE for label in self.labels)


def conversation_messages(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[bool]] | str:
    """A record's messages as the template reads them, and which turns are trained; or the drop reason.

    A prompt/response record (a dataset may mix both) is a user turn and an assistant turn. Keys a dataset column
    fills with None for the messages that lack them are left out, and so is our own `train`.
    """
    raw = row.get("messages")
    if raw is None:
        raw = [{"role": "user", "content": row.get("prompt")}, {"role": "assistant", "content": row.get("response")}]
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        return "malformed_messages"
    present = [{k: v for k, v in m.items() if v is not None} for m in raw]
    problem = conversation_problem(present)
    if problem:
        return problem
    return [{k: v for k, v in m.items() if k != "train"} for m in present], [trained(m) for m in present]


def rounds_start(messages: list[dict[str, Any]]) -> list[int]:
    """Where each round begins: a user turn that does not follow another user turn."""
    return [i for i, m in enumerate(messages) if m["role"] == "user" and (i == 0 or messages[i - 1]["role"] != "user")]


class ChatEncoder:
    """Encodes conversations with a tokenizer's chat template (`apply_chat_template` with sanitized control tokens)
    and labels their assistant turns."""

    def __init__(self, tokenizer):
        require_chat_template(tokenizer)
        self.tokenizer = tokenizer
        self.special_ids = frozenset(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
        added = sorted(tokenizer.added_tokens_encoder, key=len, reverse=True)
        self.marked = re.compile("|".join([*map(re.escape, added), f"[{PRIVATE_USE}]"]))

    def typed_control_text(self, value: Any) -> bool:
        """Whether any string in a message holds added-token text (or a private-use character)."""
        if isinstance(value, str):
            return self.marked.search(value) is not None
        if isinstance(value, dict):
            return any(self.typed_control_text(v) for v in value.values())
        if isinstance(value, list):
            return any(self.typed_control_text(v) for v in value)
        return False

    def render(self, messages: list[dict[str, Any]]) -> Optional[str]:
        """The conversation's text as the template writes it, or None where the template refuses it."""
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        except TemplateError:
            return None

    def unrendered_part(self, messages: list[dict[str, Any]]) -> Optional[str]:
        """What of the conversation the template leaves out of its text: "tool_calls", or a role other than user
        and assistant whose messages it does not write ("tool", "system"); None when it writes everything (or
        refuses the conversation, which `encode` reports). Found by rendering the conversation again with that part
        changed: a template that ignores a part writes the same text."""
        parts = []
        if any(m.get("tool_calls") for m in messages):
            parts.append(("tool_calls", [{**m, "tool_calls": [renamed_call(c) for c in m["tool_calls"]]}
                                         if m.get("tool_calls") else m for m in messages]))
        for role in dict.fromkeys(m["role"] for m in messages):
            if role not in ("user", "assistant"):
                parts.append((role, [{**m, "content": "~" + (m.get("content") or "")} if m["role"] == role else m
                                     for m in messages]))
        if not parts:
            return None
        text = self.render(messages)
        return next((part for part, changed in parts if text is not None and self.render(changed) == text), None)

    def encode(self, conversations: list[list[dict[str, Any]]], generation_prompt: list[bool]
               ) -> list[Optional[list[int]]]:
        """The ids of each conversation (None where the template refuses it), as apply_chat_template(tokenize=True,
        sanitize_control_tokens=True) gives them. Conversations without typed control text are rendered as text and
        tokenized in one batch: the same ids, several times faster."""
        from jinja2 import TemplateError

        out: list[Optional[list[int]]] = [None] * len(conversations)
        texts, where = [], []
        for i, (messages, prompt) in enumerate(zip(conversations, generation_prompt)):
            try:
                if self.typed_control_text(messages):
                    out[i] = self.tokenizer.apply_chat_template(
                        messages, add_generation_prompt=prompt, tokenize=True, return_dict=False,
                        sanitize_control_tokens=True)
                else:
                    texts.append(self.tokenizer.apply_chat_template(messages, add_generation_prompt=prompt,
                                                                    tokenize=False))
                    where.append(i)
            except TemplateError:  # the template's raise_exception: roles it cannot render, say
                continue
        if texts:
            for i, ids in zip(where, self.tokenizer(texts, add_special_tokens=False)["input_ids"]):
                out[i] = ids
        return out

    def turn_spans(self, conversations: list[list[dict[str, Any]]], trained_flags: list[list[bool]]
                   ) -> list[tuple[list[int], list[tuple[int, int]]] | str]:
        """Per conversation: (its ids, the [start, end) token span of each trained assistant turn), or the drop
        reason. A span starts after the generation prompt and ends after the last special token of the turn."""
        requests: list[tuple[list[dict[str, Any]], bool]] = []
        for messages, flags in zip(conversations, trained_flags):
            requests.append((messages, False))
            for k in (k for k, flag in enumerate(flags) if flag):
                requests += [(messages[:k], True), (messages[:k + 1], False)]
        encoded = iter(self.encode([m for m, _ in requests], [p for _, p in requests]))
        results: list[tuple[list[int], list[tuple[int, int]]] | str] = []
        for flags in trained_flags:
            full = next(encoded)
            parts = [(next(encoded), next(encoded)) for _ in range(sum(flags))]
            if full is None or any(p is None for pair in parts for p in pair):
                results.append("rejected_by_template")
                continue
            spans: list[tuple[int, int]] = []
            reason = ""
            for before, through in parts:
                if full[:len(before)] != before:
                    reason = "prefix_mismatch"
                    break
                # The turn ends where the conversation through it and the whole conversation part ways (a
                # template may close the last message differently from one that is followed by more).
                end = common_prefix_length(through, full)
                ends = [i for i in range(len(before), end) if full[i] in self.special_ids]
                if not ends:
                    reason = "no_end_of_turn"
                    break
                spans.append((len(before), ends[-1] + 1))
            results.append(reason or (full, spans))
        return results

    def examples(self, conversations: list[list[dict[str, Any]]], trained_flags: list[list[bool]],
                 max_length: int, drop_first: list[int] | None = None) -> list[ConversationExample | str]:
        """Labelled examples of at most max_length tokens, or drop reasons. Over-long conversations lose rounds from
        the start (one encoding per try: long conversations are few) until they fit or one round is left;
        `drop_first` gives, per conversation, how many rounds it loses before the first try."""
        results: list[ConversationExample | str] = []
        drop_first = drop_first or [0] * len(conversations)
        first = [without_rounds(m, f, d) for m, f, d in zip(conversations, trained_flags, drop_first)]
        labelled_all = self.turn_spans([m for m, _ in first], [f for _, f in first])
        for messages, flags, labelled, dropped in zip(conversations, trained_flags, labelled_all, drop_first):
            starts = rounds_start(messages)
            while not isinstance(labelled, str) and len(labelled[0]) > max_length and dropped + 1 < len(starts):
                dropped += 1
                trimmed, trimmed_flags = without_rounds(messages, flags, dropped)
                [labelled] = self.turn_spans([trimmed], [trimmed_flags])
            if isinstance(labelled, str):
                results.append(labelled)
                continue
            ids, spans = labelled
            labels = [IGNORE] * len(ids)
            for start, end in spans:
                labels[start:end] = ids[start:end]
            labels[0] = IGNORE
            results.append(ConversationExample(ids[:max_length], labels[:max_length], dropped,
                                               any(end > max_length for _, end in spans)))
        return results


def renamed_call(call: Any) -> Any:
    """A tool call with another function name, or the call itself when it has no function to rename."""
    if isinstance(call, dict) and isinstance(call.get("function"), dict):
        return {**call, "function": {**call["function"], "name": f"~{call['function'].get('name')}"}}
    return call


UNRENDERED = "unrendered_"  # the drop reason's prefix for a conversation the template writes only in part


def unrendered_refusal(part: str, count: int, first: str) -> str:
    """The one line that refuses `count` conversations whose `part` (unrendered_part's) the template leaves out;
    `first` names the first of them."""
    what = "tool calls" if part == "tool_calls" else f"{part!r} messages"
    return (f"chat_template: it does not render the {what} of {count:,} conversations (first: {first}), so they would "
            f"train without them; use a chat template that renders them (chat_template: path/to/template.jinja) or "
            f"leave them out of the data")


def unrendered_conversations(tokenizer, records) -> tuple[int, Optional[str]]:
    """(how many of `records`, (where, record) pairs, are conversations; the refusal for those the template writes
    only in part, or None). What `check` reads the whole dataset with before anything is tokenized."""
    encoder = ChatEncoder(tokenizer)
    count, found, first = 0, Counter(), {}
    for where, record in records:
        if record.get("messages") is None:
            continue
        count += 1
        parsed = conversation_messages(record)
        part = None if isinstance(parsed, str) else encoder.unrendered_part(parsed[0])
        if part:
            found[part] += 1
            first.setdefault(part, where)
    if not found:
        return count, None
    part, n = found.most_common(1)[0]
    return count, unrendered_refusal(part, n, first[part])


def without_rounds(messages: list[dict[str, Any]], flags: list[bool], dropped: int
                   ) -> tuple[list[dict[str, Any]], list[bool]]:
    """The conversation and its trained flags less the first `dropped` rounds (the system message kept)."""
    if not dropped:
        return messages, flags
    starts = rounds_start(messages)
    keep = list(range(starts[0])) + list(range(starts[dropped], len(messages)))
    return [messages[i] for i in keep], [flags[i] for i in keep]


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("chat_template: the tokenizer has no chat template to render conversations with; set "
                        "chat_template to a Jinja file or to 'chatml'")


def end_of_turn_id(tokenizer) -> int:
    """The special token that closes an assistant turn in the tokenizer's chat template (ChatML: <|im_end|>)."""
    labelled = ChatEncoder(tokenizer).turn_spans([PROBE], [[False, True]])[0]
    if isinstance(labelled, str):
        raise UserError(f"chat_template: cannot train with it ({labelled}: an assistant turn must end with a special "
                        f"token the template writes, and the conversation up to it must be the generation prompt's "
                        f"ids); use a template that does")
    ids, [(_, end)] = labelled
    return ids[end - 1]


def require_trainable_chat(tokenizer, template: str, what: str) -> None:
    """Data with messages can be trained with this tokenizer and prompt_template, or one UserError says why (before
    tokenizing, so a template that cannot be trained with is one error, not a drop per row); `what` names the data."""
    if template == "plain" and getattr(tokenizer, "chat_template", None):
        raise UserError(f"prompt_template: 'plain' cannot write {what} (the data has messages); use 'chat' or 'auto'")
    end_of_turn_id(tokenizer)


def encode_for_generation(tokenizer, conversations: list[list[dict[str, Any]]]) -> list[list[int]]:
    """The ids a model answers from: each conversation with the generation prompt, encoded as in training."""
    encoded = ChatEncoder(tokenizer).encode(conversations, [True] * len(conversations))
    for number, ids in enumerate(encoded, 1):
        if ids is None:
            raise UserError(f"chat_template: it refuses conversation {number} (roles it cannot render, such as two "
                            f"user turns in a row); give conversations whose roles it accepts")
    return encoded


def tokenized_conversations(batch: dict[str, list], tokenizer, max_length: int, train_turns: str
                            ) -> dict[str, list]:
    """A batched `datasets.map` function over records with `messages` (or prompt/response): the columns
    sft.tokenize_batch adds, for conversations. `truncated_prompt` counts rows that lost rounds from the start,
    `truncated_response` rows whose assistant turn was cut."""
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    encoder = ChatEncoder(tokenizer)
    parsed = []
    for row in rows:
        item = conversation_messages(row)
        part = None if isinstance(item, str) else encoder.unrendered_part(item[0])
        parsed.append(UNRENDERED + part if part else item)
    usable = [p for p in parsed if not isinstance(p, str)]
    trained_flags = []
    for messages, flags in usable:
        if train_turns == "last":
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            flags = [flag and i == last for i, flag in enumerate(flags)]
        trained_flags.append(flags)
    examples = iter(encoder.examples([m for m, _ in usable], trained_flags, max_length))
    out: dict[str, list] = {k: [] for k in ("input_ids", "labels", "n_trained", "length", "truncated_prompt",
                                            "truncated_response", "drop_reason")}
    for item in parsed:
        example = item if isinstance(item, str) else next(examples)
        if isinstance(example, str):
            example, reason = ConversationExample([], [], 0, False), example
        else:
            reason = "" if example.n_trained else "no_trained_tokens"
        out["input_ids"].append(example.input_ids)
        out["labels"].append(example.labels)
        out["n_trained"].append(example.n_trained)
        out["length"].append(len(example.input_ids))
        out["truncated_prompt"].append(example.dropped_rounds > 0)
        out["truncated_response"].append(example.cut_turn)
        out["drop_reason"].append(reason)
    return out


def conversation_text(messages: list[dict[str, Any]]) -> tuple[str, str]:
    """(the turns before the last assistant turn, one "role: content" line each; the last assistant turn): the
    prompt and response a map shows for a conversation."""
    last = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    before = "\n".join(f"{m.get('role')}: {m.get('content') or ''}" for m in messages[:last])
    return before, messages[last].get("content") or ""


def with_conversation_text(ds):
    """`ds` with prompt and response text for its conversation rows (conversation_text); prompt/response rows of a
    mixed dataset keep theirs."""
    def fill(batch: dict[str, list]) -> dict[str, list]:
        n = len(batch["messages"])
        prompts, responses = batch.get("prompt", [None] * n), batch.get("response", [None] * n)
        texts = [conversation_text(m) if m else (p, r) for m, p, r in zip(batch["messages"], prompts, responses)]
        return {"prompt": [p for p, _ in texts], "response": [r for _, r in texts]}

    return ds.map(fill, batched=True, desc="conversation text")
