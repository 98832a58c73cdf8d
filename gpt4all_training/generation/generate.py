"""Text generation from a trained model (a merged/full model, or a base plus LoRA adapter).

`python generate.py --config configs/generate/X.yaml [--prompt TEXT | --prompts-file FILE | --messages FILE]`; with
none, prompts are read from standard input, one per line. Prompts are formatted by `data.format_prompt`, the function
training used, so the model sees exactly the text it was trained to answer. A conversation (`--messages`) is encoded
by data/chat.py with the generation prompt, as training encoded the turns before each answer, and the reply stops at
the template's end-of-turn token; so does a prompt written with the chat template.

Sampling is one small pure function over the next-token logits, in the standard order: repetition penalty,
temperature, top-k, top-p, then a draw (or the argmax when temperature is 0). gpt4all's generate.py silently
ignored temperature, and mesh-transformer-jax applied top-p before temperature, so the nucleus was chosen from the
wrong distribution. Generation runs left-padded batches with a KV cache, stops a row at an EOS id or once its text
contains a stop string, and never adds tokens to the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from gpt4all_training.config.schemas import GenerateConfig
from gpt4all_training.data.batching import collate
from gpt4all_training.data.chat import encode_for_generation, end_of_turn_id
from gpt4all_training.data.conversations import conversation_problem
from gpt4all_training.data.prompts import encode_prompts, resolve_template
from gpt4all_training.errors import UserError
from gpt4all_training.model.loading import load_model, tokenizer_for
from gpt4all_training.readers import parse_json, read_text


# ---------------------------------------------------------------- sampling (pure)

@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0


def process_logits(logits: torch.Tensor, seen: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Next-token scores after, in order, the repetition penalty, temperature, top-k and top-p; removed tokens
    are -inf. `logits` is (batch, vocab); `seen` marks tokens already in each row's prompt or output."""
    scores = logits.float()
    if sampling.repetition_penalty != 1.0:
        penalised = torch.where(scores > 0, scores / sampling.repetition_penalty,
                                scores * sampling.repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    if sampling.temperature == 0:
        return scores  # greedy: the argmax is all that matters
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


def next_tokens(logits: torch.Tensor, seen: torch.Tensor, sampling: Sampling,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token id per row: argmax when temperature is 0, else a draw from the processed distribution."""
    scores = process_logits(logits, seen, sampling)
    if sampling.temperature == 0:
        return scores.argmax(dim=-1)
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator).squeeze(-1)


def cut_at_stop(text: str, stop: Iterable[str]) -> tuple[str, bool]:
    """`text` up to the earliest stop string, and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


# ---------------------------------------------------------------- the loop

@torch.inference_mode()
def generate_ids(model, prompt_ids: list[list[int]], pad_id: int, eos_ids: set[int], max_new_tokens: int,
                 sampling: Sampling, generator: Optional[torch.Generator] = None, vocab_size: Optional[int] = None,
                 should_stop: Optional[Callable[[list[int]], bool]] = None) -> list[list[int]]:
    """New token ids per prompt (without the EOS), from one left-padded batch decoded with a KV cache.

    A row ends at an EOS id, when `should_stop(its ids)` says so, or after `max_new_tokens`. Logits past
    `vocab_size` (embedding rows the tokenizer has no token for) are never chosen.
    """
    if any(not ids for ids in prompt_ids):
        raise UserError("prompt: an empty prompt has no tokens to condition on")
    device = next(model.parameters()).device
    batch = collate([{"input_ids": ids} for ids in prompt_ids], pad_id, padding_side="left")
    input_ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    # Positions count real tokens only, so a left-padded row sees the same positions as it would alone.
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
    logits = out.logits[:, -1]
    vocab = logits.shape[-1]
    seen = torch.zeros((len(prompt_ids), vocab), dtype=torch.long, device=device)
    seen = seen.scatter_add(1, input_ids, mask) > 0  # padding does not count as seen
    generated: list[list[int]] = [[] for _ in prompt_ids]
    done = torch.zeros(len(prompt_ids), dtype=torch.bool, device=device)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        if vocab_size is not None and vocab_size < vocab:
            logits = logits.clone()
            logits[:, vocab_size:] = float("-inf")
        tokens = next_tokens(logits, seen, sampling, generator)
        tokens = torch.where(done, torch.full_like(tokens, pad_id), tokens)
        done |= torch.isin(tokens, eos)
        for row in torch.nonzero(~done).flatten().tolist():
            generated[row].append(int(tokens[row]))
            if should_stop is not None and should_stop(generated[row]):
                done[row] = True
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        seen[torch.arange(len(prompt_ids), device=device), tokens] = True
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, cache=out.cache,
                    use_cache=True)
        logits = out.logits[:, -1]
    return generated


def eos_token_ids(model, tokenizer) -> set[int]:
    """The tokenizer's EOS plus any the model's generation config names (chat models often end on another)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    return ids


def generate_texts(model, tokenizer, prompts: list[str], template: str, max_new_tokens: int,
                   temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0,
                   stop: Iterable[str] = (), seed: int = 0, batch_size: int = 8) -> list[str]:
    """Responses to `prompts`, formatted as training formatted them; greedy by default, seeded when sampling."""
    template = resolve_template(template, tokenizer)
    eos = eos_token_ids(model, tokenizer) | ({end_of_turn_id(tokenizer)} if template == "chat" else set())
    encode = partial(encode_prompts, tokenizer=tokenizer, template=template)
    return complete(model, tokenizer, prompts, encode, eos, max_new_tokens, Sampling(temperature, top_k, top_p,
                    repetition_penalty), stop, seed, batch_size)


def generate_replies(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int,
                     temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0,
                     stop: Iterable[str] = (), seed: int = 0, batch_size: int = 8) -> list[str]:
    """The assistant's next turn in each conversation, from the chat template's generation prompt to its
    end-of-turn token (or the tokenizer's EOS); greedy by default, seeded when sampling."""
    eos = eos_token_ids(model, tokenizer) | {end_of_turn_id(tokenizer)}
    encode = partial(encode_for_generation, tokenizer)
    return complete(model, tokenizer, conversations, encode, eos, max_new_tokens, Sampling(temperature, top_k, top_p,
                    repetition_penalty), stop, seed, batch_size)


def complete(model, tokenizer, inputs: list, encode: Callable[[list], list[list[int]]], eos: set[int],
             max_new_tokens: int, sampling: Sampling, stop: Iterable[str], seed: int, batch_size: int) -> list[str]:
    """The text generated after each input, `encode`d batch by batch, up to an `eos` id or a stop string."""
    stop = [s for s in stop if s]
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()

    def hit_stop(ids: list[int]) -> bool:
        return cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), stop)[1]

    texts = []
    for start in range(0, len(inputs), batch_size):
        prompt_ids = encode(inputs[start:start + batch_size])
        for ids in generate_ids(model, prompt_ids, tokenizer.pad_token_id, eos, max_new_tokens, sampling,
                                generator, vocab_size=len(tokenizer), should_stop=hit_stop if stop else None):
            texts.append(cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), stop)[0])
    model.train(was_training)
    return texts


# ---------------------------------------------------------------- prompts in, a loaded model

def read_prompts_file(path: str) -> list[str]:
    """One prompt per non-empty line; a .jsonl/.json file has one object with a string 'prompt' per line."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"prompts_file: {path} does not exist")
    prompts = []
    lines = read_text(file, "prompts_file").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if file.suffix in (".jsonl", ".json"):
            row = parse_json(line, f"prompts_file {path}:{number}")
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise UserError(f"prompts_file {path}:{number}: expected an object with a string 'prompt'")
            prompts.append(row["prompt"])
        else:
            prompts.append(line.strip())
    if not prompts:
        raise UserError(f"prompts_file {path}: no prompts in it")
    return prompts


def read_messages_file(path: str) -> list[list[dict]]:
    """Conversations to continue: a .json file holds one ({"messages": [...]} or the list of messages itself), any
    other file one per line (JSONL, each line either form). Each must be one an assistant turn can follow."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"messages_file: {path} does not exist")
    text = read_text(file, "messages_file")
    lines = [(None, text)] if file.suffix == ".json" else [(n, line) for n, line in enumerate(text.splitlines(), 1)
                                                           if line.strip()]
    conversations = []
    for number, line in lines:
        where = f"messages_file {path}" + (f":{number}" if number else "")
        row = parse_json(line, where)
        messages = row.get("messages") if isinstance(row, dict) else row
        # Checked as the conversation it becomes once answered: roles in order, no empty turn.
        problem = conversation_problem([*messages, {"role": "assistant", "content": "answer"}]) \
            if isinstance(messages, list) else "malformed_messages"
        if problem:
            raise UserError(f"{where}: not a conversation to answer ({problem}); give a list of messages with "
                            f"'role' and 'content' that ends with a user or tool turn")
        conversations.append(messages)
    if not conversations:
        raise UserError(f"messages_file {path}: no conversations in it")
    return conversations


@dataclass
class Generator:
    """A loaded model and tokenizer with the config's sampling: prompts -> responses, conversations -> replies."""
    model: torch.nn.Module
    tokenizer: object
    config: GenerateConfig

    def sampling(self) -> dict:
        config = self.config
        return dict(max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p,
                    top_k=config.top_k, repetition_penalty=config.repetition_penalty, stop=config.stop,
                    seed=config.seed, batch_size=config.batch_size)

    def answer(self, prompts: list[str]) -> list[str]:
        return generate_texts(self.model, self.tokenizer, prompts, self.config.prompt_template, **self.sampling())

    def reply(self, conversations: list[list[dict]]) -> list[str]:
        return generate_replies(self.model, self.tokenizer, conversations, **self.sampling())


def load_generator(config: GenerateConfig) -> Generator:
    """Load the model and tokenizer `config` names (on the GPU when there is one)."""
    tokenizer = tokenizer_for(config)
    model = load_model(config.model_name, config.model_revision, config.gguf_file, config.trust_remote_code,
                       dtype=getattr(torch, config.dtype))
    model.to(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")).eval()
    return Generator(model, tokenizer, config)
