"""The trained spans of conversations from one tokenization of each, giving what data/chat.py's turn-by-turn
rule gives (`ChatEncoder.spans_by_prefix`) without encoding every prefix.

The rule reads three encodings per trained turn k: the whole conversation's (`full`), that of messages[:k] with
the generation prompt (`before`), and that of messages[:k + 1] (`through`). The turn is trained from len(before),
where full begins with before, through the last special token of full before full and through part ways. Encoding
the prefixes costs several times the conversation's own encoding; here each prefix is rendered as text (cheap) and
only the whole conversation is tokenized, with the character offsets of its tokens.

What makes that exact: a fast tokenizer first splits the text at its added tokens (leftmost-longest) and encodes the
pieces between them each on its own. So where a text holds a special token at character s, its ids are the ids of
text[:s] followed by those of text[s:]; and two texts that agree up to character c split alike before any special
token of either that ends by c. Hence a prefix's ids are the whole conversation's ids up to the last special token
that ends where the two texts still agree, followed by the ids of the prefix's text from that token on, which is
short (`<|im_start|>assistant\n`, `<|im_end|>\n`) and repeats from conversation to conversation, so its encoding is
cached. With `before` and `through` so composed, the rule itself (`ChatEncoder.turn_end`) decides each turn.

That argument needs an added-token split that depends on nothing but the tokens' own characters: `usable` is False,
and every conversation goes turn by turn, for a slow tokenizer, for added tokens that strip the whitespace beside
them or match single words only, for special tokens matched after normalization, and for added tokens that can
overlap each other (one holding the start of another), which could make a longer match across the point where two
texts part. A conversation whose text holds typed control tokens (encoded apart), whose reasoning is masked (which
needs another encoding), or where no special token ends before a prefix's text and the whole's part, is left to the
turn-by-turn rule: `spans` gives None for it. Each encoder also checks a few conversations against that rule
(`agrees`) and, on any difference, leaves every conversation to it.
"""

from __future__ import annotations

from typing import Any, Optional

Messages = list[dict[str, Any]]
Tools = Optional[list[dict[str, Any]]]
Spans = tuple[list[int], list[tuple[int, int]]]
TAIL_CACHE = 4096  # texts of prefixes' ends whose ids are kept; they repeat from conversation to conversation
TAIL_CHARS = 256  # longer ones (a context the template rewrites) rarely repeat
CHECKS = (  # conversations every encoder checks against the turn-by-turn rule before it relies on one tokenization
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " 2 + 2?\n"},
     {"role": "assistant", "content": "\n4."}, {"role": "user", "content": "Why"},
     {"role": "assistant", "content": " Because."}],
)


def overlapping(contents: list[str]) -> bool:
    """Whether any of the strings holds another one past its own start, or ends with the start of one: the only ways
    a leftmost-longest match of one could cover the place where another begins."""
    present = set(contents)
    starts = {text[:i] for text in contents for i in range(1, len(text))}
    for text in contents:
        for i in range(len(text)):
            if i and text[i:] in starts:
                return True
            if any(text[i:j] in present for j in range(i + 1, len(text) + 1) if (i, j) != (0, len(text))):
                return True
    return False


def usable_tokenizer(tokenizer) -> bool:
    """Whether the tokenizer splits text at its added tokens in the way the module docstring relies on."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return False
    added = list(tokenizer.added_tokens_decoder.values())
    if any(token.lstrip or token.rstrip or token.single_word or (token.special and token.normalized)
           for token in added):
        return False
    return not overlapping([token.content for token in added])


def common_length(a: str, b: str) -> int:
    """The length of the longest common prefix of two strings, by halving (slices compare in C)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class OneRender:
    """Spans by one tokenization per conversation for `encoder` (a data/chat.py ChatEncoder: its tokenizer,
    special_ids, render and typed_control_text, and spans_by_prefix for the check)."""

    def __init__(self, encoder) -> None:
        self.encoder = encoder
        self.tokenizer = encoder.tokenizer
        self.tails: dict[str, list[int]] = {}
        self.usable = usable_tokenizer(self.tokenizer)
        if self.usable:
            flags = [[m["role"] == "assistant" for m in messages] for messages in CHECKS]
            self.usable = self.agrees(list(CHECKS), flags)

    def agrees(self, conversations: list[Messages], trained_flags: list[list[bool]]) -> bool:
        """Whether every conversation this decides gets what the turn-by-turn rule gives it."""
        fast = self.decide(conversations, trained_flags, [None] * len(conversations))
        slow = self.encoder.spans_by_prefix(conversations, trained_flags, [None] * len(conversations))
        return all(f is None or f == s for f, s in zip(fast, slow))

    def spans(self, conversations: list[Messages], trained_flags: list[list[bool]], tools: list[Tools]
              ) -> list[Spans | str | None]:
        """Per conversation: what spans_by_prefix gives it, or None where this cannot decide it."""
        if not self.usable:
            return [None] * len(conversations)
        return self.decide(conversations, trained_flags, tools)

    def decide(self, conversations: list[Messages], trained_flags: list[list[bool]], tools: list[Tools]
               ) -> list[Spans | str | None]:
        encoder = self.encoder
        results: list[Spans | str | None] = [None] * len(conversations)
        todo = [i for i, (messages, flags, offered) in enumerate(zip(conversations, trained_flags, tools))
                if not any(encoder.masks_reasoning(m) for m, flag in zip(messages, flags) if flag)
                and not encoder.typed_control_text(messages) and not encoder.typed_control_text(offered)]
        wholes = self.render([(conversations[i], tools[i], False) for i in todo])
        prefixes: list[tuple[Messages, Tools, bool]] = []
        for i in todo:
            for k, flag in enumerate(trained_flags[i]):
                if flag:
                    prefixes.append((conversations[i][:k], tools[i], True))
                    if k + 1 < len(conversations[i]):  # the last turn's text through it is the whole text
                        prefixes.append((conversations[i][:k + 1], tools[i], False))
        texts = iter(self.render(prefixes))
        rendered = [i for i, whole in zip(todo, wholes) if whole is not None]
        # The tokenizer's own call (it clears any padding or truncation a former call left in the backend); the
        # offsets are read for the few special tokens only, from each Encoding.
        batch = self.tokenizer([whole for whole in wholes if whole is not None], add_special_tokens=False) \
            if rendered else None
        encoded = dict(zip(rendered, zip(batch["input_ids"], batch.encodings))) if batch is not None else {}
        for i, whole in zip(todo, wholes):
            turns: list[tuple[Optional[str], Optional[str]]] = []
            for k, flag in enumerate(trained_flags[i]):
                if flag:
                    context = next(texts)
                    turns.append((context, next(texts) if k + 1 < len(conversations[i]) else whole))
            rendered_turns = [(context, through) for context, through in turns
                              if context is not None and through is not None]
            if whole is None or len(rendered_turns) < len(turns):
                results[i] = "rejected_by_template"
                continue
            ids, encoding = encoded[i]
            results[i] = self.turns(whole, ids, encoding, rendered_turns)
        return results

    def render(self, requests: list[tuple[Messages, Tools, bool]]) -> list[Optional[str]]:
        """The text of each (messages, tools, generation prompt), None where the template refuses it: the requests
        without tools in one call per generation-prompt setting, the rest one by one."""
        from jinja2 import TemplateError

        out: list[Optional[str]] = [None] * len(requests)
        for prompt in (False, True):
            batch = [i for i, (_, offered, flag) in enumerate(requests) if offered is None and flag == prompt]
            if not batch:
                continue
            try:
                texts = self.tokenizer.apply_chat_template([requests[i][0] for i in batch],
                                                           add_generation_prompt=prompt, tokenize=False)
            except TemplateError:  # one conversation refused: find which, one by one
                texts = [self.encoder.render(requests[i][0], None, prompt) for i in batch]
            for i, text in zip(batch, texts):
                out[i] = text
        for i, (messages, offered, prompt) in enumerate(requests):
            if offered is not None:
                out[i] = self.encoder.render(messages, offered, prompt)
        return out

    def tail_ids(self, text: str) -> list[int]:
        ids = self.tails.get(text)
        if ids is None:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(self.tails) < TAIL_CACHE and len(text) <= TAIL_CHARS:
                self.tails[text] = ids
        return ids

    def composed(self, whole: str, ids: list[int], specials: list[tuple[int, int, int]], text: str
                 ) -> Optional[list[int]]:
        """The ids of `text` (a prefix's rendering), from those of the whole conversation: its ids up to the last
        special token that ends where the two texts still agree, then the encoding of `text` from that token on.
        None when no special token ends there."""
        shared = common_length(text, whole)
        found = next(((t, start) for t, start, end in reversed(specials) if end <= shared), None)
        if found is None:
            return None
        return ids[:found[0]] + self.tail_ids(text[found[1]:])

    def turns(self, whole: str, ids: list[int], encoding, turns: list[tuple[str, str]]) -> Spans | str | None:
        """The spans of one conversation (its text, ids and Encoding) from the (context, through) texts of its
        trained turns: spans_by_prefix's rule, applied to prefixes' ids composed from the whole's."""
        encoder = self.encoder
        special_ids = encoder.special_ids
        specials = [(t, *encoding.token_to_chars(t)) for t, token in enumerate(ids) if token in special_ids]
        spans: list[tuple[int, int]] = []
        for context, through in turns:
            before = self.composed(whole, ids, specials, context)
            after = self.composed(whole, ids, specials, through)
            if before is None or after is None:
                return None
            end = encoder.turn_end(ids, before, after)
            if end is None and ids[:len(before)] != before and whole.startswith(context):
                end = "prefix_mismatch"  # the same text, other tokens (context_rewritten is False)
            if isinstance(end, str):
                return end
            if end is not None:
                spans.append((len(before), end))
        return ids, spans
