"""Per-row decisions of a batched decode: the next token of each row under its own sampling settings and seed, and
the text of a row as it may be sent so far.

Each row samples with its own torch.Generator, so a seeded request draws the same tokens whichever batch it lands
in, and greedy rows take the argmax of their own logits, so their text equals what they would get alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class Sampling:
    """OpenAI's sampling fields: temperature 0 is greedy; top_p keeps the smallest set of most likely tokens whose
    probabilities reach it (after temperature)."""
    temperature: float = 1.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, sampling: Sampling, generator: Optional[torch.Generator]) -> int:
    """One token id drawn from one row's `logits` (vocab,) under `sampling`."""
    scores = logits.float() / sampling.temperature
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # A token stays while the mass of the tokens before it is below top_p: the most likely one always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= sampling.top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


def next_tokens(logits: torch.Tensor, samplings: Sequence[Sampling],
                generators: Sequence[Optional[torch.Generator]]) -> list[int]:
    """The next token of every row of `logits` (rows, vocab): argmax for greedy rows (one batched argmax), a draw
    from its own generator for the others."""
    greedy = logits.argmax(dim=-1).tolist()
    return [greedy[row] if s.greedy else sample(logits[row], s, generators[row])
            for row, s in enumerate(samplings)]


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """`text` before the earliest stop string, and whether there was one."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many characters at the end of `text` may not be sent yet: a partial UTF-8 character (decoded as U+FFFD
    until its last byte arrives) or the start of a stop string that the next tokens may complete."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for s in stop:
        for size in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:size]):
                hold = max(hold, size)
                break
    return hold


class TextStream:
    """The text of one row as its tokens arrive. `update` decodes the ids so far and says whether a stop string
    ended the row (the text is cut before it); `sendable` is the new text that no later token can change, and
    `flush` the rest once the row ends. The pieces sent join to `text`."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.text = ""
        self.stopped = False
        self.sent = 0

    def update(self, ids: list[int]) -> bool:
        self.text, self.stopped = cut_at_stop(self.tokenizer.decode(ids, skip_special_tokens=True), self.stop)
        return self.stopped

    def sendable(self) -> str:
        return self.take(len(self.text) if self.stopped else len(self.text) - held_back(self.text, self.stop))

    def flush(self) -> str:
        return self.take(len(self.text))

    def take(self, upto: int) -> str:
        piece = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return piece
