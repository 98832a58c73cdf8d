"""Conversations rendered with the model's own chat template, with labels on the assistant's turns only.

The masking rule: an assistant turn is trained from the end of the template's generation prompt (ChatML's
`<|im_start|>assistant\\n`) through the last special token the template writes in that turn, its end-of-turn token
(ChatML's `<|im_end|>`). That is exactly what a model must generate once inference has written the generation
prompt: the content, anything the template puts between it and the end-of-turn token, and the end-of-turn token
itself. System, user and tool turns, role headers and what follows the end-of-turn token (ChatML's newline) are not
trained. `train_turns: last` trains only the final assistant turn; a message with `"train": false` is never trained.

The input ids are those of the whole rendered conversation, encoded as `apply_chat_template(messages, tools=tools,
tokenize=True, sanitize_control_tokens=True)` encodes it with the special tokens as control tokens: special-token
text a user typed ("<|im_end|>" in a question) stays text, and only the template writes special tokens; an added
token that is not special (Qwen's <think>) is encoded as every inference engine encodes it. The same encoding serves
generation (`encode_for_generation`, and `serve`), so training and inference see the same ids.

Each trained turn k is found turn by turn, from the template's rendering of the prefix that ends at it: its context
is the encoding of `messages[:k]` with the generation prompt, its text what the encoding of `messages[:k + 1]` adds
after that. The turn is trained where the whole conversation holds exactly that context and that text; the whole
rendering is not assumed to extend each prefix's. A template may write a turn differently once more follows it:
Qwen3's drops the reasoning of every turn before the last user message (and writes an empty `<think>` block only in
a last turn), Mistral's moves the tool definitions and the system message to the last user message. Such a turn,
and a turn whose context the template rewrites so, is kept as context: trained, it would teach text in a place
where inference never has the model write it. Where the text is the same but the tokenizer merges across the turn
boundary, the conversation is dropped as `prefix_mismatch` rather than trained on ids inference never produces.
The rule is stated with one encoding per prefix; data/one_render.py gets the same spans from one tokenization of the
conversation and the prefixes' texts, where the tokenizer allows it, and leaves the rest to the prefixes' encodings.

Reasoning (an assistant turn's `reasoning_content`, or the `<think>...</think>` block its content opens with) is
trained as the template renders it, with the turn's answer; with `train_reasoning: false` the tokens that the
reasoning's text occupies are context instead (found as the tokens that change when only the reasoning changes), so
only the template's markers around it, the answer and the end-of-turn token are trained.

A conversation whose tool definitions, tool calls, reasoning or messages of a role other than user and assistant the
template leaves out of its text (SmolLM2's writes only each message's content) would train without them (a tool-call
turn as an empty answer): it is marked `unrendered_<part>`, which data.py refuses in one line rather than drops
(`unrendered_part`), and `serve` answers 400.

An over-long conversation loses whole rounds (a user turn and what answers it) from the start, the system message
kept, until it fits. A last round that alone is too long gives up the start of its context (the tokens before its
first trained turn), as a prompt/response pair gives up its prompt's start, keeping at least half of max_length:
the end of the question stays with the answer. What still does not fit is cut at max_length, and a cut assistant
turn gets no end-of-turn label. (Preference pairs of messages, data/pairs.py, keep both answers' contexts whole
instead: each answer would give up a different share of it.)
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Union

from gpt4all_training.batch import IGNORE
from gpt4all_training.data.conversations import conversation_problem, template_messages, tools_problem, trained
from gpt4all_training.data.one_render import OneRender
from gpt4all_training.errors import UserError

# Private-use characters: transformers marks typed special tokens with two of them and strips any a user typed, so
# text holding one goes the way apply_chat_template's own sanitizing goes.
PRIVATE_USE = "\ue000-\uf8ff\U000f0000-\U000ffffd\U00100000-\U0010fffd"
PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
# The reasoning a content opens with, as Qwen3's, DeepSeek-R1's and SmolLM3's templates and data write it.
THINK_BLOCK = re.compile(r"\s*<think>(.*?)</think>", re.DOTALL)
UNRENDERED = "unrendered_"  # the drop reason's prefix for a conversation the template writes only in part

Messages = list[dict[str, Any]]
Tools = Optional[list[dict[str, Any]]]


@dataclass
class ConversationExample:
    input_ids: list[int]
    labels: list[int]
    dropped_rounds: int  # rounds dropped from the start to fit max_length
    cut_turn: bool  # an assistant turn cut at max_length (it lost its end-of-turn label)
    cut_context: bool = False  # the last round's context lost its start to fit max_length

    @property
    def n_trained(self) -> int:
        return len(self.labels) - self.labels.count(IGNORE)


def conversation_messages(row: dict[str, Any]) -> tuple[Messages, list[bool]] | str:
    """A record's messages as the template reads them (tool-call arguments decoded into objects), and which turns
    are trained; or the drop reason. Keys a dataset column fills with None for the messages that lack them are left
    out, and so is our own `train`.
    """
    raw = row.get("messages")
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        return "malformed_messages"
    present = [{k: v for k, v in m.items() if v is not None} for m in raw]
    problem = conversation_problem(present)
    if problem:
        return problem
    if row.get("tools") is not None and tools_problem(row["tools"]):
        return "malformed_tools"
    return template_messages([{k: v for k, v in m.items() if k != "train"} for m in present]), \
        [trained(m) for m in present]


def conversation_tools(row: dict[str, Any]) -> Tools:
    """The tool definitions a record offers the template, or None."""
    return row.get("tools") or None


def rounds_start(messages: Messages) -> list[int]:
    """Where each round begins: a user turn that does not follow another user turn."""
    return [i for i, m in enumerate(messages) if m["role"] == "user" and (i == 0 or messages[i - 1]["role"] != "user")]


def reasoning_of(message: dict[str, Any]) -> Optional[str]:
    """An assistant turn's reasoning: its `reasoning_content`, else the <think> block its content opens with; None
    when it has none."""
    if message.get("role") != "assistant":
        return None
    if isinstance(message.get("reasoning_content"), str):
        return message["reasoning_content"] or None
    block = THINK_BLOCK.match(message.get("content") or "")
    return block.group(1) if block and block.group(1).strip() else None


def with_reasoning(message: dict[str, Any], reasoning: str) -> dict[str, Any]:
    """The assistant turn with `reasoning` in place of its own (where reasoning_of found it)."""
    if isinstance(message.get("reasoning_content"), str):
        return {**message, "reasoning_content": reasoning}
    block = THINK_BLOCK.match(message["content"])
    assert block is not None  # reasoning_of found the block
    return {**message, "content": message["content"][:block.start(1)] + reasoning + message["content"][block.end(1):]}


def with_marked_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant turn with its reasoning `marked`, to see where the template writes it."""
    reasoning = reasoning_of(message)
    assert reasoning is not None  # asked only of a turn with reasoning
    return with_reasoning(message, marked(reasoning))


def marked(text: str) -> str:
    """`text` with a character before and after its non-blank part that differ from that part's own first and last:
    whatever a template does around a text, the rendering changes at both ends of it, and the whitespace around it
    (which a template may strip or write beside its markers) stays as it was."""
    core = text.strip()
    start = text.index(core)
    return (text[:start] + ("^" if core.startswith("~") else "~") + core + ("^" if core.endswith("~") else "~")
            + text[start + len(core):])


class ChatEncoder:
    """Encodes conversations (and the tools they offer) with a tokenizer's chat template (`apply_chat_template` with
    sanitized control tokens) and labels their assistant turns; `train_reasoning` False keeps reasoning as
    context."""

    def __init__(self, tokenizer, train_reasoning: bool = True):
        require_chat_template(tokenizer)
        self.tokenizer = tokenizer
        self.train_reasoning = train_reasoning
        self.special_ids = frozenset(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
        # The control tokens typed text may not become: the special tokens (and those the tokenizer names). An added
        # token that is not special (Qwen's <think>, <tool_call>) is text the tokenizer makes from plain text, as
        # every inference engine encodes it; transformers, left to itself, would also sanitize those a template's
        # text holds, and that breaks a template that splits a content at them (Qwen3's reasoning).
        named = set(getattr(tokenizer, "chat_control_tokens", None) or ())
        control = sorted((token.content for token in tokenizer.added_tokens_decoder.values()
                          if token.special or token.content in named), key=len, reverse=True)
        self.marked = re.compile("|".join([*map(re.escape, control), f"[{PRIVATE_USE}]"]))
        self.sanitizing = copy.copy(tokenizer)
        self.sanitizing.chat_control_tokens = sorted(named)
        self.one_render: Optional[OneRender] = None  # made on first use: it checks itself against spans_by_prefix

    def typed_control_text(self, value: Any) -> bool:
        """Whether any string in a message holds control-token text (or a private-use character)."""
        if isinstance(value, str):
            return self.marked.search(value) is not None
        if isinstance(value, dict):
            return any(self.typed_control_text(v) for v in value.values())
        if isinstance(value, list):
            return any(self.typed_control_text(v) for v in value)
        return False

    def render(self, messages: Messages, tools: Tools = None, generation_prompt: bool = False) -> Optional[str]:
        """The conversation's text as the template writes it, or None where the template refuses it."""
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                                      tokenize=False)
        except TemplateError:
            return None

    def unrendered_part(self, messages: Messages, tools: Tools = None, reasoning: bool = True) -> Optional[str]:
        """What of the conversation the template leaves out of its text: "tools", "tool_calls", "reasoning" (unless
        `reasoning` is False), or a role other than user and assistant whose messages it does not write ("tool",
        "system"); None when it writes everything (or refuses the conversation, which `encode` reports). Found by
        rendering the conversation again with that part changed: a template that ignores a part writes the same
        text. Reasoning is looked for where a template writes it, at the end of the conversation through the last
        turn that has some, in either form (Qwen3's drops it from every turn before the last user message)."""
        parts: list[tuple[str, Messages, Tools, Messages, Tools]] = []
        if tools:
            parts.append(("tools", messages, tools, messages, [renamed_tool(t) for t in tools]))
        if any(m.get("tool_calls") for m in messages):
            renamed = [{**m, "tool_calls": [renamed_call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
                       for m in messages]
            parts.append(("tool_calls", messages, tools, renamed, tools))
        for field in (True, False):  # the last turn with reasoning_content, the last with a <think> block
            thinking = [k for k, m in enumerate(messages) if reasoning and reasoning_of(m)
                        and isinstance(m.get("reasoning_content"), str) == field]
            if thinking:
                k = thinking[-1]
                changed = with_marked_reasoning(messages[k])
                parts.append(("reasoning", messages[:k + 1], tools, [*messages[:k], changed], tools))
        for role in dict.fromkeys(m["role"] for m in messages):
            if role not in ("user", "assistant"):
                parts.append((role, messages, tools, [{**m, "content": "~" + (m.get("content") or "")}
                                                      if m["role"] == role else m for m in messages], tools))
        for part, original, offered, edited, edited_tools in parts:
            text = self.render(original, offered)
            if text is not None and self.render(edited, edited_tools) == text:
                return part
        return None

    def encode(self, conversations: list[Messages], generation_prompt: list[bool], tools: list[Tools] | None = None
               ) -> list[Optional[list[int]]]:
        """The ids of each conversation (None where the template refuses it), as apply_chat_template(tools=...,
        tokenize=True, sanitize_control_tokens=True) gives them. Conversations without typed control text are
        rendered as text and tokenized in one batch: the same ids, several times faster."""
        from jinja2 import TemplateError

        tools = tools or [None] * len(conversations)
        out: list[Optional[list[int]]] = [None] * len(conversations)
        texts, where = [], []
        for i, (messages, prompt, offered) in enumerate(zip(conversations, generation_prompt, tools)):
            try:
                if self.typed_control_text(messages) or self.typed_control_text(offered):
                    out[i] = self.sanitizing.apply_chat_template(
                        messages, tools=offered, add_generation_prompt=prompt, tokenize=True, return_dict=False,
                        sanitize_control_tokens=True)
                else:
                    texts.append(self.tokenizer.apply_chat_template(messages, tools=offered,
                                                                    add_generation_prompt=prompt, tokenize=False))
                    where.append(i)
            except TemplateError:  # the template's raise_exception: roles it cannot render, say
                continue
        if texts:
            for i, ids in zip(where, self.tokenizer(texts, add_special_tokens=False)["input_ids"]):
                out[i] = ids
        return out

    def turn_spans(self, conversations: list[Messages], trained_flags: list[list[bool]],
                   tools: list[Tools] | None = None) -> list[tuple[list[int], list[tuple[int, int]]] | str]:
        """Per conversation: (its ids, the [start, end) token spans trained), or the drop reason. A trained turn's
        span starts after the generation prompt and ends after the last special token of the turn; a turn the
        template writes differently once more follows it has none (see the module docstring), and with
        train_reasoning False a turn's reasoning splits its span in two. Found from one tokenization of each
        conversation where data/one_render.py can (the same spans), else turn by turn (spans_by_prefix)."""
        tools = tools or [None] * len(conversations)
        if self.one_render is None:
            self.one_render = OneRender(self)
        results = self.one_render.spans(conversations, trained_flags, tools)
        left = [i for i, result in enumerate(results) if result is None]
        if left:
            for i, result in zip(left, self.spans_by_prefix([conversations[i] for i in left],
                                                            [trained_flags[i] for i in left],
                                                            [tools[i] for i in left])):
                results[i] = result
        return results  # type: ignore[return-value]  # every None was filled

    def spans_by_prefix(self, conversations: list[Messages], trained_flags: list[list[bool]],
                        tools: list[Tools] | None = None) -> list[tuple[list[int], list[tuple[int, int]]] | str]:
        """turn_spans' answer from one encoding per prefix: the rule itself (see the module docstring)."""
        tools = tools or [None] * len(conversations)
        requests: list[tuple[Messages, Tools, bool]] = []
        for messages, flags, offered in zip(conversations, trained_flags, tools):
            requests.append((messages, offered, False))
            for k in (k for k, flag in enumerate(flags) if flag):
                requests += [(messages[:k], offered, True), (messages[:k + 1], offered, False)]
                if self.masks_reasoning(messages[k]):
                    changed = with_marked_reasoning(messages[k])
                    requests.append(([*messages[:k], changed, *messages[k + 1:]], offered, False))
        encoded = iter(self.encode([m for m, _, _ in requests], [p for _, _, p in requests],
                                   [t for _, t, _ in requests]))
        results: list[tuple[list[int], list[tuple[int, int]]] | str] = []
        for messages, flags, offered in zip(conversations, trained_flags, tools):
            full = next(encoded)
            turns = [(k, next(encoded), next(encoded), next(encoded) if self.masks_reasoning(messages[k]) else None)
                     for k, flag in enumerate(flags) if flag]
            if full is None or any(ids is None for _, before, through, _ in turns for ids in (before, through)):
                results.append("rejected_by_template")
                continue
            spans: list[tuple[int, int]] = []
            reason = ""
            for k, before, through, changed_ids in turns:
                assert before is not None and through is not None  # checked above
                end = self.turn_end(full, before, through)
                if end is None and full[:len(before)] != before and not self.context_rewritten(messages, offered, k):
                    end = "prefix_mismatch"
                if isinstance(end, str):
                    reason = end
                    break
                if end is not None:
                    spans += reasoning_masked((len(before), end), full, changed_ids)
            results.append(reason or (full, spans))
        return results

    def masks_reasoning(self, message: dict[str, Any]) -> bool:
        return not self.train_reasoning and reasoning_of(message) is not None

    def turn_end(self, full: list[int], before: list[int], through: list[int]) -> Union[int, str, None]:
        """Where the turn that follows `before` ends in `full` (after its last special token); "no_end_of_turn" when
        the template writes none after it; None when `full` does not hold `before` and the turn as `through`
        writes it."""
        start = len(before)
        if full[:start] == before:
            # The turn ends where the conversation through it and the whole conversation part ways (a template may
            # close the last message differently from one that is followed by more).
            common = common_prefix_length(through, full)
            ends = [i for i in range(start, common) if full[i] in self.special_ids]
            if ends:
                return ends[-1] + 1
        if through[:start] == before and not any(token in self.special_ids for token in through[start:]):
            return "no_end_of_turn"
        return None

    def context_rewritten(self, messages: Messages, tools: Tools, k: int) -> bool:
        """Whether the template writes the text before turn k otherwise in the whole conversation than in its
        prompt for turn k (Mistral's moves the tools to the last user message); False where the text is the same
        and only the tokens differ."""
        whole, context = self.render(messages, tools), self.render(messages[:k], tools, generation_prompt=True)
        return whole is None or context is None or not whole.startswith(context)

    def examples(self, conversations: list[Messages], trained_flags: list[list[bool]], max_length: int,
                 drop_first: list[int] | None = None, tools: list[Tools] | None = None, keep_answers: bool = False
                 ) -> list[ConversationExample | str]:
        """Labelled examples of at most max_length tokens, or drop reasons. Over-long conversations lose rounds from
        the start (one encoding per try: long conversations are few) until they fit or one round is left;
        `drop_first` gives, per conversation, how many rounds it loses before the first try. With `keep_answers`, one
        still too long then gives up the start of its context (context_cut) before its answers are cut."""
        results: list[ConversationExample | str] = []
        drop_first = drop_first or [0] * len(conversations)
        tools = tools or [None] * len(conversations)
        first = [without_rounds(m, f, d) for m, f, d in zip(conversations, trained_flags, drop_first)]
        labelled_all = self.turn_spans([m for m, _ in first], [f for _, f in first], tools)
        for messages, flags, offered, labelled, dropped in zip(conversations, trained_flags, tools, labelled_all,
                                                               drop_first):
            starts = rounds_start(messages)
            while not isinstance(labelled, str) and len(labelled[0]) > max_length and dropped + 1 < len(starts):
                dropped += 1
                trimmed, trimmed_flags = without_rounds(messages, flags, dropped)
                [labelled] = self.turn_spans([trimmed], [trimmed_flags], [offered])
            if isinstance(labelled, str):
                results.append(labelled)
                continue
            ids, spans = labelled
            labels = [IGNORE] * len(ids)
            for start, end in spans:
                labels[start:end] = ids[start:end]
            cut = context_cut(len(ids), spans, max_length) if keep_answers else 0
            ids, labels = ids[cut:], labels[cut:]
            labels[0] = IGNORE
            results.append(ConversationExample(ids[:max_length], labels[:max_length], dropped,
                                               any(end - cut > max_length for _, end in spans), cut > 0))
        return results


def context_cut(length: int, spans: list[tuple[int, int]], max_length: int) -> int:
    """How many tokens a conversation of `length` tokens, trained on `spans` (in order), gives up from its start to
    fit max_length: of its context (what precedes the first trained token), as much as the rest needs beyond
    max_length, but never so much that less than half of max_length of the context is left (sft.build_example's rule
    for a prompt)."""
    if length <= max_length or not spans:
        return 0
    context = spans[0][0]
    keep = min(context, max(max_length // 2, max_length - (length - context)))
    return context - keep


def reasoning_masked(span: tuple[int, int], full: list[int], changed: Optional[list[int]]) -> list[tuple[int, int]]:
    """`span` of `full` less the tokens that differ in `changed` (the conversation with the turn's reasoning
    changed): the reasoning's own tokens. The whole span when `changed` is None or differs elsewhere."""
    start, end = span
    if changed is None:
        return [span]
    head = common_prefix_length(full, changed)
    tail = common_prefix_length(full[head:][::-1], changed[head:][::-1])
    first, last = max(start, head), min(end, len(full) - tail)
    if first >= last:
        return [span]
    return [(a, b) for a, b in ((start, first), (last, end)) if a < b]


def renamed_call(call: Any) -> Any:
    """A tool call with another function name, or the call itself when it has no function to rename."""
    if isinstance(call, dict) and isinstance(call.get("function"), dict):
        return {**call, "function": {**call["function"], "name": f"~{call['function'].get('name')}"}}
    return call


def renamed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool definition with another function name (tools_problem has checked it has one)."""
    return {**tool, "function": {**tool["function"], "name": f"~{tool['function']['name']}"}}


PART_WORDS = {"tool_calls": "tool calls", "tools": "tool definitions", "reasoning": "reasoning"}


def unrendered_refusal(part: str, count: int, first: str) -> str:
    """The one line that refuses `count` conversations whose `part` (unrendered_part's) the template leaves out;
    `first` names the first of them."""
    what = PART_WORDS.get(part, f"{part!r} messages")
    return (f"chat_template: it does not render the {what} of {count:,} conversations (first: {first}), so they would "
            f"train without them; use a chat template that renders them (chat_template: path/to/template.jinja) or "
            f"leave them out of the data")


def unrendered_conversations(tokenizer, records) -> tuple[int, Optional[str]]:
    """(how many of `records`, (where, record) pairs, are conversations; the refusal for those the template writes
    only in part, or None). What `check` reads the whole dataset with before anything is tokenized."""
    encoder = ChatEncoder(tokenizer)
    count = 0
    found: Counter[str] = Counter()
    first: dict[str, str] = {}
    for where, record in records:
        if record.get("messages") is None:
            continue
        count += 1
        parsed = conversation_messages(record)
        part = None if isinstance(parsed, str) else encoder.unrendered_part(parsed[0], conversation_tools(record))
        if part:
            found[part] += 1
            first.setdefault(part, where)
    if not found:
        return count, None
    part, n = found.most_common(1)[0]
    return count, unrendered_refusal(part, n, first[part])


def without_rounds(messages: Messages, flags: list[bool], dropped: int) -> tuple[Messages, list[bool]]:
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
    if isinstance(labelled, str) or not labelled[1]:  # no span: the whole conversation rewrites the prompt
        reason = labelled if isinstance(labelled, str) else "prefix_mismatch"
        raise UserError(f"chat_template: cannot train with it ({reason}: an assistant turn must end with a special "
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


def encode_for_generation(tokenizer, conversations: list[Messages], tools: list[Tools] | None = None
                          ) -> list[list[int]]:
    """The ids a model answers from: each conversation (and the tools it offers) with the generation prompt,
    encoded as in training (tool-call arguments still JSON strings decoded, as conversation_messages decodes
    them)."""
    encoded = ChatEncoder(tokenizer).encode([template_messages(m) for m in conversations],
                                            [True] * len(conversations), tools)
    out = []
    for number, ids in enumerate(encoded, 1):
        if ids is None:
            raise UserError(f"chat_template: it refuses conversation {number} (roles it cannot render, such as two "
                            f"user turns in a row); give conversations whose roles it accepts")
        out.append(ids)
    return out


ENCODERS: dict[tuple, tuple[Any, ChatEncoder]] = {}  # this process's encoders, for encoder_for


def encoder_for(tokenizer, train_reasoning: bool) -> ChatEncoder:
    """A ChatEncoder of `tokenizer`, made once per process for the tokenizer as it now is (its object, template and
    vocabulary size): datasets.map calls tokenized_conversations per batch, and an encoder's making (its control
    tokens, data/one_render.py's checks) costs a batch's tenth."""
    key = (id(tokenizer), train_reasoning, tokenizer.chat_template, len(tokenizer))
    held = ENCODERS.get(key)
    if held is None or held[0] is not tokenizer:
        if len(ENCODERS) >= 8:
            ENCODERS.clear()
        held = ENCODERS[key] = (tokenizer, ChatEncoder(tokenizer, train_reasoning))
    return held[1]


def tokenized_conversations(batch: dict[str, list], tokenizer, max_length: int, train_turns: str,
                            train_reasoning: bool = True) -> dict[str, list]:
    """A batched `datasets.map` function over records with `messages` and optional `tools`: the columns
    sft.tokenize_batch adds, for conversations. `truncated_prompt` counts rows that lost rounds or the start of their
    context, `truncated_response` rows whose assistant turn was cut."""
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    encoder = encoder_for(tokenizer, train_reasoning)
    parsed: list[tuple[Messages, list[bool], Tools] | str] = []
    for row in rows:
        item = conversation_messages(row)
        if isinstance(item, str):
            parsed.append(item)
            continue
        tools = conversation_tools(row)
        part = encoder.unrendered_part(item[0], tools)
        parsed.append(UNRENDERED + part if part else (*item, tools))
    usable = [p for p in parsed if not isinstance(p, str)]
    trained_flags = []
    for messages, flags, _ in usable:
        if train_turns == "last":
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            flags = [flag and i == last for i, flag in enumerate(flags)]
        trained_flags.append(flags)
    examples = iter(encoder.examples([m for m, _, _ in usable], trained_flags, max_length,
                                     tools=[t for _, _, t in usable], keep_answers=True))
    out: dict[str, list] = {k: [] for k in ("input_ids", "labels", "n_trained", "length", "truncated_prompt",
                                            "truncated_response", "drop_reason")}
    for entry in parsed:
        example = entry if isinstance(entry, str) else next(examples)
        if isinstance(example, str):
            reason = example
            example = ConversationExample([], [], 0, False)
        else:
            reason = "" if example.n_trained else "no_trained_tokens"
        out["input_ids"].append(example.input_ids)
        out["labels"].append(example.labels)
        out["n_trained"].append(example.n_trained)
        out["length"].append(len(example.input_ids))
        out["truncated_prompt"].append(example.dropped_rounds > 0 or example.cut_context)
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
