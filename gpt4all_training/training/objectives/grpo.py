""""grpo": prompts (data/prompt_records.py), completions sampled from the model being trained, scored by rewards
(rewards.py beside this), and the group-relative clipped policy loss of GRPO with the DAPO and Dr. GRPO corrections
(the names, defaults and formulas are TRL 1.16's GRPOTrainer's).

A step, in `step_batches` (the loop times it as batch_seconds, apart from the update):
1. Sampling. Each process samples `num_generations` completions of each of its own prompts of the step through the
   one decoder (model/decoding.py: batched, a KV cache), from the very module being trained, in eval mode, under
   the step's autocast; where the parameters are sharded (FSDP2, ZeRO-3) the processes decode in lockstep, each
   running a forward wherever another does. Completion j of a prompt draws with its own generator, seeded from (seed,
   step, the prompt's position, j): a resumed run and a run on another number of processes sample the same
   completions. A completion ends at an EOS (or the chat template's end of turn) or at max_completion_length
   (truncated: no EOS; with mask_truncated_completions it takes no part in the loss).
2. Rewards: every reward on every completion of this process; a failure on any process stops all of them.
3. Advantages, per group of a prompt's completions (a group never spans processes): A = r - mean(group), divided
   (scale_rewards "group") by the group's Bessel-corrected std + 1e-4, or ("batch") by the std of the whole step's
   rewards on every process; "none" divides by nothing.
4. The rows: prompt + completion, right-padded, the completion's tokens (its EOS included) trained. With
   num_iterations > 1 the log-probabilities of the weights that sampled (old) are computed once, here; with beta > 0
   so are the reference's (LoRA: the adapter disabled; full fine-tuning: a frozen copy of the initial weights).
These rows are the batches of num_iterations consecutive optimizer steps; a checkpoint between them keeps them
(`state_dict`), so a resume continues with the same rows.

The loss, per completion token t, with the log-probabilities of softmax(logits / temperature) (as TRL's):
ratio = exp(logp - old) (old = logp without gradient when num_iterations is 1: ratio exactly 1),
l = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta ratio (exp(ref - logp) - (ref - logp) - 1),
the KL estimate times the ratio as TRL 1.16 does by default (use_bias_correction_kl, DeepSeek-V3.2): the unbiased
gradient of the reverse KL, also where the ratio's value is 1.
The loop divides the step's summed loss by the step's count over every process, which the loss_type chooses:
"dapo": every completion token of the step; "grpo": each completion's mean over its tokens, then the mean over
completions; "dr_grpo": max_completion_length x completions.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from gpt4all_training.backends.precision import concrete_dtype
from gpt4all_training.batch import IGNORE, trained_token_count
from gpt4all_training.data.batching import collate
from gpt4all_training.data.chat import end_of_turn_id
from gpt4all_training.data.prompt_records import Prompts, load_prompts, prompt_problem, prompt_rows
from gpt4all_training.data.prompts import resolve_template
from gpt4all_training.data.records import record_location
from gpt4all_training.data.sampling import StepSampler
from gpt4all_training.errors import TrainingError, UserError
from gpt4all_training.model.build import build_training_model
from gpt4all_training.model.decoding import Sampling, Sequence, decode_all, eos_token_ids
from gpt4all_training.model.loading import model_config
from gpt4all_training.training.counts import DataPlan, TokenCounts, run_layout
from gpt4all_training.training.loss import token_logps
from gpt4all_training.training.objectives.preference import frozen_copy, peft_model
from gpt4all_training.training.objectives.protocol import Batch, Data, RecordScan
from gpt4all_training.training.objectives.rewards import (Reward, as_number, check_user_reward, load_user_reward,
                                                         rewards_of, score)

# Added to a group's standard deviation before dividing by it (TRL's), so an all-equal group gives 0, not NaN.
STD_EPSILON = 1e-4


@dataclass(frozen=True)
class PolicySettings:
    loss_type: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    temperature: float

    @classmethod
    def of(cls, config) -> PolicySettings:
        high = config.epsilon_high if config.epsilon_high is not None else config.epsilon
        return cls(config.loss_type, config.beta, config.epsilon, high, config.temperature)


# ---------------------------------------------------------------- advantages (pure)

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


# ---------------------------------------------------------------- the loss and its metrics

# The policy loss's window: sums over completion tokens since window_metrics last read them.
LOSS_SUMS = ("tokens", "kl", "entropy", "clip_low", "clip_high", "sampling_difference")


class PolicyLoss:
    """The loop's `loss_fn(model, batch)` for sampled rows: the clipped policy loss summed as the loss_type's count
    divides it (see the module docstring). It keeps LOSS_SUMS since window_metrics last read them, and the largest
    |sampled log-probability - the sampling weights' own| (old)."""

    def __init__(self, settings: PolicySettings, reference: Optional[Callable[[Any, Batch], torch.Tensor]] = None):
        self.settings, self.reference = settings, reference
        self.window = torch.zeros(len(LOSS_SUMS), dtype=torch.float64)
        self.largest_difference = 0.0

    def __call__(self, model, batch: Batch) -> torch.Tensor:
        s = self.settings
        logps, entropies = token_logps(model, batch, s.temperature)
        mask = (batch["labels"][:, 1:] != IGNORE).to(logps)
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()
        ratio = torch.exp(logps - old)
        advantages = batch["advantages"][:, None].to(logps)
        clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        kl = torch.zeros_like(per_token)
        if s.beta:
            gap = batch["ref_logps"] - logps
            # Times the ratio (TRL 1.16's default, DeepSeek-V3.2's correction): the gradient of the unbiased
            # reverse-KL estimate, which differs from the plain term's even where the ratio is exactly 1.
            kl = (torch.exp(gap) - gap - 1) * ratio
            per_token = per_token + s.beta * kl
        if s.loss_type == "grpo":
            loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)).sum()
        else:  # dapo, dr_grpo: token sums; the step divides by its tokens, or by max_completion_length x rows
            loss = (per_token * mask).sum()
        with torch.no_grad():
            difference = (batch["sampled_logps"] - old).abs() * mask
            self.largest_difference = max(self.largest_difference, float(difference.max()))
            sums = [mask.sum(), (kl * mask).sum(), (entropies * mask).sum(),
                    ((ratio < 1 - s.epsilon_low) & (advantages < 0)).to(mask).mul(mask).sum(),
                    ((ratio > 1 + s.epsilon_high) & (advantages > 0)).to(mask).mul(mask).sum(), difference.sum()]
            self.window += torch.stack([v.double().cpu() for v in sums])
        return loss


def row_count(batch: Batch) -> int:
    """Completions in a micro-batch: what loss_type grpo's loss is a mean over."""
    return batch["input_ids"].shape[0]


def counter(loss_type: str, max_completion_length: int) -> Callable[[Batch], int]:
    """What the step's summed loss is divided by, summed over its micro-batches on every process (the module
    docstring)."""
    if loss_type == "dapo":
        return trained_token_count
    if loss_type == "grpo":
        return row_count
    return lambda batch: row_count(batch) * max_completion_length


# ---------------------------------------------------------------- sampling

@dataclass
class Rollout:
    """The rows one sampling made, the batches of optimizer steps `step` .. step + num_iterations - 1."""
    step: int
    batches: list[Batch]


# What the sampling side of the window sums, per completion and per group, besides each reward's sum and square.
SAMPLE_SUMS = ("completions", "reward", "reward_sq", "groups", "equal_groups", "tokens", "truncated")


class RewardValidation:
    """Validation of a grpo run: one greedy completion of each held-out prompt, scored by the rewards: the mean
    reward (val_reward), each reward's mean and the completions' mean length. Held-out prompts are sampled on every
    process as validation shares any split (evaluate.py)."""

    def __init__(self, objective: GroupRelative) -> None:
        self.objective = objective
        self.width = 3 + len(objective.rewards)  # completions, weighted reward, completion tokens, each reward

    def fetch(self, dataset, indices: list[int], pad_id: int) -> Batch:
        return {"position": torch.tensor(indices, dtype=torch.long)}

    def sums(self, model, batch: Batch) -> torch.Tensor:
        objective = self.objective
        positions = batch["position"].tolist()
        prompts: Prompts = objective.val
        sequences = [Sequence(prompts.ids[p], objective.config.max_completion_length, Sampling()) for p in positions]
        objective.decode(model, sequences, greedy=True)
        values, total = objective.scored(sequences, prompts, positions, 1)
        tokens = sum(len(s.ids) + (s.eos_id is not None) for s in sequences)
        return torch.tensor([len(sequences), float(total.sum()), tokens, *values.sum(axis=0)], dtype=torch.float64)

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        count = totals[0].item()
        if not count:
            return {}
        names = [reward.name for reward in self.objective.rewards]
        return {"val_reward": totals[1].item() / count,
                **{f"val_rewards/{name}/mean": value / count for name, value in zip(names, totals[3:].tolist())},
                "val_completions/mean_length": totals[2].item() / count, "val_prompts": int(count)}


class GroupRelative:
    """"grpo": prompts, num_generations completions of each sampled every num_iterations steps from the model being
    trained, and the group-relative clipped policy loss (see the module docstring)."""

    name = "grpo"
    prepares_once = False
    dry_run_file = "check_clean.jsonl"
    shows_examples = False

    def __init__(self, config) -> None:
        self.config = config
        self.settings = PolicySettings.of(config)
        self.rows_per_example = config.num_generations  # a micro-batch holds batch_size x num_generations rows
        self.reference = None if config.beta == 0 else "adapter" if config.lora else "frozen_copy"
        self.reference_copies = int(self.reference == "frozen_copy")
        self.rewards: list[Reward] = rewards_of(config)
        self.loss = PolicyLoss(self.settings)
        self.count = counter(config.loss_type, config.max_completion_length)
        self.validation = RewardValidation(self)
        self.tokenizer = None
        self.val = Prompts()
        self.eos_ids: set[int] = set()
        self.backend: Any = None  # the run's, from before_training on
        self.frozen = None  # the reference's frozen copy (full fine-tuning, beta > 0)
        self.rollout: Optional[Rollout] = None
        self.last_step = -1  # the step whose batches step_batches gave last
        self.window = np.zeros(len(SAMPLE_SUMS) + 2 * len(self.rewards), dtype=np.float64)
        self.extremes = np.full(2, -np.inf)  # -(shortest completion), longest, since the window began
        self.generation_seconds = 0.0  # decoding completions, since the window began

    # ------------------------------------------------------------ data and model

    def load_data(self, config, tokenizer, log, world_size: int) -> Data:
        for reward in self.rewards:
            if reward.function is None:
                check_user_reward(reward)  # parsed, not run: a missing file or function fails before the model
        (train, val), (train_stats, val_stats), fingerprint = load_prompts(config, tokenizer)
        self.check_fields(config, train, val)
        self.tokenizer, self.val = tokenizer, val
        return Data(train, val, train_stats, val_stats, fingerprint)

    def check_fields(self, config, *splits: Prompts) -> None:
        """Every kept record has the fields the built-in rewards read (numbers where they compare numbers)."""
        for split in splits:
            for fields, position in zip(split.fields, split.index):
                for reward in self.rewards:
                    for name in reward.fields:
                        value = fields.get(name)
                        if value is None:
                            problem = f"no {name!r} field, which {reward.described} reads"
                        elif reward.numeric and (isinstance(value, bool) or as_number(str(value)) is None):
                            problem = f"field {name!r} is {value!r}, not the number {reward.described} compares with"
                        else:
                            continue
                        raise UserError(f"{record_location(config.dataset_path, position)}: {problem}; fix the record "
                                        f"or the reward's field")

    def build_model(self, config, tokenizer, backend):
        if backend.partitions_parameters and self.reference == "frozen_copy":
            raise UserError("objective grpo: beta > 0 in full fine-tuning keeps a frozen copy of the whole model in "
                            "every process, which ZeRO-3 and FSDP2 partition; use lora: true (the reference is the "
                            "base with the adapter disabled) or beta: 0")
        return build_training_model(config, tokenizer, backend, dropout_off=True)

    def sampler(self, config, data: Data, world_size: int, rank: int) -> RepeatedSteps:
        lengths = data.train.lengths() if config.group_by_length else None
        return RepeatedSteps(StepSampler(len(data.train), config.batch_size, world_size, rank,
                                         config.gradient_accumulation_steps, config.seed, lengths=lengths),
                             config.num_iterations)

    def before_training(self, model, data: Data, backend, pad_id: int, log) -> None:
        """Run the user's reward files (logged), find the completions' stop tokens, and keep the reference."""
        for reward in self.rewards:
            if reward.function is None:
                load_user_reward(reward, log)
        self.backend = backend
        chat = resolve_template(self.config.prompt_template, self.tokenizer) == "chat" or any(
            isinstance(p, list) for split in (data.train, data.val) for p in split.prompts)
        self.eos_ids = eos_token_ids(backend.unwrap(model), self.tokenizer) | (
            {end_of_turn_id(self.tokenizer)} if chat else set())
        if self.reference == "frozen_copy":
            self.frozen = frozen_copy(model, backend).model

    def steps_line(self, sampler, total_steps: int, num_epochs: int) -> str:
        config = self.config
        every = f", each batch of completions trained on for {config.num_iterations} steps" \
            if config.num_iterations > 1 else ""
        return (f"{total_steps} optimiser steps: {sampler.steps_per_epoch} per epoch x {num_epochs} epochs (global "
                f"batch {sampler.examples_per_step} prompts x {config.num_generations} completions{every})")

    # ------------------------------------------------------------ a step

    def step_batches(self, model, backend, dataset, step: int, indices: list[list[int]], pad_id: int) -> list[Batch]:
        first = step - step % self.config.num_iterations
        if self.rollout is None or self.rollout.step != first:
            if step != first:
                raise TrainingError(f"step {step + 1}: the completions sampled at step {first + 1} are gone (a "
                                    f"checkpoint written without them); resume from a checkpoint of a step where "
                                    f"the run samples, or start over")
            self.rollout = self.sample(model, backend, dataset, step, indices, pad_id)
        self.last_step = step
        return self.rollout.batches

    def decode(self, model, sequences: list[Sequence], greedy: bool = False) -> None:
        """Decode `sequences` with the module being trained, as many rows at a time as a micro-batch holds."""
        rows = self.config.batch_size * (1 if greedy else self.config.num_generations)
        backend = self.backend
        with backend.autocast():
            decode_all(backend.unwrap(model), self.tokenizer, sequences, self.eos_ids, rows, logprobs=not greedy,
                       tempered=True, lockstep=backend.any_ranks if backend.samples_in_lockstep else None)

    def scored(self, sequences: list[Sequence], prompts: Prompts, positions: list[int],
               per_prompt: int) -> tuple[np.ndarray, torch.Tensor]:
        """(each reward's values, the weighted sums) of the completions, `per_prompt` of each prompt at
        `positions`; a reward that fails on any process stops every process with its line."""
        chat = [isinstance(prompts.prompts[p], list) for p in positions for _ in range(per_prompt)]
        texts = [s.text for s in sequences]
        completions = [[{"role": "assistant", "content": text}] if is_chat else text for text, is_chat in
                       zip(texts, chat)]
        fields = [prompts.fields[p] for p in positions for _ in range(per_prompt)]
        columns = {name: [f.get(name) for f in fields] for name in dict.fromkeys(k for f in fields for k in f)}
        values, problem = score(self.rewards, [prompts.prompts[p] for p in positions for _ in range(per_prompt)],
                                completions, [completion_ids(s) for s in sequences], columns)
        if self.backend.any_rank(problem is not None):
            raise TrainingError(f"{problem or 'a reward failed on another process (its output names it)'}; fix it, "
                                f"then run the same command again to continue from the last checkpoint")
        weights = np.array([reward.weight for reward in self.rewards])
        return values, torch.from_numpy(values @ weights)

    def sample(self, model, backend, prompts: Prompts, step: int, indices: list[list[int]], pad_id: int) -> Rollout:
        config, group = self.config, self.config.num_generations
        sampling = Sampling(config.temperature, config.top_p)
        positions = [p for micro in indices for p in micro]
        sequences = [Sequence(prompts.ids[p], config.max_completion_length, sampling, rollout_seed(config.seed, step,
                                                                                                    p, j))
                     for p in positions for j in range(group)]
        began = time.perf_counter()
        self.decode(model, sequences)
        self.generation_seconds += time.perf_counter() - began
        values, total = self.scored(sequences, prompts, positions, group)
        batch_std = backend.gather(total.to(backend.device)).std().cpu() if config.scale_rewards == "batch" else None
        advantages, equal = group_advantages(total, group, config.scale_rewards, batch_std)
        self.add_to_window(sequences, values, total, equal)
        batches, start = [], 0
        for micro in indices:
            rows = len(micro) * group
            batches.append(self.rows(prompts, micro, sequences[start:start + rows], advantages[start:start + rows],
                                     pad_id))
            start += rows
        self.score_with_weights(model, backend, batches)
        return Rollout(step, batches)

    def rows(self, prompts: Prompts, micro: list[int], sequences: list[Sequence], advantages: torch.Tensor,
             pad_id: int) -> Batch:
        """A micro-batch of prompt + completion rows, the completions trained (unless masked as truncated), with
        their advantages and their sampled log-probabilities (over the shifted labels)."""
        group, examples = self.config.num_generations, []
        for k, sequence in enumerate(sequences):
            prompt = prompts.ids[micro[k // group]]
            completion = completion_ids(sequence)
            trained = not (self.config.mask_truncated_completions and sequence.finish_reason == "length")
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

    @torch.no_grad()
    def score_with_weights(self, model, backend, batches: list[Batch]) -> None:
        """Add, per micro-batch, the log-probabilities of the weights that sampled (num_iterations > 1: the ratio's
        denominator while the weights move) and of the reference (beta > 0), from the module being trained (in
        train mode, its dropout off) or the frozen copy, as the loss computes its own."""
        if self.config.num_iterations == 1 and self.reference is None:
            return
        temperature = self.settings.temperature
        module = backend.unwrap(model)
        for batch in batches:
            on_device = backend.to_device(batch)
            with backend.autocast():
                if self.config.num_iterations > 1:
                    batch["old_logps"] = token_logps(module, on_device, temperature)[0].cpu()
                if self.reference == "adapter":
                    with peft_model(module).disable_adapter():
                        batch["ref_logps"] = token_logps(module, on_device, temperature)[0].cpu()
                elif self.reference == "frozen_copy":
                    batch["ref_logps"] = token_logps(self.frozen, on_device, temperature)[0].cpu()

    # ------------------------------------------------------------ metrics

    def add_to_window(self, sequences: list[Sequence], values: np.ndarray, total: torch.Tensor,
                      equal: torch.Tensor) -> None:
        lengths = np.array([len(completion_ids(s)) for s in sequences], dtype=np.float64)
        own = [len(sequences), float(total.sum()), float((total.double() ** 2).sum()), len(equal),
               float(equal.sum()), float(lengths.sum()), sum(s.finish_reason == "length" for s in sequences)]
        self.window += np.concatenate([own, values.sum(axis=0), (values ** 2).sum(axis=0)])
        self.extremes = np.maximum(self.extremes, [-lengths.min(), lengths.max()])

    def window_metrics(self, backend) -> dict[str, float]:
        """TRL's metrics since the last call, over every process (a collective), then reset: the reward's and each
        reward's mean and std over completions, the share of groups whose rewards were all equal (no signal),
        completion lengths and the share cut at max_completion_length, the KL to the reference, the entropy, the
        clipped share of tokens, how far the sampling's log-probabilities are from the weights' own, and the time
        spent decoding."""
        sample = backend.reduce(torch.from_numpy(self.window).to(backend.device)).cpu().numpy()
        loss = backend.reduce(self.loss.window.to(backend.device)).cpu().numpy()
        extremes = backend.gather(torch.tensor([*self.extremes, self.loss.largest_difference, self.generation_seconds],
                                               device=backend.device)).view(-1, 4).max(dim=0).values.cpu().tolist()
        self.window[:], self.extremes[:], self.generation_seconds = 0.0, -np.inf, 0.0
        self.loss.window.zero_()
        self.loss.largest_difference = 0.0
        metrics: dict[str, float] = {}
        n = sample[0]
        if n:
            own = dict(zip(SAMPLE_SUMS, sample[:len(SAMPLE_SUMS)]))
            k = len(self.rewards)
            sums, squares = sample[len(SAMPLE_SUMS):len(SAMPLE_SUMS) + k], sample[len(SAMPLE_SUMS) + k:]
            metrics["reward"] = own["reward"] / n
            metrics["reward_std"] = sample_std(own["reward"], own["reward_sq"], n)
            for reward, total, square in zip(self.rewards, sums, squares):
                metrics[f"rewards/{reward.name}/mean"] = total / n
                metrics[f"rewards/{reward.name}/std"] = sample_std(total, square, n)
            metrics["frac_reward_zero_std"] = own["equal_groups"] / own["groups"]
            metrics["completions/mean_length"] = own["tokens"] / n
            metrics["completions/min_length"] = -extremes[0]
            metrics["completions/max_length"] = extremes[1]
            metrics["completions/clipped_ratio"] = own["truncated"] / n
            # The slowest process's decoding (part of batch_seconds, apart from update_seconds), and the completion
            # tokens of every process per second of it.
            metrics["generation_seconds"] = extremes[3]
            metrics["generation_tokens_per_s"] = own["tokens"] / max(extremes[3], 1e-9)
        tokens = loss[0]
        if tokens:
            named = dict(zip(LOSS_SUMS, loss))
            if self.settings.beta:
                metrics["kl"] = named["kl"] / tokens
            metrics["entropy"] = named["entropy"] / tokens
            metrics["clip_ratio/low_mean"] = named["clip_low"] / tokens
            metrics["clip_ratio/high_mean"] = named["clip_high"] / tokens
            metrics["clip_ratio/region_mean"] = (named["clip_low"] + named["clip_high"]) / tokens
            metrics["sampling/sampling_logp_difference/mean"] = named["sampling_difference"] / tokens
            metrics["sampling/sampling_logp_difference/max"] = extremes[2]
        return metrics

    # ------------------------------------------------------------ the checkpoint

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The rows of the current sampling when the next step trains on them again (num_iterations > 1, saved
        between two of its steps); else nothing."""
        if self.rollout is None or (self.last_step + 1) % self.config.num_iterations == 0:
            return {}
        state = {"step": torch.tensor(self.rollout.step)}
        for i, batch in enumerate(self.rollout.batches):
            state.update({f"batch{i}.{key}": value for key, value in batch.items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if not state:
            return
        batches: dict[int, Batch] = {}
        for name, value in state.items():
            if name != "step":
                number, key = name.removeprefix("batch").split(".", 1)
                batches.setdefault(int(number), {})[key] = value
        self.rollout = Rollout(int(state["step"]), [batches[i] for i in sorted(batches)])

    # ------------------------------------------------------------ plan and check

    def plan_counts(self, config, data: Data, sampler, total_steps: int) -> DataPlan:
        """Completions are sampled during the run, so its tokens are counted at their most: every completion
        max_completion_length long."""
        train, base = data.train, sampler.base
        lengths = np.asarray(train.lengths(), dtype=np.int64)
        group, longest = config.num_generations, config.max_completion_length
        steps = np.arange(total_steps) // config.num_iterations  # the sampling each optimizer step trains on
        samplings = int(steps[-1]) + 1 if total_steps else 0
        layout = run_layout(base, samplings).reshape(samplings, -1)[steps]
        prompts = lengths[layout.reshape(-1)]
        rows = len(prompts) * group
        tokens = int((prompts.sum() + len(prompts) * longest) * group)
        run = TokenCounts(examples=len(prompts), tokens=tokens, trained=rows * longest, padded=tokens, packed=tokens,
                          packed_sampled=0, packed_real=tokens)
        notes = [f"grpo: examples are prompts; each optimizer step trains on {group} completions of each of its "
                 f"{sampler.examples_per_step} prompts, sampled afresh every {config.num_iterations} step(s): "
                 f"{samplings * sampler.examples_per_step * group:,} completions in the run, counted here at "
                 f"max_completion_length ({longest}) tokens each (an upper bound: EOS ends most sooner)",
                 f"grpo sampling: one forward per generated token over up to batch_size x num_generations = "
                 f"{config.batch_size * group} rows with a KV cache of at most "
                 f"{kv_cache_bytes(config, config.batch_size * group, int(lengths.max()) + longest) / 2**20:,.1f} "
                 f"MiB (keys and values of every layer for the longest prompt + max_completion_length; freed before "
                 f"the update, so below its activations); its time is the training rows' batch_seconds, apart from "
                 f"update_seconds, and the tokens/s that `check` measures include it",
                 self.reference_note()]
        return DataPlan(train_examples=len(train), val_examples=len(data.val),
                        epoch_tokens=int(lengths.sum()) + len(train) * longest * group,
                        epoch_trained=len(train) * longest * group, examples_per_step=sampler.examples_per_step,
                        steps_per_epoch=sampler.steps_per_epoch,
                        dropped_per_epoch=len(train) - base.steps_per_epoch * sampler.examples_per_step,
                        total_steps=total_steps, run=run, notes=notes)

    def reference_note(self) -> str:
        if self.reference is None:
            return "grpo reference: none (beta 0): no KL term and no reference forward"
        if self.reference == "adapter":
            return ("grpo reference: the base model with the LoRA adapter disabled: no memory beyond the model, one "
                    "more no-grad forward per micro-batch at each sampling")
        return ("grpo reference: a frozen fp32 copy of the initial weights in every process (the 'reference' memory "
                "above), one more no-grad forward per micro-batch at each sampling")

    def scan_records(self, config, sample_size: int, text_factor: int, stream_limit: int) -> RecordScan:
        """Every record has a prompt (text or messages); the first `sample_size` that can be sampled from are the
        sample."""
        sample: list[dict[str, Any]] = []
        count, shapes = 0, set()
        for _, record in prompt_rows(config.dataset_path, config.revision):
            count += 1
            shapes.add("messages" if isinstance(record["prompt"], list) else "text")
            if len(sample) < sample_size and prompt_problem(record["prompt"]) is None:
                sample.append(record)
        return RecordScan(count, sample, sample_size, f"prompt ({' or '.join(sorted(shapes))})")

    def dry_run_size(self, summary: dict[str, Any], sample: list[dict[str, Any]]) -> str:
        return f"{len(sample)} prompts x {self.config.num_generations} completions"


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


def sample_std(total: float, square: float, n: float) -> float:
    """The Bessel-corrected standard deviation of n values from their sum and sum of squares."""
    if n < 2:
        return 0.0
    return float(np.sqrt(max(square - total * total / n, 0.0) / (n - 1)))


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
