"""How closely a GGUF file computes what the merged model computes, measured when the file is written.

A quantized file can answer otherwise than the model that was evaluated and served before export (BENCHMARKS.md
section 11 compares the types). So export runs the file in llama.cpp (the reader of export/llama_cpp.py) against the
merged fp32 model in transformers, at every position of a few fixed prompts and of the merged model's greedy answers
to them (decoded as `generate` and `serve` decode), and says in the model card and its last line how often the next
token (the argmax) agrees and the largest logit difference. Both sides take the same token ids, so the numbers
measure the weights and the graph, not the tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpt4all_training.data.chat import encode_for_generation
from gpt4all_training.export import llama_cpp
from gpt4all_training.export.template import stop_token_ids
from gpt4all_training.model.decoding import Sequence, decode_all, eos_token_ids

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
           "Explain photosynthesis in one sentence.", "List three prime numbers greater than 10.")
ANSWER_TOKENS = 24


@dataclass(frozen=True)
class Agreement:
    """llama.cpp on the file against transformers on the merged model, at every position of prompts and answers."""

    positions: int
    same_argmax: int  # positions where both pick the same next token
    max_difference: float  # the largest absolute logit difference, over every position and token
    largest_logit: float  # the merged model's largest absolute logit, for scale
    chat: bool  # the prompts were written in the model's chat template
    reader: str  # the llama.cpp build that ran the file

    @property
    def prompt_description(self) -> str:
        return f"{len(PROMPTS)} fixed {'chat ' if self.chat else ''}prompts"

    def summary(self) -> str:
        """The export's last line says this after the time."""
        return (f"llama.cpp picks the merged model's next token at {self.same_argmax}/{self.positions} positions of "
                f"{self.prompt_description} and their greedy answers; largest logit difference "
                f"{self.max_difference:.3g} (largest logit {self.largest_logit:.3g})")

    def card(self) -> list[str]:
        """The model card's section."""
        prompts = "; ".join(f"`{prompt}`" for prompt in PROMPTS)
        return ["", "## Agreement with the merged model", "",
                f"llama.cpp {self.reader} running this file, compared with transformers running the merged fp32 model "
                f"it was written from, at every position of {self.prompt_description} ({prompts}) and of the merged "
                f"model's greedy answers to them (up to {ANSWER_TOKENS} tokens each). Where the next token differs, a "
                f"chat with the file can go on otherwise than with the merged model.", "",
                "| positions | same next token (argmax) | largest logit difference | largest logit |",
                "|---|---|---|---|",
                f"| {self.positions} | {self.same_argmax} ({self.same_argmax / self.positions:.1%}) | "
                f"{self.max_difference:.3g} | {self.largest_logit:.3g} |"]


def prompt_ids(tokenizer) -> list[list[int]]:
    """PROMPTS as the model is asked them: each one user turn in the chat template with the generation prompt, or
    the text as it is where the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None):
        return encode_for_generation(tokenizer, [[{"role": "user", "content": prompt}] for prompt in PROMPTS])
    return [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]


def measure(path: Path, model, tokenizer) -> Agreement:
    """Agreement of the GGUF at `path` with `model` (the merged fp32 model it was written from)."""
    prompts = prompt_ids(tokenizer)
    eos = eos_token_ids(model, tokenizer) | set(stop_token_ids(tokenizer))
    answers = decode_all(model, tokenizer, [Sequence(ids, ANSWER_TOKENS) for ids in prompts], eos, len(prompts))
    rows = [ids + answer.ids for ids, answer in zip(prompts, answers)]
    with torch.no_grad():
        expected = [model(input_ids=torch.tensor([row])).logits[0].float().numpy() for row in rows]
    with llama_cpp.LlamaCppModel(path, context=max(len(row) for row in rows)) as file:
        actual = [file.logits(row) for row in rows]
    return Agreement(positions=sum(len(row) for row in rows),
                     same_argmax=sum(int((a.argmax(-1) == e.argmax(-1)).sum()) for a, e in zip(actual, expected)),
                     max_difference=max(float(np.abs(a - e).max()) for a, e in zip(actual, expected)),
                     largest_logit=max(float(np.abs(e).max()) for e in expected),
                     chat=bool(getattr(tokenizer, "chat_template", None)), reader=llama_cpp.reader_build())
