"""grpo's sampling: the completions decoded from the module being trained (seeded per completion), their
advantages within each prompt's group, the rows a sampling makes, and the sampler that repeats each step's prompts
num_iterations times (this package's docstring: a step)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

from gpt4all_training.backends.precision import concrete_dtype
from gpt4all_training.batch import IGNORE
from gpt4all_training.data.batching import collate
from gpt4all_training.data.chat import end_of_turn_id
from gpt4all_training.data.prompt_records import Prompts
from gpt4all_training.data.sampling import StepSampler
from gpt4all_training.model.decoding import Sequence, decode_all, eos_token_ids
from gpt4all_training.model.loading import model_config
from gpt4all_training.training.objectives.protocol import Batch

# Added to a group's standard deviation before dividing by it (TRL's), so an all-equal group gives 0, not NaN.
STD_EPSILON = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str,
                     batch_std: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, which groups are all equal) of `rewards` (n,), consecutive groups of `group_size`: reward minus
    its group's mean, divided by the group's Bessel-corrected std + STD_EPSILON ("group"), by `batch_std` +
    STD_EPSILON ("batch": the std of the whole step's rewards) or by nothing ("none")."""
    grouped = rewards.view(-1, group_size)
    std = grouped.std(dim=1)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    equal = torch.isclose(std, torch.zeros_like(std))
    if scale == "group":
        return centred / (std.repeat_interleave(group_size) + STD_EPSILON), equal
    if scale == "batch":
        assert batch_std is not None, "scale 'batch' divides by the step's std"
        return centred / (batch_std + STD_EPSILON), equal
    return centred, equal


def rollout_seed(seed: int, step: int, position: int, j: int) -> int:
    """The seed of completion j of the prompt at `position` sampled at optimizer step `step`: the same for any
    number of processes and any batch the row lands in."""
    digest = hashlib.blake2b(f"{seed}:{step}:{position}:{j}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass
class Rollout:
    """The rows one sampling made, the batches of optimizer steps `step` .. step + num_iterations - 1."""
    step: int
    batches: list[Batch]


class Decoder:
    """Decodes completions with the module being trained, as many rows at a time as a micro-batch holds, once
    `prepare` has given it the run's tokenizer, backend and stop tokens (before step 1)."""

    def __init__(self, batch_size: int, num_generations: int) -> None:
        self.batch_size, self.num_generations = batch_size, num_generations
        self.tokenizer: Any = None
        self.backend: Any = None
        self.eos_ids: set[int] = set()

    def prepare(self, model, tokenizer, backend, chat: bool) -> None:
        """`chat`: the prompts are rendered by the chat template, whose end of turn also ends a completion."""
        self.tokenizer, self.backend = tokenizer, backend
        self.eos_ids = eos_token_ids(backend.unwrap(model), tokenizer) | ({end_of_turn_id(tokenizer)} if chat
                                                                          else set())

    def decode(self, model, sequences: list[Sequence], greedy: bool = False) -> None:
        rows = self.batch_size * (1 if greedy else self.num_generations)
        backend = self.backend
        with backend.autocast():
            decode_all(backend.unwrap(model), self.tokenizer, sequences, self.eos_ids, rows, logprobs=not greedy,
                       tempered=True, lockstep=backend.any_ranks if backend.samples_in_lockstep else None)


def rollout_rows(prompts: Prompts, micro: list[int], sequences: list[Sequence], advantages: torch.Tensor,
                 pad_id: int, group: int, mask_truncated: bool) -> Batch:
    """A micro-batch of prompt + completion rows, `group` completions of each prompt, the completions trained
    (unless `mask_truncated` and cut at max_completion_length), with their advantages and their sampled
    log-probabilities (over the shifted labels)."""
    examples = []
    for k, sequence in enumerate(sequences):
        prompt = prompts.ids[micro[k // group]]
        completion = completion_ids(sequence)
        trained = not (mask_truncated and sequence.finish_reason == "length")
        labels = [IGNORE] * len(prompt) + (completion if trained else [IGNORE] * len(completion))
        examples.append({"input_ids": prompt + completion, "labels": labels})
    batch = collate(examples, pad_id)
    sampled = torch.zeros(batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1, dtype=torch.float32)
    for k, sequence in enumerate(sequences):
        start = len(prompts.ids[micro[k // group]]) - 1
        sampled[k, start:start + len(sequence.logprobs)] = torch.tensor(sequence.logprobs)
    batch["sampled_logps"] = sampled
    batch["advantages"] = advantages.to(torch.float32)
    return batch


def kv_cache_bytes(config, rows: int, length: int) -> int:
    """The decoder's KV cache for `rows` sequences of `length` tokens: keys and values of every layer, over the
    key/value heads (fewer than the query heads under grouped-query attention), in the run's dtype."""
    model = model_config(config.model_name, config.model_revision, config.gguf_file, config.trust_remote_code)
    text = getattr(model, "text_config", model)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    bytes_per_value = 4 if concrete_dtype(config.dtype) == "float32" else 2
    return 2 * text.num_hidden_layers * rows * length * kv_heads * head_dim * bytes_per_value


def completion_ids(sequence: Sequence) -> list[int]:
    """The ids a completion trains on: those sampled, and the EOS that ended it."""
    return sequence.ids + ([sequence.eos_id] if sequence.eos_id is not None else [])


@dataclass(frozen=True)
class RepeatedSteps:
    """The sampler of prompts with each of its steps taken `times` in a row (num_iterations): optimizer step s trains
    on base step s // times, so the checkpoint's step still says where the run is. Every other attribute is the
    base sampler's."""
    base: StepSampler
    times: int

    def __getattr__(self, name: str) -> Any:
        if name == "base":  # not set yet (a copy being made): never ask the base for itself
            raise AttributeError(name)
        return getattr(self.base, name)

    @property
    def steps_per_epoch(self) -> int:
        return self.base.steps_per_epoch * self.times

    def step_indices(self, step: int) -> list[list[int]]:
        return self.base.step_indices(step // self.times)
