"""The scheduler: one thread that decodes every admitted request together, with a KV cache.

Requests wait in a bounded queue. Between two decode steps the thread admits waiting requests while the batch has
room (in arrival order, never overtaking one that does not fit): it prefills their prompts as one left-padded batch
and joins them to the running batch by left-padding the shorter of the two caches, so a request that arrives while
others decode starts at the next step instead of waiting for the whole batch. Each row carries its own positions
(counted over its real tokens), so padding changes nothing it computes. A finished row leaves the batch at once,
and the cache columns that only padded it are dropped.

Joining in flight needs the plain `DynamicLayer` cache of full-attention models; for other caches (sliding-window
layers, linear attention) requests are admitted only into an empty batch.

Results travel to the HTTP side as events on the request's asyncio queue: `Delta` (new text, streaming only),
`Finished` (per choice) and `Failed` (the whole request).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
from transformers.cache_utils import DynamicLayer

from gpt4all_training.serving.decoding import Sampling, TextStream, next_tokens

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
    ticket: Ticket
    choice: Choice
    generator: Optional[torch.Generator]
    text: TextStream
    position: int  # of the next token fed to the model
    ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None


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


def left_pad(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """`tensor` with zeros prepended along `dim` up to `length`."""
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class Engine:
    def __init__(self, model, tokenizer, eos_ids: set[int], max_batch_size: int, max_queue: int):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.eos_ids = eos_ids
        self.vocab_size = len(tokenizer)  # embedding rows past it have no token: never chosen
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.stats = Stats()
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.wakeup = threading.Condition()
        self.closing = False
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)
        # The running batch: its rows, their KV cache, attention mask (rows, cached length) and next-token logits.
        self.rows: list[Row] = []
        self.cache = None
        self.mask: Optional[torch.Tensor] = None
        self.logits: Optional[torch.Tensor] = None

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

    def fail_all(self, message: str, admitted: Sequence[Ticket] = ()) -> None:
        """Fail the running requests (and `admitted` ones not yet joined) and empty the batch."""
        tickets = {id(t): t for t in [*(row.ticket for row in self.rows), *admitted]}
        for ticket in tickets.values():
            ticket.put(Failed(message))
        self.reset()

    def admissible(self) -> list[Ticket]:
        """Waiting tickets (in order) that fit into the batch now. Called with the lock held."""
        if self.rows and not self.joinable():
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

    def joinable(self) -> bool:
        return self.cache is not None and all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def reset(self) -> None:
        self.rows, self.cache, self.mask, self.logits = [], None, None, None

    def prefill(self, tickets: list[Ticket]) -> None:
        """Run the prompts of `tickets` as one left-padded batch and join them to the running batch."""
        rows = [Row(ticket, choice, self.generator(choice), TextStream(self.tokenizer, ticket.stop),
                    position=len(choice.prompt_ids))
                for ticket in tickets for choice in ticket.choices]
        width = max(len(row.choice.prompt_ids) for row in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(r.choice.prompt_ids)) + r.choice.prompt_ids for r in rows],
                           device=self.device)
        mask = torch.tensor([[0] * (width - len(r.choice.prompt_ids)) + [1] * len(r.choice.prompt_ids)
                             for r in rows], device=self.device)
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)  # only the last position's logits: the vocabulary is the largest layer
        self.stats.prefills += 1
        self.join(rows, out.cache, mask, out.logits[:, -1])

    def join(self, rows: list[Row], cache, mask: torch.Tensor, logits: torch.Tensor) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask, self.logits = rows, cache, mask, logits
            return
        length = max(self.mask.shape[1], mask.shape[1])
        self.mask = torch.cat([left_pad(self.mask, length, 1), left_pad(mask, length, 1)])
        for old, new in zip(self.cache.layers, cache.layers):
            old.keys = torch.cat([left_pad(old.keys, length, 2), left_pad(new.keys, length, 2)])
            old.values = torch.cat([left_pad(old.values, length, 2), left_pad(new.values, length, 2)])
        self.logits = torch.cat([self.logits, logits])
        self.rows += rows

    def generator(self, choice: Choice) -> Optional[torch.Generator]:
        if choice.sampling.greedy:
            return None
        return torch.Generator(device=self.device).manual_seed(choice.seed)

    def step(self) -> None:
        """Choose every row's next token, report it, drop finished rows, and run the rest one token further."""
        batch = len(self.rows)
        self.stats.decode_steps += 1
        self.stats.max_batch_rows = max(self.stats.max_batch_rows, batch)
        self.stats.steps_by_batch_rows[batch] = self.stats.steps_by_batch_rows.get(batch, 0) + 1
        logits = self.logits
        if self.vocab_size < logits.shape[-1]:
            logits = logits.clone()
            logits[:, self.vocab_size:] = float("-inf")
        tokens = next_tokens(logits, [r.choice.sampling for r in self.rows], [r.generator for r in self.rows])
        for row, token in zip(self.rows, tokens):
            row.ticket.batch_rows = max(row.ticket.batch_rows, batch)
            self.advance(row, token)
        keep = [i for i, row in enumerate(self.rows) if row.finish_reason is None and not row.ticket.cancelled]
        for row in self.rows:
            if row.finish_reason is not None:
                row.ticket.put(Finished(row.choice.index, row.text.text, row.finish_reason, len(row.ids)))
        if not keep:
            self.reset()
            return
        fed = torch.tensor([[tokens[i]] for i in keep], device=self.device)
        if len(keep) < batch:
            self.select(keep)
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(keep), 1))], dim=1)
        positions = torch.tensor([[row.position] for row in self.rows], device=self.device)
        out = self.model(input_ids=fed, attention_mask=self.mask, position_ids=positions, cache=self.cache,
                         use_cache=True)
        self.cache, self.logits = out.cache, out.logits[:, -1]
        for row in self.rows:
            row.position += 1

    def advance(self, row: Row, token: int) -> None:
        """Add `token` to `row`: end it at EOS, a stop string or max_tokens; send new text when streaming."""
        ticket = row.ticket
        watched = bool(ticket.stop) or ticket.stream  # text needed at every token, not only at the end
        if token in self.eos_ids:
            row.finish_reason = "stop"
        else:
            row.ids.append(token)
            self.stats.generated_tokens += 1
            if len(row.ids) >= row.choice.max_tokens:
                row.finish_reason = "length"
            if watched and row.text.update(row.ids):
                row.finish_reason = "stop"
            if ticket.stream and (delta := row.text.sendable()):
                ticket.put(Delta(row.choice.index, delta))
        if row.finish_reason is not None:
            if not watched:
                row.text.update(row.ids)
            if ticket.stream and (rest := row.text.flush()):
                ticket.put(Delta(row.choice.index, rest))

    def select(self, keep: list[int]) -> None:
        """Keep only the rows at `keep`, and drop the cache columns that now pad every row."""
        index = torch.tensor(keep, device=self.device)
        self.rows = [self.rows[i] for i in keep]
        self.cache.batch_select_indices(index)
        self.mask, self.logits = self.mask[index], self.logits[index]
        if not self.joinable():
            return
        unused = int((self.mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())  # leading all-padding columns
        if unused:
            self.mask = self.mask[:, unused:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]
