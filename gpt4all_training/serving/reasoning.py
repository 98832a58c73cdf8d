"""A reply's reasoning apart from its answer, as OpenAI-compatible servers return it (vLLM's reasoning parsers):
`reasoning_content` is the text of the `<think>...</think>` block a reply opens with (or that the chat template's
generation prompt opened, as Qwen3 Thinking-2507's and DeepSeek-R1's do), `content` what follows it. A reply that
does not open with `<think>` is all content. The newlines a template writes inside and after the block are neither.

Streamed, each piece of the reply is split as it arrives: text that may still turn out to be the start of `<think>`
or `</think>`, and newlines at the reasoning's end, wait for the next piece (or the reply's end), so the pieces sent
join to the split of the whole reply.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` are a proper start of `marker`."""
    return next((size for size in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:size])), 0)


def split_reasoning(text: str, opened: bool, final: bool = True) -> tuple[str, str]:
    """(reasoning, content) of a reply's `text`; `opened`: the prompt ends inside a <think> block. Unless `final`,
    only what no later text can change."""
    if not opened:
        if not text.startswith(OPEN):
            return ("", "") if not final and OPEN.startswith(text) else ("", text)
        text = text[len(OPEN):]
    end = text.find(CLOSE)
    if end < 0:
        reasoning = text if final else text[:len(text) - partial_marker(text, CLOSE)].rstrip("\n")
        return reasoning.strip("\n"), ""
    return text[:end].strip("\n"), text[end + len(CLOSE):].lstrip("\n")


class ReasoningStream:
    """The new reasoning and content of one streamed reply, piece by piece."""

    def __init__(self, opened: bool):
        self.opened = opened
        self.text = ""
        self.sent = (0, 0)  # characters of reasoning and of content sent

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) that `piece` adds; `final` at the reply's end."""
        self.text += piece
        reasoning, content = split_reasoning(self.text, self.opened, final)
        new = reasoning[self.sent[0]:], content[self.sent[1]:]
        self.sent = (max(self.sent[0], len(reasoning)), max(self.sent[1], len(content)))
        return new
