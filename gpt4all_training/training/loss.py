"""The next-token loss, one path for fine-tuning, raw-text rows and evaluation: token-level cross-entropy sums.
Loss normalisation happens in the loop, over the trained tokens of a whole step.

The full-vocabulary logits of a batch are never built. The model runs with its output head swapped for an identity,
so its forward (through DDP, DeepSpeed or torch.compile wrappers alike) returns the final hidden states. Only the
positions that are trained (shifted label not IGNORE) are projected onto the vocabulary, in chunks of rows, by
`ChunkedLinearCrossEntropy`. It computes the gradients for hidden states, head weight and bias chunk by chunk inside
its forward, so the backward pass only scales them: the projection is not recomputed, and peak memory holds one
chunk's logits instead of batch x length x vocab of them. Prompt and padding positions never reach the head at all.

The plain path (full logits, then cross-entropy) remains for heads it cannot reproduce exactly: a head that is not a
plain `nn.Linear` (LoRA on lm_head, modules_to_save), or logit soft-capping/scaling; and where the backend does not
allow it (`chunks_output_head`: a ZeRO-3 head's weight is a partition; under XLA selecting the trained positions
would give every batch a new shape to compile), which model/build.py records on the model once, when it builds it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gpt4all_training.batch import IGNORE, model_inputs
from gpt4all_training.model.build import chunked_head_allowed
from gpt4all_training.model.wrappers import unwrap_model

# Logits elements per chunk: 8M floats (32 MiB in fp32), e.g. 170 rows of a 49k vocabulary.
CHUNK_ELEMENTS = 1 << 23
# Config attributes of models whose forward changes the logits after the head; those keep the plain path.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
_IDENTITY = nn.Identity()  # one instance, so a compiled model sees the same module on every call


def output_head(model) -> tuple[nn.Module, str, nn.Linear] | None:
    """(parent module, attribute name, head) when the chunked loss reproduces the model's logits exactly and the
    backend allows it (recorded on the model when it was built), else None."""
    if not chunked_head_allowed(model):
        return None
    inner = unwrap_model(model)
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if get_head else None
    if type(head) is not nn.Linear:
        return None
    config = getattr(inner, "config", None)
    if any(getattr(config, key, None) not in (None, 1, 1.0) for key in LOGIT_TRANSFORMS):
        return None
    for module in inner.modules():
        for child_name, child in module.named_children():
            if child is head:
                return module, child_name, head
    return None


@contextlib.contextmanager
def head_removed(parent: nn.Module, name: str):
    """The model returns its final hidden states in `.logits` while this lasts."""
    head = getattr(parent, name)
    setattr(parent, name, _IDENTITY)
    try:
        yield
    finally:
        setattr(parent, name, head)


def compute_dtype(device: torch.device, param_dtype: torch.dtype) -> torch.dtype:
    """The matmul dtype the head would run in: the autocast dtype when autocast is on, else the weight's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return param_dtype


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    logits = (hidden @ weight.T).float()
    return logits + bias if bias is not None else logits


def head_gradient_buffers(hidden, weight, bias, need_hidden: bool, need_weight: bool, need_bias: bool):
    """(grad_hidden, grad_weight, grad_bias) to fill chunk by chunk, None for what needs no gradient; the weight's
    and bias's accumulate in fp32."""
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
    grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
    return grad_hidden, grad_weight, grad_bias


def add_head_gradients(grad_logits, h, w, dtype, rows: slice, grad_hidden, grad_weight, grad_bias) -> None:
    """One chunk's share, from d loss / d logits of its `rows`: the hidden states' gradient written, the weight's and
    bias's added (each where its buffer is not None)."""
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0)
    g = grad_logits.to(dtype)
    if grad_hidden is not None:
        grad_hidden[rows] = g @ w
    if grad_weight is not None:
        grad_weight += (g.T @ h).float()


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i NLL(softmax(hidden_i @ W.T + b), target_i) + z_loss x sum_i log(Z_i)^2 over rows of `hidden`, one chunk
    of rows at a time, and sum_i log(Z_i)^2 (not differentiable: a metric).

    Forward computes the loss and, when needed, d loss / d (hidden, weight, bias) per chunk (softmax x
    (1 + 2 z_loss log Z) minus one-hot, times the inputs); backward multiplies them by the incoming gradient. Matmuls
    run in `dtype`; softmax and accumulation in fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, dtype, chunk_rows, grad_enabled, z_loss):
        # needs_input_grad is set under torch.no_grad too; evaluation must not pay for gradients.
        need_hidden, need_weight, need_bias = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.float() if bias is not None else None
            grad_hidden, grad_weight, grad_bias = head_gradient_buffers(hidden, weight, bias, need_hidden,
                                                                        need_weight, need_bias)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            z_total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.size(0), chunk_rows):
                h = hidden[start:start + chunk_rows].to(dtype)
                t = targets[start:start + chunk_rows]
                logits = _chunk_logits(h, w, b)
                lse = torch.logsumexp(logits, dim=-1)
                total += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
                z_total += (lse * lse).sum()
                if not (need_hidden or need_weight or need_bias):
                    continue
                grad_logits = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                if z_loss:
                    grad_logits.mul_((1 + 2 * z_loss * lse)[:, None])  # d(z log(Z)^2)/d logits = 2 z log(Z) softmax
                grad_logits[torch.arange(t.numel(), device=t.device), t] -= 1
                add_head_gradients(grad_logits, h, w, dtype, slice(start, start + chunk_rows), grad_hidden,
                                   grad_weight, grad_bias)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.param_dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        ctx.mark_non_differentiable(z_total)
        return total + z_loss * z_total, z_total

    @staticmethod
    def backward(ctx, grad_total, grad_z_total):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.param_dtypes
        return (grad_hidden * grad_total.to(grad_hidden.dtype) if grad_hidden is not None else None,
                (grad_weight * grad_total).to(weight_dtype) if grad_weight is not None else None,
                (grad_bias * grad_total).to(bias_dtype) if grad_bias is not None else None,
                None, None, None, None, None)


def chunked_loss_and_z(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, z_loss: float = 0.0,
                       chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of NLL + z_loss x sum of log(Z)^2, sum of log(Z)^2) of `targets` under `head(hidden)` for rows of
    hidden (N, H), without N x vocab logits."""
    dtype = compute_dtype(hidden.device, head.weight.dtype)
    chunk_rows = max(1, chunk_elements // head.out_features)
    return ChunkedLinearCrossEntropy.apply(hidden, head.weight, head.bias, targets, dtype, chunk_rows,
                                           torch.is_grad_enabled(), z_loss)


class ChunkedLinearLogProbs(torch.autograd.Function):
    """log softmax(z_i)[target_i] with z_i = (hidden_i @ W.T + b) / temperature, for each row of `hidden`, one chunk
    of rows at a time; with `entropy`, also each row's entropy -sum softmax(z_i) log softmax(z_i) (a metric, without
    gradient), as a second output.

    Unlike ChunkedLinearCrossEntropy, whose single output lets forward compute the gradients ahead, each row here may
    get its own incoming gradient (a preference loss weighs every sequence differently, a policy loss every token),
    so backward recomputes each chunk's logits and applies d log p_i / d logits = (one-hot - softmax) / temperature,
    times the row's gradient. Peak memory is one chunk's logits either way. Matmuls run in `dtype`; softmax and
    accumulation in fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, dtype, chunk_rows, temperature=1.0, entropy=False):
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.float() if bias is not None else None
            out = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
            entropies = torch.empty_like(out) if entropy else None
            for start in range(0, hidden.size(0), chunk_rows):
                logits = _chunk_logits(hidden[start:start + chunk_rows].to(dtype), w, b)
                if temperature != 1.0:
                    logits = logits / temperature
                t = targets[start:start + chunk_rows]
                lse = torch.logsumexp(logits, -1)
                out[start:start + chunk_rows] = logits.gather(1, t[:, None]).squeeze(1) - lse
                if entropies is not None:
                    entropies[start:start + chunk_rows] = lse - (torch.softmax(logits, -1) * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.dtype, ctx.chunk_rows, ctx.temperature = dtype, chunk_rows, temperature
        if entropies is None:
            return out
        ctx.mark_non_differentiable(entropies)
        return out, entropies

    @staticmethod
    def backward(ctx, grad_out, *unused):
        hidden, weight, bias, targets = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        dtype, chunk_rows, temperature = ctx.dtype, ctx.chunk_rows, ctx.temperature
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.float() if bias is not None else None
            grad_hidden, grad_weight, grad_bias = head_gradient_buffers(hidden, weight, bias, need_hidden,
                                                                        need_weight, need_bias)
            for start in range(0, hidden.size(0), chunk_rows):
                h = hidden[start:start + chunk_rows].to(dtype)
                t = targets[start:start + chunk_rows]
                logits = _chunk_logits(h, w, b)
                if temperature != 1.0:
                    logits = logits / temperature
                grad_logits = logits.sub_(torch.logsumexp(logits, -1, keepdim=True)).exp_().neg_()  # -softmax
                grad_logits[torch.arange(t.numel(), device=t.device), t] += 1
                grad_logits.mul_(grad_out[start:start + chunk_rows, None].float() / temperature)
                add_head_gradients(grad_logits, h, w, dtype, slice(start, start + chunk_rows), grad_hidden,
                                   grad_weight, grad_bias)
        return (grad_hidden,
                grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None,
                None, None, None, None, None)


def nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of NLL of `targets` under fp32 `logits` (..., vocab), already shifted; IGNORE targets skipped."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


@dataclass
class TokenLoss:
    total: torch.Tensor  # sum of next-token NLL over the trained positions, plus z_loss x z_sum
    z_sum: torch.Tensor  # sum of log(Z)^2 over the trained positions (not differentiable; 0 when nothing needs it)
    targets: torch.Tensor  # the shifted labels, on the logits' device
    last_logits: Optional[torch.Tensor]  # fp32 logits of each row's final position, without gradient, when asked


def token_loss(model, batch: dict[str, torch.Tensor], z_loss: float = 0.0, last_position: bool = False) -> TokenLoss:
    """The one next-token loss: NLL over the trained positions of `batch` (fp32 maths whatever the autocast dtype),
    plus `z_loss` x log(Z)^2 (mesh-transformer-jax's auxiliary loss, which keeps the softmax normaliser near 1).

    The chunked head is used where it reproduces the model's logits exactly (see the module docstring), else the
    full logits. `last_position` also returns each row's final-position logits (the prediction with the most
    context), so that only those are built whole besides.
    """
    targets = batch["labels"][:, 1:]
    found = output_head(model)
    if found is None:
        shifted = model(**model_inputs(batch)).logits[:, :-1].float()
        targets = targets.to(shifted.device)
        total = nll_sum(shifted, targets)
        z_sum = torch.zeros((), dtype=torch.float32, device=shifted.device)
        if z_loss:
            lse = torch.logsumexp(shifted, dim=-1)  # every position, then masked: shapes stay fixed under XLA
            z_sum = torch.where(targets != IGNORE, lse * lse, 0.0).sum()
            total = total + z_loss * z_sum
            z_sum = z_sum.detach()
        last = shifted[:, -1].detach() if last_position else None
        return TokenLoss(total, z_sum, targets, last)
    parent, name, head = found
    with head_removed(parent, name):
        hidden = model(**model_inputs(batch)).logits[:, :-1]
    targets = targets.to(hidden.device)
    # One nonzero for both selections: each waits for the device (the count of trained positions sets the shapes).
    trained = (targets != IGNORE).nonzero(as_tuple=True)
    total, z_sum = chunked_loss_and_z(hidden[trained], head, targets[trained], z_loss)
    last = None
    if last_position:
        with torch.no_grad():
            last = head(hidden[:, -1]).float()
    return TokenLoss(total, z_sum, targets, last)


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum of next-token NLL over the trained positions of `batch`: the fine-tuning loss and the evaluation loss."""
    return token_loss(model, batch).total


def chunked_head_inputs(model, batch: dict[str, torch.Tensor], targets: torch.Tensor, found):
    """(final hidden states, targets on their device, trained mask, head, matmul dtype, rows per chunk): what the
    chunked log-probabilities take, the model run with its head `found` by output_head removed."""
    parent, name, head = found
    with head_removed(parent, name):
        hidden = model(**model_inputs(batch)).logits[:, :-1]
    targets = targets.to(hidden.device)
    dtype = compute_dtype(hidden.device, head.weight.dtype)
    return hidden, targets, targets != IGNORE, head, dtype, max(1, CHUNK_ELEMENTS // head.out_features)


def sequence_logps(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per row of `batch`, the sum of the log-probabilities of its trained tokens (fp32, differentiable): what a
    preference loss compares. The chunked head is used where it reproduces the model's logits exactly (as in
    token_loss), else the full logits."""
    targets = batch["labels"][:, 1:]
    found = output_head(model)
    if found is None:
        shifted = model(**model_inputs(batch)).logits[:, :-1].float()
        targets = targets.to(shifted.device)
        nll = F.cross_entropy(shifted.reshape(-1, shifted.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                              reduction="none")
        return -nll.view(targets.shape).sum(1)
    hidden, targets, trained, head, dtype, chunk_rows = chunked_head_inputs(model, batch, targets, found)
    logps = ChunkedLinearLogProbs.apply(hidden[trained], head.weight, head.bias, targets[trained], dtype, chunk_rows)
    rows = trained.nonzero()[:, 0]
    return torch.zeros(targets.size(0), dtype=torch.float32, device=hidden.device).index_add(0, rows, logps)


def token_logps(model, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, entropies), each (rows, width - 1) fp32 over the shifted labels of `batch`: at a trained
    position the log-probability of its token under softmax(logits / temperature) (differentiable) and that
    distribution's entropy (without gradient); 0 elsewhere. What a policy loss weighs token by token. The chunked
    head is used where it reproduces the model's logits exactly (as in token_loss), else the full logits."""
    targets = batch["labels"][:, 1:]
    found = output_head(model)
    if found is None:
        shifted = model(**model_inputs(batch)).logits[:, :-1].float() / temperature
        targets = targets.to(shifted.device)
        trained = targets != IGNORE
        logp = torch.log_softmax(shifted, -1)
        chosen = logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
        return torch.where(trained, chosen, 0.0), torch.where(trained, entropy, 0.0)
    hidden, targets, trained, head, dtype, chunk_rows = chunked_head_inputs(model, batch, targets, found)
    logps, entropies = ChunkedLinearLogProbs.apply(hidden[trained], head.weight, head.bias, targets[trained], dtype,
                                                   chunk_rows, temperature, True)
    zeros = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
    return zeros.masked_scatter(trained, logps), zeros.masked_scatter(trained, entropies)


class CausalLMLoss:
    """The loop's `loss_fn(model, batch)` for raw-text rows: token_loss with `z_loss`. The loop divides by the step's
    trained tokens, so the z-term is a mean too.

    It also keeps, as metrics, the loss at the final position of each row (`train/last_loss`) and the z-term
    (`train/z_loss`), summed over the steps since they were last read.
    """

    def __init__(self, z_loss: float = 0.0) -> None:
        self.z_loss = z_loss
        self.window = torch.zeros(4, dtype=torch.float64)  # last-loss sum, rows, log(Z)^2 sum, trained positions

    def __call__(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = token_loss(model, batch, self.z_loss, last_position=True)
        with torch.no_grad():
            last_targets = out.targets[:, -1]
            assert out.last_logits is not None  # asked for with last_position=True
            last_sum = F.cross_entropy(out.last_logits, last_targets, ignore_index=IGNORE, reduction="sum")
            self.window += torch.stack([last_sum.double().cpu(), (last_targets != IGNORE).sum().double().cpu(),
                                        out.z_sum.detach().double().cpu(),
                                        (out.targets != IGNORE).sum().double().cpu()])
        return out.total

    def window_metrics(self, accelerator) -> dict[str, float]:
        """The metrics since the last call, over all ranks (a collective: every rank calls it), then reset."""
        totals = accelerator.reduce(self.window.to(accelerator.device), reduction="sum").cpu()
        self.window.zero_()
        metrics = {"train/last_loss": (totals[0] / totals[1]).item() if totals[1] else float("nan")}
        if self.z_loss:
            metrics["train/z_loss"] = (self.z_loss * totals[2] / totals[3]).item() if totals[3] else float("nan")
        return metrics
