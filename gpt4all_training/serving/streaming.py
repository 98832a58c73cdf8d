"""The text of a streamed reply as it may be sent while its tokens arrive."""

from __future__ import annotations

from typing import Iterable

from gpt4all_training.model.decoding import Sequence


def held_back(text: str, stop: Iterable[str]) -> int:
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
    """What of one sequence's text (kept current at every token: `live_text`) may be sent: `sendable` is the new
    text that no later token can change, and all that is left once the sequence has finished. The pieces sent join
    to the sequence's text."""

    def __init__(self, sequence: Sequence):
        self.sequence = sequence
        self.sent = 0

    def sendable(self) -> str:
        text = self.sequence.text
        upto = len(text) if self.sequence.finished else len(text) - held_back(text, self.sequence.stop)
        piece = text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return piece
