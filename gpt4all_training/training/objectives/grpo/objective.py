"""The "grpo" objective: each sampling's rows (rollout.py) scored by the rewards (rewards.py) and trained on for
num_iterations steps with the policy loss (policy.py); its metrics, its checkpointed rows, and what `plan` and
`check` ask of it (this package's docstring: the step and the loss)."""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np
import torch

from gpt4all_training.data.prompt_records import Prompts, load_prompts, prompt_problem, prompt_rows
from gpt4all_training.data.prompts import resolve_template
from gpt4all_training.data.sampling import StepSampler
from gpt4all_training.errors import TrainingError, UserError
from gpt4all_training.model.build import build_training_model
from gpt4all_training.model.decoding import Sampling, Sequence
from gpt4all_training.training.counts import DataPlan, TokenCounts, run_layout
from gpt4all_training.training.objectives.grpo.policy import (LOSS_SUMS, PolicyLoss, PolicySettings, add_fixed_logps,
                                                             counter)
from gpt4all_training.training.objectives.grpo.rewards import (Reward, RewardValidation, check_reward_fields,
                                                              check_user_reward, load_user_reward, rewards_of,
                                                              score_completions)
from gpt4all_training.training.objectives.grpo.rollout import (Decoder, RepeatedSteps, Rollout, completion_ids,
                                                              group_advantages, kv_cache_bytes, rollout_rows,
                                                              rollout_seed)
from gpt4all_training.training.objectives.protocol import Batch, Data, RecordScan
from gpt4all_training.training.objectives.shared import frozen_copy

# What the sampling side of the window sums, per completion and per group, besides each reward's sum and square.
SAMPLE_SUMS = ("completions", "reward", "reward_sq", "groups", "equal_groups", "tokens", "truncated")


class GroupRelative:
    """"grpo": prompts, num_generations completions of each sampled every num_iterations steps from the model being
    trained, and the group-relative clipped policy loss (see the package's docstring)."""

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
        self.decoder = Decoder(config.batch_size, config.num_generations)
        self.validation = RewardValidation(self.rewards, self.decoder, config.max_completion_length)
        self.tokenizer = None
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
        check_reward_fields(self.rewards, config.dataset_path, train, val)
        self.tokenizer, self.validation.prompts = tokenizer, val
        return Data(train, val, train_stats, val_stats, fingerprint)

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
        chat = resolve_template(self.config.prompt_template, self.tokenizer) == "chat" or any(
            isinstance(p, list) for split in (data.train, data.val) for p in split.prompts)
        self.decoder.prepare(model, self.tokenizer, backend, chat)
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

    def sample(self, model, backend, prompts: Prompts, step: int, indices: list[list[int]], pad_id: int) -> Rollout:
        config, group = self.config, self.config.num_generations
        sampling = Sampling(config.temperature, config.top_p)
        positions = [p for micro in indices for p in micro]
        sequences = [Sequence(prompts.ids[p], config.max_completion_length, sampling, rollout_seed(config.seed, step,
                                                                                                    p, j))
                     for p in positions for j in range(group)]
        began = time.perf_counter()
        self.decoder.decode(model, sequences)
        self.generation_seconds += time.perf_counter() - began
        values, total = score_completions(self.rewards, sequences, prompts, positions, group, backend)
        batch_std = backend.gather(total.to(backend.device)).std().cpu() if config.scale_rewards == "batch" else None
        advantages, equal = group_advantages(total, group, config.scale_rewards, batch_std)
        self.add_to_window(sequences, values, total, equal)
        batches, start = [], 0
        for micro in indices:
            rows = len(micro) * group
            batches.append(rollout_rows(prompts, micro, sequences[start:start + rows], advantages[start:start + rows],
                                        pad_id, group, config.mask_truncated_completions))
            start += rows
        add_fixed_logps(batches, model, backend, self.settings.temperature, config.num_iterations > 1,
                        self.reference, self.frozen)
        return Rollout(step, batches)

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


def sample_std(total: float, square: float, n: float) -> float:
    """The Bessel-corrected standard deviation of n values from their sum and sum of squares."""
    if n < 2:
        return 0.0
    return float(np.sqrt(max(square - total * total / n, 0.0) / (n - 1)))
