"""The one decoder: batched sampling with a KV cache, for `generate`, `serve`, the harness's generate_until and
any stage that samples from the model it trains.

Sampling is one small pure function over the next-token logits, in the standard order: repetition penalty,
temperature, top-k, top-p, then a draw (or the argmax when temperature is 0). gpt4all's generate.py silently
ignored temperature, and mesh-transformer-jax applied top-p before temperature, so the nucleus was chosen from the
wrong distribution.

`Decoder` holds a running batch and is driven a step at a time, as the server's scheduler does: `prefill` runs new
prompts as one left-padded batch and joins them to the rows already decoding (left-padding the shorter of the two
caches), `choose` picks every row's next token, `step` keeps the rows asked for and runs them one token further,
dropping the cache columns that only padded the rows that left. Each row carries its own positions (counted over
its real tokens), so padding changes nothing it computes: a greedy row's tokens are those it gets alone. A sampled
row draws with its own torch.Generator seeded from its `seed`, so it draws the same tokens whatever batch it lands
in. Rows of one prompt (a group of samples of it) share its prefill: each distinct prompt of a batch runs once and
its cache rows are copied to the others. `decode_all` is the plain call: decode these prompts to their ends, at most
`batch_size` rows at a time.

Where the model's parameters are sharded over processes (FSDP2, ZeRO-3), every forward gathers them, a collective:
every process must run as many forwards as every other, though each decodes its own rows to their own lengths.
`decode_all(..., lockstep=...)` then agrees, before each token's forwards, whether any process still runs rows or
prefills new ones, and a process with nothing of its own to run feeds the model one padding token instead and drops
the result (HF generate's `synced_gpus`). Its own rows see the same forwards as without lockstep, so they decode the
same tokens.

Joining in flight needs the plain `DynamicLayer` cache of full-attention models; for other caches (sliding-window
layers, linear attention) new prompts join only an empty batch.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from transformers.cache_utils import DynamicLayer

from gpt4all_training.errors import UserError


# ---------------------------------------------------------------- sampling (pure)

@dataclass(frozen=True)
class Sampling:
    """How a row picks its next token: temperature 0 is greedy; top_p keeps the smallest set of most likely
    tokens whose probabilities reach it; top_k 0 keeps all; repetition_penalty 1 changes nothing."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: torch.Tensor, seen: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Next-token scores after, in order, the repetition penalty, temperature, top-k and top-p; removed tokens
    are -inf. `logits` is (rows, vocab); `seen` marks tokens already in each row's prompt or output."""
    scores = logits.float()
    if sampling.repetition_penalty != 1.0:
        penalised = torch.where(scores > 0, scores / sampling.repetition_penalty,
                                scores * sampling.repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    if sampling.greedy:
        return scores  # the argmax is all that matters
    scores = scores / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        # On the distribution that temperature and top-k left: keep a token while the mass before it is < top_p.
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order, mass_before >= sampling.top_p)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def next_tokens(logits: torch.Tensor, seen: torch.Tensor, samplings: list[Sampling],
                generators: list[Optional[torch.Generator]]) -> torch.Tensor:
    """One token id per row of `logits` (rows, vocab), each under its own sampling: the argmax of its processed
    scores when greedy, else a draw with its own generator (None: torch's global one). Rows with equal settings
    are processed together; each draw sees only its own row, so it does not depend on the others."""
    tokens = torch.empty(len(samplings), dtype=torch.long, device=logits.device)
    groups: dict[Sampling, list[int]] = collections.defaultdict(list)
    for row, sampling in enumerate(samplings):
        groups[sampling].append(row)
    for sampling, rows in groups.items():
        index = slice(None) if len(rows) == len(samplings) else torch.tensor(rows, device=logits.device)
        scores = process_logits(logits[index], seen[index], sampling)
        if sampling.greedy:
            tokens[index] = scores.argmax(dim=-1)
        else:
            probs = torch.softmax(scores, dim=-1)
            tokens[index] = torch.cat([torch.multinomial(p, 1, generator=generators[row])
                                       for p, row in zip(probs, rows)])
    return tokens


def cut_at_stop(text: str, stop: Iterable[str]) -> tuple[str, bool]:
    """`text` before the earliest stop string, and whether there was one."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


def eos_token_ids(model, tokenizer) -> set[int]:
    """The tokenizer's EOS plus any the model's generation config names (chat models often end on another)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    return ids


# ---------------------------------------------------------------- one row

@dataclass(eq=False)
class Sequence:
    """One row to decode: its prompt, how to sample and where to end its continuation, and what it produced."""
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    seed: Optional[int] = None  # a sampled row's own generator; None draws from torch's global one
    stop: tuple[str, ...] = ()
    live_text: bool = False  # decode `text` at every token (to stream it), not only once finished
    ids: list[int] = field(default_factory=list)  # the continuation, without the EOS that ended it
    eos_id: Optional[int] = None  # the EOS it ended at, if it did
    logprobs: list[float] = field(default_factory=list)  # of every token drawn (ids, then eos_id), when asked for
    text: str = ""  # ids decoded, cut before the first stop string
    finish_reason: Optional[str] = None  # "stop" (an EOS or a stop string) or "length" (max_new_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int, logprob: Optional[float], eos_ids: Iterable[int],
            decode: Callable[[list[int]], str]) -> None:
        """Take `token` as the next one: end at an EOS id, a stop string or max_new_tokens."""
        if logprob is not None:
            self.logprobs.append(logprob)
        watched = bool(self.stop) or self.live_text
        if token in eos_ids:
            self.eos_id, self.finish_reason = token, "stop"
        else:
            self.ids.append(token)
            if len(self.ids) >= self.max_new_tokens:
                self.finish_reason = "length"
            if watched:
                self.text, stopped = cut_at_stop(decode(self.ids), self.stop)
                if stopped:
                    self.finish_reason = "stop"
        if self.finished and not watched:
            self.text = decode(self.ids)


# ---------------------------------------------------------------- the batch

def left_pad(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """`tensor` with zeros prepended along `dim` up to `length`."""
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class Decoder:
    """A running batch of sequences (see the module docstring). `logprobs` records, for every token drawn, its
    log-probability under the model's own distribution (the log-softmax of the raw logits, before any sampling
    setting), as a training forward of the same weights computes it; with `tempered`, under the logits divided by
    the row's temperature (greedy rows: the raw ones), as TRL's GRPO scores completions. Call it under
    torch.no_grad or torch.inference_mode, with the model in eval mode."""

    def __init__(self, model, tokenizer, eos_ids: Iterable[int], logprobs: bool = False, tempered: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.logprobs = logprobs
        self.tempered = tempered
        self.device = next(model.parameters()).device
        self.vocab_size = len(tokenizer)  # embedding rows past it have no token: never chosen
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # masked: any id does
        self.reset()

    def reset(self) -> None:
        """Empty the batch."""
        self.sequences: list[Sequence] = []
        self.generators: list[Optional[torch.Generator]] = []
        self.cache: Any = None  # transformers' cache of the rows
        self.mask: Optional[torch.Tensor] = None  # (rows, cached length): 0 where a row is padded
        self.logits: Optional[torch.Tensor] = None  # (rows, vocab): the next token's
        self.seen: Optional[torch.Tensor] = None  # (rows, vocab): tokens in each row so far (repetition penalty)
        self.chosen: Optional[torch.Tensor] = None  # (rows,): the tokens `choose` picked

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def plain_cache(self) -> bool:
        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def can_join(self) -> bool:
        """Whether `prefill` may add rows now."""
        return not self.sequences or self.plain_cache()

    def prefill(self, sequences: list[Sequence]) -> None:
        """Run the prompts of `sequences` as one left-padded batch and join them to the running rows."""
        if any(not s.prompt_ids for s in sequences):
            raise UserError("prompt: an empty prompt has no tokens to condition on")
        # Each distinct prompt runs once (a group's samples share it); its rows of the cache are copied to the others.
        prompts = list(dict.fromkeys(tuple(s.prompt_ids) for s in sequences))
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)  # only the last position's logits: the vocabulary is the largest layer
        logits = out.logits[:, -1]
        if len(prompts) < len(sequences):
            row = {p: i for i, p in enumerate(prompts)}
            copies = torch.tensor([row[tuple(s.prompt_ids)] for s in sequences], device=self.device)
            out.cache.batch_select_indices(copies)
            ids, mask, logits = ids[copies], mask[copies], logits[copies]
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=self.device).scatter_(1, ids, True)
        seen[:, self.pad_id] = ((ids == self.pad_id) & mask.bool()).any(dim=1)  # padding is not seen
        generators = [None if s.sampling.greedy or s.seed is None
                      else torch.Generator(device=self.device).manual_seed(s.seed) for s in sequences]
        self.join(sequences, generators, out.cache, mask, logits, seen)

    def join(self, sequences: list[Sequence], generators: list[Optional[torch.Generator]], cache,
             mask: torch.Tensor, logits: torch.Tensor, seen: torch.Tensor) -> None:
        if not self.sequences:
            self.cache, self.mask, self.logits, self.seen = cache, mask, logits, seen
        else:
            assert self.mask is not None and self.logits is not None and self.seen is not None  # rows are running
            length = max(self.mask.shape[1], mask.shape[1])
            self.mask = torch.cat([left_pad(self.mask, length, 1), left_pad(mask, length, 1)])
            for old, new in zip(self.cache.layers, cache.layers):
                old.keys = torch.cat([left_pad(old.keys, length, 2), left_pad(new.keys, length, 2)])
                old.values = torch.cat([left_pad(old.values, length, 2), left_pad(new.values, length, 2)])
            self.logits = torch.cat([self.logits, logits])
            self.seen = torch.cat([self.seen, seen])
        self.sequences = self.sequences + sequences
        self.generators = self.generators + generators

    def choose(self) -> None:
        """Pick every row's next token and add it to its sequence, which may end there."""
        assert self.logits is not None and self.seen is not None  # rows are running
        logits = self.logits
        if self.vocab_size < logits.shape[-1]:
            logits = logits.clone()
            logits[:, self.vocab_size:] = float("-inf")
        self.chosen = next_tokens(logits, self.seen, [s.sampling for s in self.sequences], self.generators)
        logprobs: list[Optional[float]] = [None] * len(self.sequences)
        if self.logprobs:
            scores = self.logits.float()
            if self.tempered:
                scores = scores / torch.tensor([s.sampling.temperature or 1.0 for s in self.sequences],
                                               device=self.device)[:, None]
            logprobs = torch.log_softmax(scores, dim=-1).gather(1, self.chosen[:, None])[:, 0].tolist()
        for sequence, token, logprob in zip(self.sequences, self.chosen.tolist(), logprobs):
            sequence.add(token, logprob, self.eos_ids, self.decode_text)

    def step(self, keep: list[int]) -> None:
        """Keep the rows at `keep` (in that order) and run each one token further, on the token `choose` gave it."""
        if not keep:
            self.reset()
            return
        assert self.chosen is not None and self.seen is not None and self.mask is not None  # `choose` ran
        fed = self.chosen
        if len(keep) < len(self.sequences):
            fed = fed[torch.tensor(keep, device=self.device)]
            self.select(keep)
        self.seen[torch.arange(len(keep), device=self.device), fed] = True
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(keep), 1))], dim=1)
        positions = self.mask.sum(dim=1, keepdim=True) - 1
        out = self.model(input_ids=fed[:, None], attention_mask=self.mask, position_ids=positions, cache=self.cache,
                         use_cache=True)
        self.cache, self.logits = out.cache, out.logits[:, -1]

    def idle_forward(self) -> None:
        """One forward of a padding token, its output dropped: a lockstep process's turn when it has nothing to run.
        It touches no row."""
        token = torch.tensor([[self.pad_id]], device=self.device)
        self.model(input_ids=token, attention_mask=torch.ones_like(token), use_cache=False, logits_to_keep=1)

    def select(self, keep: list[int]) -> None:
        """Keep only the rows at `keep`, and drop the cache columns that now pad every row."""
        index = torch.tensor(keep, device=self.device)
        self.sequences = [self.sequences[i] for i in keep]
        self.generators = [self.generators[i] for i in keep]
        assert self.mask is not None and self.logits is not None and self.seen is not None  # rows are running
        self.cache.batch_select_indices(index)
        self.mask, self.logits, self.seen = self.mask[index], self.logits[index], self.seen[index]
        if not self.plain_cache():
            return
        unused = int((self.mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())  # leading all-padding columns
        if unused:
            self.mask = self.mask[:, unused:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]


def decode_all(model, tokenizer, sequences: list[Sequence], eos_ids: Iterable[int], batch_size: int,
               logprobs: bool = False, tempered: bool = False,
               lockstep: Optional[Callable[[list[bool]], list[bool]]] = None) -> list[Sequence]:
    """Decode every sequence to its end, at most `batch_size` rows at a time (a waiting one takes the place of one
    that ended), and return them (`logprobs`, `tempered`: Decoder's). The model may be one in training (a PEFT
    wrapper included): it decodes in eval mode under torch.no_grad and goes back to the mode it was in.

    `lockstep`, where the processes must run the same forwards (sharded parameters), ORs each flag over every
    process (a collective); this process then runs a forward wherever another does (see the module docstring)."""
    agree = lockstep or (lambda flags: flags)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            decoder = Decoder(model, tokenizer, eos_ids, logprobs, tempered)
            waiting = collections.deque(sequences)
            while True:
                # A turn: the running rows one token further, then new rows joined, then every row's next token.
                running = [i for i, s in enumerate(decoder.sequences) if not s.finished]
                room = batch_size - len(running)
                joins = bool(waiting) and room > 0 and (not running or decoder.plain_cache())
                steps_anywhere, joins_anywhere = agree([bool(running), joins])
                if not (steps_anywhere or joins_anywhere):
                    break
                decoder.step(running)
                if steps_anywhere and not running:
                    decoder.idle_forward()
                if joins:
                    decoder.prefill([waiting.popleft() for _ in range(min(room, len(waiting)))])
                elif joins_anywhere:
                    decoder.idle_forward()
                if decoder.sequences:
                    decoder.choose()
    finally:
        model.train(was_training)
    return sequences
