"""Preference tuning (objective dpo): the DPO, IPO and SimPO losses over chosen/rejected pairs, the reference model
they are measured from, and the rewards they log.

A micro-batch holds B pairs as 2B rows, chosen answers first (data/pairs.py). Each row's log-probability is the sum
over its answer's trained tokens (the masks sft uses), from loss.sequence_logps, which never builds the full logits.
With the policy's log-probabilities pi and the reference's ref, per pair (the names and conventions are TRL's):
- sigmoid (DPO): d = beta x ((pi_c - ref_c) - (pi_r - ref_r)); loss = -(1 - e) log sigmoid(d) - e log sigmoid(-d),
  with e the label smoothing (conservative DPO);
- ipo: d = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r over the answers' token counts n; loss = (d - 1/(2 beta))^2;
- simpo (no reference): d = beta x (pi_c / n_c - pi_r / n_r) - gamma; loss as sigmoid's;
and with `sft_weight` w, any of them plus w x (-pi_c / n_c), the chosen answer's mean NLL per token (RPO).
The rewards are beta x (pi - ref) per answer (simpo: beta x pi / n). The loop divides the step's summed loss by its
global count of pairs, so every pair weighs the same whatever the batch, accumulation and processes, as TRL's mean.

The reference is chosen once: LoRA's is the base model with the adapter disabled; full fine-tuning's is either
precomputed (one no-grad pass of the initial weights over every pair before step 1, cached with the tokenized data)
or a frozen copy of the initial weights; simpo has none.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from gpt4all_training.batch import IGNORE
from gpt4all_training.config.blocks import ModelSource, Preference
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.cache import entry_problem, load_arrays, write_arrays
from gpt4all_training.data.pairs import REFERENCE_COLUMNS, fetch_pairs
from gpt4all_training.errors import UserError
from gpt4all_training.model.loading import adapter_base, is_adapter_folder
from gpt4all_training.progress import progress
from gpt4all_training.training.evaluate import eval_batches
from gpt4all_training.training.loss import sequence_logps

Batch = dict[str, torch.Tensor]
# What the training window and the validation sum per pair, in this order.
SUMS = ("pairs", "chosen_rewards", "rejected_rewards", "correct", "chosen_logps", "rejected_logps")


@dataclass(frozen=True)
class PreferenceSettings:
    loss_type: str
    beta: float
    label_smoothing: float
    simpo_gamma: float
    sft_weight: float

    @classmethod
    def of(cls, config: Preference) -> PreferenceSettings:
        assert config.loss_type is not None and config.beta is not None, "TrainConfig fills the objective's defaults"
        return cls(config.loss_type, config.beta, config.label_smoothing, config.simpo_gamma, config.sft_weight)


@dataclass
class PairTerms:
    """Per pair of a micro-batch: its loss, the two rewards, and the policy's two log-probabilities."""
    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor

    def sums(self) -> torch.Tensor:
        """SUMS over the micro-batch's pairs (float64, without gradient)."""
        with torch.no_grad():
            values = [torch.tensor(float(self.losses.numel())), self.chosen_rewards.sum(),
                      self.rejected_rewards.sum(), (self.chosen_rewards > self.rejected_rewards).sum(),
                      self.chosen_logps.sum(), self.rejected_logps.sum()]
            return torch.stack([v.double().cpu() for v in values])


def pair_losses(policy: torch.Tensor, reference: Optional[torch.Tensor], lengths: torch.Tensor,
                settings: PreferenceSettings) -> PairTerms:
    """The loss terms of B pairs from 2B log-probabilities (chosen first) of the policy and the reference (None for
    simpo), and the 2B answers' trained-token counts."""
    pi_c, pi_r = policy.chunk(2)
    n_c, n_r = lengths.to(policy).chunk(2)
    beta, smoothing = settings.beta, settings.label_smoothing
    if settings.loss_type == "simpo":
        chosen, rejected = beta * pi_c / n_c, beta * pi_r / n_r
        margin = chosen - rejected - settings.simpo_gamma
    else:
        assert reference is not None  # only simpo has none
        ref_c, ref_r = reference.to(policy).chunk(2)
        ratio_c, ratio_r = pi_c - ref_c, pi_r - ref_r
        chosen, rejected = beta * ratio_c, beta * ratio_r
        margin = beta * (ratio_c - ratio_r)
    if settings.loss_type == "ipo":
        losses = (ratio_c / n_c - ratio_r / n_r - 1 / (2 * beta)) ** 2
    else:
        losses = -(1 - smoothing) * F.logsigmoid(margin) - smoothing * F.logsigmoid(-margin)
    if settings.sft_weight:
        losses = losses - settings.sft_weight * pi_c / n_c
    return PairTerms(losses, chosen.detach(), rejected.detach(), pi_c.detach(), pi_r.detach())


def answer_lengths(batch: Batch) -> torch.Tensor:
    """Each row's count of trained tokens."""
    return (batch["labels"][:, 1:] != IGNORE).sum(1)


# ---------------------------------------------------------------- the references

def precomputed(model, batch: Batch) -> torch.Tensor:
    """The reference log-probabilities fetch_pairs brought along from the dataset."""
    return batch["reference_logps"]


def peft_model(model):
    """The PEFT model inside the DDP, DeepSpeed or compile wrappers."""
    while not hasattr(model, "disable_adapter"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def adapter_disabled(model, batch: Batch) -> torch.Tensor:
    """LoRA's reference: the same forward with the adapter switched off, which is the base model."""
    with torch.no_grad(), peft_model(model).disable_adapter():
        return sequence_logps(model, batch)


class FrozenCopy:
    """A frozen copy of the initial weights, scoring each micro-batch without gradient."""

    def __init__(self, model) -> None:
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    def __call__(self, model, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return sequence_logps(self.model, batch)


def reference_kind(config: TrainConfig) -> Optional[str]:
    """Where the reference log-probabilities come from: "adapter" (LoRA: the base with the adapter disabled),
    "precomputed" or "frozen_copy" (full fine-tuning, by `reference`), or None (simpo has no reference)."""
    if config.loss_type == "simpo":
        return None
    return "adapter" if config.lora else config.reference or "precomputed"


# The references that need nothing but the batch and the model being trained; a frozen copy is made from the
# prepared model (frozen_copy).
REFERENCES = {"adapter": adapter_disabled, "precomputed": precomputed}


# ---------------------------------------------------------------- the loss and its metrics

class PreferenceLoss:
    """The loop's `loss_fn(model, batch)` for pairs: the sum of the pairs' losses (the loop divides by the step's
    pairs). It keeps SUMS over the pairs since window_metrics last read them."""

    def __init__(self, settings: PreferenceSettings, reference: Optional[Callable[[Any, Batch], torch.Tensor]]):
        self.settings, self.reference = settings, reference
        self.window = torch.zeros(len(SUMS), dtype=torch.float64)

    def terms(self, model, batch: Batch) -> PairTerms:
        reference = self.reference(model, batch) if self.reference is not None else None
        return pair_losses(sequence_logps(model, batch), reference, answer_lengths(batch), self.settings)

    def __call__(self, model, batch: Batch) -> torch.Tensor:
        terms = self.terms(model, batch)
        self.window += terms.sums()
        return terms.losses.sum()

    def window_metrics(self, backend) -> dict[str, float]:
        """The rewards and log-probabilities since the last call, each a mean over the pairs of every rank (a
        collective: every rank calls it), then reset."""
        totals = backend.reduce(self.window.to(backend.device)).cpu()
        self.window.zero_()
        return reward_metrics(totals)


def reward_metrics(totals: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """TRL's names for the means of SUMS over pairs."""
    pairs, chosen, rejected, correct, chosen_logps, rejected_logps = totals.tolist()
    if not pairs:
        return {}
    return {f"{prefix}rewards/chosen": chosen / pairs, f"{prefix}rewards/rejected": rejected / pairs,
            f"{prefix}rewards/margins": (chosen - rejected) / pairs, f"{prefix}rewards/accuracies": correct / pairs,
            f"{prefix}logps/chosen": chosen_logps / pairs, f"{prefix}logps/rejected": rejected_logps / pairs}


class PairValidation:
    """Validation of pairs: the preference loss per pair, and the reward metrics, on held-out pairs."""
    width = 1 + len(SUMS)  # the loss sum, then SUMS

    def __init__(self, loss: PreferenceLoss) -> None:
        self.loss = loss

    def fetch(self, dataset, indices: list[int], pad_id: int) -> Batch:
        return fetch_pairs(dataset, indices, pad_id)

    def sums(self, model, batch: Batch) -> torch.Tensor:
        terms = self.loss.terms(model, batch)
        return torch.cat([terms.losses.sum().double().cpu()[None], terms.sums()])

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        pairs = totals[1].item()
        return {"val_loss": totals[0].item() / pairs if pairs else float("nan"),
                **reward_metrics(totals[1:], "val_"), "val_pairs": int(pairs)}


# ---------------------------------------------------------------- precomputing the reference

@torch.no_grad()
def reference_logps(model, dataset, backend, batch_size: int, pad_id: int, split: str) -> np.ndarray:
    """(pairs, 2) float32: each pair's chosen and rejected log-probabilities under `model`, every rank scoring its
    share of each global batch (as validation shares them), then summed across ranks so every rank has them all.
    A "reference (`split`)" bar counts the global batches."""
    was_training = model.training
    model.eval()
    out = torch.zeros(len(dataset), 2, dtype=torch.float32, device=backend.device)
    batches = eval_batches(len(dataset), batch_size, backend.world_size, backend.rank, None)
    with progress(f"reference ({split})", len(batches), backend.is_main_process) as bar:
        for indices, real in batches:
            batch = backend.to_device(fetch_pairs(dataset, indices, pad_id))
            with backend.autocast():
                logps = sequence_logps(model, batch).float()
            if real:
                out[indices] = torch.stack(logps.chunk(2), dim=1)
            backend.step_boundary()
            bar.update(1)
    model.train(was_training)
    return backend.reduce(out).cpu().numpy()  # one rank holds each value, the others zeros: the sum is exact


def model_files(name: str) -> list[tuple[str, int, int]]:
    """(path, size, modification time) of the files a local model is read from (an adapter's base's too); none for
    a Hub id, which its revision names."""
    path = Path(name).expanduser()
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.glob("*") if p.is_file()) if path.is_dir() else []
    found = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    if is_adapter_folder(name):
        found += model_files(adapter_base(name))
    return found


def reference_key(config: ModelSource) -> str:
    """What decides the precomputed log-probabilities besides the tokenized pairs: the model and its files, the
    compute dtype, and the versions of the code that scores them."""
    import transformers

    assert config.model_name is not None  # validate() refuses a config without it
    code = hashlib.sha256()
    for source in (inspect.getfile(sequence_logps), __file__):  # training/loss.py and this module
        code.update(Path(source).read_bytes())
    described = {"model": [config.model_name, config.model_revision, config.gguf_file, model_files(config.model_name)],
                 "dtype": config.dtype, "code": code.hexdigest(),
                 "versions": [torch.__version__, transformers.__version__]}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]


def attach_reference(data, model, backend, config: TrainConfig, pad_id: int, entry: Optional[Path], log) -> None:
    """Add the reference log-probabilities of the initial weights to the train and validation pairs (columns
    REFERENCE_COLUMNS), from the cache entry of the tokenized data when it has them, else computed now and saved
    there. Runs before a resume loads its checkpoint, so `model` still holds the initial weights either way."""
    folder = entry / f"reference-{reference_key(config)}" if entry is not None else None
    cached = folder is not None and entry_problem(folder) is None
    if not backend.any_rank(not cached):  # every rank must take part in a computation, or none
        assert folder is not None  # cached
        arrays = load_arrays(folder)
        log(f"reference log-probabilities: cache hit ({folder})")
    else:
        arrays = {name: reference_logps(model, split, backend, config.batch_size, pad_id, name)
                  for name, split in (("train", data.train), ("validation", data.val))}
        saved = "not saved (the tokenized data is not cached)"
        if backend.is_main_process and folder is not None and entry is not None and entry_problem(entry) is None:
            try:
                write_arrays(folder, arrays)
                saved = f"saved to {folder}"
            except OSError as exc:  # a cache that cannot be written costs the next start a pass, never this run
                saved = f"not saved ({exc.strerror or type(exc).__name__})"
        log(f"reference log-probabilities: computed for {len(data.train)} train and {len(data.val)} validation "
            f"pairs with the initial weights; {saved}")
    data.train, data.val = (with_reference(split, arrays[name]) for split, name in
                            ((data.train, "train"), (data.val, "validation")))


def with_reference(split, logps: np.ndarray):
    for column, values in zip(REFERENCE_COLUMNS, logps.T):
        split = split.add_column(column, values.tolist())
    return split


def frozen_copy(model, backend) -> FrozenCopy:
    """reference: frozen_copy, from the prepared model (still the initial weights)."""
    if backend.partitions_parameters:
        raise UserError("reference: frozen_copy needs the whole model in every process, which ZeRO-3 and FSDP2 "
                        "partition; use reference: precomputed")
    return FrozenCopy(backend.unwrap(model))

