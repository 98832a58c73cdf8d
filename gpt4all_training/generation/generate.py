"""Text generation from a trained model (a merged/full model, or a base plus LoRA adapter).

`python generate.py --config configs/generate/X.yaml [--prompt TEXT | --prompts-file FILE | --messages FILE]`; with
none, prompts are read from standard input, one per line. Prompts are formatted by `data.format_prompt`, the function
training used, so the model sees exactly the text it was trained to answer. A conversation (`--messages`) is encoded
by data/chat.py with the generation prompt, as training encoded the turns before each answer, and the reply stops at
the template's end-of-turn token; so does a prompt written with the chat template.

Decoding is model/decoding.py's, shared with `serve` and `eval`: left-padded batches with a KV cache, a row ending
at an EOS id, once its text contains a stop string, or at max_new_tokens. Prompt i of a call samples with seed + i,
so its text does not depend on the batch it lands in. No token is ever added to the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from gpt4all_training.config.schemas import GenerateConfig
from gpt4all_training.data.chat import encode_for_generation, end_of_turn_id
from gpt4all_training.data.conversations import conversation_problem
from gpt4all_training.data.prompts import encode_prompts, resolve_template
from gpt4all_training.errors import UserError
from gpt4all_training.model.decoding import Sampling, Sequence, decode_all, eos_token_ids
from gpt4all_training.model.loading import load_model, tokenizer_for
from gpt4all_training.readers import parse_json, read_text


def generate_texts(model, tokenizer, prompts: list[str], template: str, max_new_tokens: int,
                   temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0,
                   stop: Iterable[str] = (), seed: int = 0, batch_size: int = 8) -> list[str]:
    """Responses to `prompts`, formatted as training formatted them; greedy by default, seeded when sampling."""
    template = resolve_template(template, tokenizer)
    eos = eos_token_ids(model, tokenizer) | ({end_of_turn_id(tokenizer)} if template == "chat" else set())
    encode = partial(encode_prompts, tokenizer=tokenizer, template=template)
    return complete(model, tokenizer, prompts, encode, eos, max_new_tokens,
                    Sampling(temperature, top_p, top_k, repetition_penalty), stop, seed, batch_size)


def generate_replies(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int,
                     temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0,
                     stop: Iterable[str] = (), seed: int = 0, batch_size: int = 8) -> list[str]:
    """The assistant's next turn in each conversation, from the chat template's generation prompt to its
    end-of-turn token (or the tokenizer's EOS); greedy by default, seeded when sampling."""
    eos = eos_token_ids(model, tokenizer) | {end_of_turn_id(tokenizer)}
    encode = partial(encode_for_generation, tokenizer)
    return complete(model, tokenizer, conversations, encode, eos, max_new_tokens,
                    Sampling(temperature, top_p, top_k, repetition_penalty), stop, seed, batch_size)


def complete(model, tokenizer, inputs: list, encode: Callable[[list], list[list[int]]], eos: set[int],
             max_new_tokens: int, sampling: Sampling, stop: Iterable[str], seed: int, batch_size: int) -> list[str]:
    """The text generated after each input, `encode`d, up to an `eos` id or a stop string."""
    stop = tuple(s for s in stop if s)
    sequences = [Sequence(ids, max_new_tokens, sampling, seed + i, stop) for i, ids in enumerate(encode(inputs))]
    return [sequence.text for sequence in decode_all(model, tokenizer, sequences, eos, batch_size)]


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
    conversations: list[list[dict[str, Any]]] = []
    for number, line in lines:
        where = f"messages_file {path}" + (f":{number}" if number else "")
        row = parse_json(line, where)
        messages = row.get("messages") if isinstance(row, dict) else row
        # Checked as the conversation it becomes once answered: roles in order, no empty turn.
        problem = conversation_problem([*messages, {"role": "assistant", "content": "answer"}]) \
            if isinstance(messages, list) else "malformed_messages"
        if problem or not isinstance(messages, list):
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
    assert config.model_name is not None  # validate() refuses a config without it
    tokenizer = tokenizer_for(config)
    model = load_model(config.model_name, config.model_revision, config.gguf_file, config.trust_remote_code,
                       dtype=getattr(torch, config.dtype))
    model.to(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")).eval()
    return Generator(model, tokenizer, config)
