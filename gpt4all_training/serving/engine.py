"""The scheduler: one thread that decodes every admitted request together, through model/decoding.py's Decoder.

Requests wait in a bounded queue. Between two decode steps the thread admits waiting requests while the batch has
room (in arrival order, never overtaking one that does not fit) and the decoder prefills their prompts and joins
them to the running rows, so a request that arrives while others decode starts at the next step instead of waiting
for the whole batch. A finished or cancelled row leaves the batch at once. Each choice samples with its own seed,
so a seeded request draws the same tokens whichever batch it lands in, and a greedy one gets its text alone.

Results travel to the HTTP side as events on the request's asyncio queue: `Delta` (new text, streaming only),
`Finished` (per choice) and `Failed` (the whole request).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Union

import torch

from gpt4all_training.model.decoding import Decoder, Sampling, Sequence
from gpt4all_training.serving.streaming import TextStream

log = logging.getLogger("gpt4all_training.serving")


@dataclass(frozen=True)
class Delta:
    index: int
    text: str


@dataclass(frozen=True)
class Finished:
    index: int
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str


Event = Union[Delta, Finished, Failed]


@dataclass
class Choice:
    """One row to decode: a prompt, and how to sample and end its continuation."""
    index: int
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int


class QueueFull(Exception):
    """max_queue requests are already waiting."""


class ShuttingDown(Exception):
    """The engine is closing and takes no new requests."""


class Ticket:
    """A request inside the engine: its choices (decoded as rows of one batch), the events they produce, and
    `cancelled`, which the HTTP side sets when nobody waits for the result any more."""

    def __init__(self, choices: list[Choice], stop: tuple[str, ...], stream: bool,
                 loop: asyncio.AbstractEventLoop):
        self.choices = choices
        self.stop = stop
        self.stream = stream
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = False
        self.batch_rows = 0  # the most rows any decode step of this request shared with others (itself included)

    def put(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class Row:
    """A choice of a request, decoding: the decoder's sequence and what of its text was sent."""
    ticket: Ticket
    choice: Choice
    sequence: Sequence
    stream: TextStream


@dataclass
class Stats:
    """Counters for /metrics: how much was done, and how large the batches were (rows per decode step)."""
    requests: int = 0
    prefills: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    max_batch_rows: int = 0
    steps_by_batch_rows: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "prefills": self.prefills, "decode_steps": self.decode_steps,
                "generated_tokens": self.generated_tokens, "max_batch_rows": self.max_batch_rows,
                "steps_by_batch_rows": {str(k): v for k, v in sorted(self.steps_by_batch_rows.items())}}


class Engine:
    def __init__(self, model, tokenizer, eos_ids: set[int], max_batch_size: int, max_queue: int):
        self.decoder = Decoder(model, tokenizer, eos_ids)
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.stats = Stats()
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.wakeup = threading.Condition()
        self.closing = False
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self.rows: list[Row] = []  # the running batch, row for row with the decoder's sequences

    # ---------------------------------------------------------------- the HTTP side

    def start(self) -> None:
        self.thread.start()

    def submit(self, ticket: Ticket) -> None:
        """Queue `ticket`; QueueFull when max_queue requests are already waiting, ShuttingDown after close()."""
        with self.wakeup:
            if self.closing:
                raise ShuttingDown("The server is shutting down.")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting; retry later.")
            self.waiting.append(ticket)
            self.stats.requests += 1
            self.wakeup.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Stop: waiting requests fail at once, rows still decoding fail at the next step, the thread ends."""
        with self.wakeup:
            self.closing = True
            for ticket in self.waiting:
                ticket.put(Failed("the server is shutting down"))
            self.waiting.clear()
            self.wakeup.notify()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # ---------------------------------------------------------------- the scheduler thread

    def run(self) -> None:
        with torch.inference_mode():
            while True:
                with self.wakeup:
                    while not self.waiting and not self.rows and not self.closing:
                        self.wakeup.wait()
                    if self.closing:
                        break
                    admitted = self.admissible()
                try:
                    if admitted:
                        self.prefill(admitted)
                    if self.rows:
                        self.step()
                except Exception as exc:  # a bug or out of memory: fail what was running, keep serving
                    log.exception("decoding failed")
                    self.fail_all(f"generation failed ({type(exc).__name__})", admitted)
            self.fail_all("the server is shutting down")

    def fail_all(self, message: str, admitted: Iterable[Ticket] = ()) -> None:
        """Fail the running requests (and `admitted` ones not yet joined) and empty the batch."""
        tickets = {id(t): t for t in [*(row.ticket for row in self.rows), *admitted]}
        for ticket in tickets.values():
            ticket.put(Failed(message))
        self.reset()

    def admissible(self) -> list[Ticket]:
        """Waiting tickets (in order) that fit into the batch now. Called with the lock held."""
        if not self.decoder.can_join():
            return []
        room = self.max_batch_size - len(self.rows)
        admitted = []
        while self.waiting and len(self.waiting[0].choices) <= room:
            ticket = self.waiting.popleft()
            if ticket.cancelled:
                continue
            room -= len(ticket.choices)
            admitted.append(ticket)
        return admitted

    def reset(self) -> None:
        self.rows = []
        self.decoder.reset()

    def prefill(self, tickets: list[Ticket]) -> None:
        """Join the choices of `tickets` to the running batch."""
        rows = []
        for ticket in tickets:
            for choice in ticket.choices:
                sequence = Sequence(choice.prompt_ids, choice.max_tokens, choice.sampling, choice.seed, ticket.stop,
                                    live_text=ticket.stream)
                rows.append(Row(ticket, choice, sequence, TextStream(sequence)))
        self.decoder.prefill([row.sequence for row in rows])
        self.stats.prefills += 1
        self.rows += rows

    def step(self) -> None:
        """Choose every row's next token, report it, and run the rows that go on one token further."""
        batch = len(self.rows)
        self.stats.decode_steps += 1
        self.stats.max_batch_rows = max(self.stats.max_batch_rows, batch)
        self.stats.steps_by_batch_rows[batch] = self.stats.steps_by_batch_rows.get(batch, 0) + 1
        self.decoder.choose()
        for row in self.rows:
            ticket, sequence = row.ticket, row.sequence
            ticket.batch_rows = max(ticket.batch_rows, batch)
            self.stats.generated_tokens += sequence.eos_id is None  # an EOS ends the text, it is not part of it
            if ticket.stream and (delta := row.stream.sendable()):
                ticket.put(Delta(row.choice.index, delta))
            if sequence.finished:
                assert sequence.finish_reason is not None  # set when it finished
                ticket.put(Finished(row.choice.index, sequence.text, sequence.finish_reason, len(sequence.ids)))
        keep = [i for i, row in enumerate(self.rows) if not row.sequence.finished and not row.ticket.cancelled]
        self.rows = [self.rows[i] for i in keep]
        self.decoder.step(keep)
