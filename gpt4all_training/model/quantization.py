"""A frozen base stored in 4 or 8 bits (bitsandbytes) under a LoRA adapter: QLoRA.

The base is quantized as it loads, by transformers' `BitsAndBytesConfig` (`quantization_config`): its decoder's
linear layers become bitsandbytes' Linear4bit (nf4 or fp4, blocks of 64 weights, each with its absmax constant) or
Linear8bitLt; the embeddings, norms and output head stay unquantized, stored in fp32 like every other base here.

PEFT's `prepare_model_for_kbit_training` is not called, because model/build.py already does each of its steps, and
one of them only where asked: it freezes the base (get_peft_model does), casts every fp16/bf16 parameter that is not
quantized to fp32 (the base loads in fp32 already: MASTER_DTYPE), makes the input embeddings' output require grad
(apply_lora does that under gradient checkpointing, the one case that needs it), and turns gradient checkpointing on
(reentrant, unasked; assemble turns on transformers' non-reentrant checkpointing when the config says so).

What else a quantized base needs here, each a function below: bitsandbytes' CPU repacking kept off while training
(it rewrites the weights in place during an evaluation pass, after which no gradient reaches the adapters before
it), a fingerprint of the quantized base for exact resume, the storage's size for the log and `plan`, and the merge
of an adapter into the dequantized base (the function the adapter was trained over), with the gap it leaves.
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Any, Mapping

import torch
from torch import nn

from gpt4all_training.model.wrappers import unwrap_model

# The config keys of the quantization block (config/blocks.py), as a training run's config.yaml records them.
QUANTIZATION_KEYS = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Texts the merged model and the quantized base with its adapter are compared on (logits at every position).
MERGE_CHECK_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    if n < 2:",
                       "Question: what is 12 times 7?\nAnswer:", "Once upon a time, in a small village,")
# bitsandbytes' 4-bit block size (transformers' default, and the only one the CPU kernels take).
BLOCK_SIZE = 64
# Blocks of absmax constants that double quantization quantizes together, each with an fp32 constant of its own.
DOUBLE_QUANT_BLOCK = 256


def quantization_settings(source: Any) -> dict[str, Any]:
    """The quantization keys of a training config, or of the mapping a run's config.yaml holds (keys it lacks,
    written before the block existed, take the block's defaults: unquantized)."""
    defaults = {"load_in_4bit": False, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
                "bnb_4bit_use_double_quant": True}
    if isinstance(source, Mapping):
        return {key: source.get(key, default) for key, default in defaults.items()}
    return {key: getattr(source, key) for key in defaults}


def is_quantizing(settings: Mapping[str, Any]) -> bool:
    return bool(settings["load_in_4bit"] or settings["load_in_8bit"])


def describe_settings(settings: Mapping[str, Any]) -> str:
    """'4-bit nf4 (double quantization)' or '8-bit (LLM.int8)'."""
    if settings["load_in_8bit"]:
        return "8-bit (LLM.int8)"
    double = ", double quantization" if settings["bnb_4bit_use_double_quant"] else ""
    return f"4-bit {settings['bnb_4bit_quant_type']}{double}"


def bnb_config(settings: Mapping[str, Any], compute_dtype: torch.dtype, storage: torch.dtype = torch.uint8):
    """transformers' BitsAndBytesConfig for `settings` (None when they quantize nothing). A 4-bit base computes in
    `compute_dtype` (the run's dtype) and packs its weights into tensors of `storage`: uint8 by default, a float
    dtype where the backend shards parameters (FSDP2 shards only floating tensors)."""
    if not is_quantizing(settings):
        return None
    from transformers import BitsAndBytesConfig

    if settings["load_in_8bit"]:
        silence_int8_cast_warning()
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=settings["bnb_4bit_quant_type"],
                              bnb_4bit_use_double_quant=settings["bnb_4bit_use_double_quant"],
                              bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=storage)


class Int8CastWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("MatMul8bitLt: inputs will be cast from")


def silence_int8_cast_warning() -> None:
    """bitsandbytes logs that an 8-bit layer casts its fp32 or bf16 input to fp16, at every call of every layer in
    eval mode (a validation pass: hundreds of lines); it is how LLM.int8 computes, nothing a user can change."""
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, Int8CastWarning) for f in logger.filters):
        logger.addFilter(Int8CastWarning())


def is_quantized(model) -> bool:
    return bool(getattr(unwrap_model(model), "is_quantized", False))


def quantized_linears(model) -> list[tuple[str, Any]]:
    """(name, module) of every bitsandbytes linear layer in `model`, the base layers under LoRA included."""
    import bitsandbytes as bnb

    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]


def keep_weight_layout(model) -> None:
    """bitsandbytes repacks a 4-bit weight in place for its AVX512-BF16 CPU kernel the first time the layer runs in
    eval mode without gradients (a validation pass), and the packed weight then goes through an operation without a
    backward: the next training steps would leave every adapter before the last one without gradient, silently.
    Training keeps the layout it loaded (and so its fingerprint)."""
    for _, module in quantized_linears(model):
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


# ---------------------------------------------------------------- identity and size

def base_fingerprint(model) -> str:
    """SHA-256 of the frozen base as built: every tensor of its state dict that training does not change (the packed
    quantized weights and their quantization constants, the unquantized embeddings, norms and head), by name and
    bytes. The same source quantized by the same bitsandbytes gives the same value, whatever storage dtype a backend
    packs into; another file, revision or bitsandbytes version that quantizes differently gives another."""
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if name in trainable or not isinstance(tensor, torch.Tensor):
            continue
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest.update(name.encode() + b"\0")
        digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def quantized_bytes(model) -> tuple[int, int]:
    """(weights, bytes) of the quantized linear layers: the logical number of weights they hold, and the bytes of
    their packed storage and quantization constants (absmax, code maps, the second level of double quantization)."""
    weights = stored = 0
    for _, module in quantized_linears(model):
        weight = module.weight
        state = getattr(weight, "quant_state", None)
        if state is not None:  # 4-bit: the packed tensor holds two weights per byte, in any storage dtype
            weights += math.prod(state.shape)
            stored += weight.numel() * weight.element_size()
            stored += sum(t.numel() * t.element_size() for t in state_tensors(state))
        else:  # 8-bit: one byte per weight, and one fp32 scale per output row
            weights += weight.numel()
            stored += weight.numel() * weight.element_size()
            scale = getattr(weight, "SCB", None)
            stored += scale.numel() * scale.element_size() if scale is not None else 0
    return weights, stored


def state_tensors(state) -> list[torch.Tensor]:
    """The tensors of a bitsandbytes QuantState, its nested one (double quantization) included."""
    tensors = [t for t in (state.absmax, state.code) if isinstance(t, torch.Tensor)]
    if getattr(state, "state2", None) is not None:
        tensors += state_tensors(state.state2)
        tensors += [state.offset] if isinstance(state.offset, torch.Tensor) else []
    return tensors


def bytes_per_weight(settings: Mapping[str, Any], in_features: int) -> float:
    """Storage per weight of a quantized linear layer with `in_features` inputs: 4-bit, half a byte plus one absmax
    per block of 64 (fp32; with double quantization 8 bits, plus one fp32 per 256 such constants); 8-bit, one byte
    plus one fp32 scale per output row. The code maps (16 or 256 values per layer) are left out."""
    if settings["load_in_8bit"]:
        return 1 + 4 / in_features
    if settings["bnb_4bit_use_double_quant"]:
        return 0.5 + 1 / BLOCK_SIZE + 4 / (BLOCK_SIZE * DOUBLE_QUANT_BLOCK)
    return 0.5 + 4 / BLOCK_SIZE


# ---------------------------------------------------------------- merging

def dequantized_weight(module: Any) -> torch.Tensor:
    """A bitsandbytes layer's weight as an fp32 tensor: the values its forward multiplies by (transformers'
    dequantization, 4-bit and 8-bit)."""
    from transformers.integrations.bitsandbytes import dequantize_bnb_weight

    return dequantize_bnb_weight(module.weight, getattr(module, "state", None)).float()


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
    return linear


def merge_into_dequantized(peft_model, dtype: torch.dtype) -> nn.Module:
    """The plain transformers model that `peft_model` (an adapter over a quantized base) computes: each quantized
    layer dequantized to fp32 with its adapter's delta added there (PEFT's get_delta_weight), then stored in `dtype`;
    everything else cast to `dtype`. Layer by layer, so the memory it takes is the merged model plus one fp32 layer.
    PEFT's own merge would quantize the sum again, losing the adapter in the rounding. Consumes `peft_model`."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    adapter = peft_model.active_adapter
    replacements: dict[str, nn.Module] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            lora: Any = module  # PEFT's LoRA layers type their pieces loosely
            layer = lora.get_base_layer()
            with torch.no_grad():
                weight = dequantized_weight(layer) if is_bnb_layer(layer) else layer.weight.detach().float()
                if adapter in lora.lora_A:
                    weight += lora.get_delta_weight(adapter).float()
            replacements[name] = plain_linear(weight, layer.bias, dtype)
    for name, module in quantized_linears(base):
        if not any(name == done or name.startswith(done + ".") for done in replacements):
            with torch.no_grad():
                replacements[name] = plain_linear(dequantized_weight(module), module.bias, dtype)
    for name, replacement in replacements.items():
        parent, _, child = name.rpartition(".")
        setattr(base.get_submodule(parent) if parent else base, child, replacement)
    forget_quantization(base)
    return base.to(dtype)


def is_bnb_layer(module: nn.Module) -> bool:
    return hasattr(module.weight, "quant_state") or type(module.weight).__name__ == "Int8Params"


def forget_quantization(model) -> None:
    """Drop transformers' marks of a quantized model from one that no longer is (a dequantized merge, or GGUF weights
    that arrive dequantized), so it casts and saves as plain weights."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    for submodel in model.modules():  # transformers marks every PreTrainedModel inside a quantized one
        if hasattr(getattr(submodel, "config", None), "_is_quantized"):
            submodel.config._is_quantized = False


@torch.no_grad()
def prompt_logits(model, tokenizer) -> list[torch.Tensor]:
    """fp32 logits of MERGE_CHECK_PROMPTS, one prompt at a time (no padding), on the CPU."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        return [model(input_ids=torch.tensor([tokenizer(text)["input_ids"]], device=device)).logits[0].float().cpu()
                for text in MERGE_CHECK_PROMPTS]
    finally:
        model.train(was_training)


def logit_gap(before: list[torch.Tensor], after: list[torch.Tensor]) -> dict[str, float]:
    """The largest and the mean absolute logit difference over every position of the prompts, and the largest
    logit's magnitude, for scale."""
    differences = torch.cat([(a - b).abs().flatten() for a, b in zip(after, before)])
    return {"max": float(differences.max()), "mean": float(differences.mean()),
            "scale": float(max(t.abs().max() for t in before))}


def merge_measured(peft_model, tokenizer, dtype: str) -> tuple[nn.Module, str]:
    """(the merged model, the line that says what it is and the gap it leaves) of an adapter over a quantized base:
    merge_into_dequantized, with the logits of the fixed prompts compared before and after. Consumes `peft_model`."""
    settings = quantization_settings(peft_model.get_base_model().config.quantization_config.to_dict())
    keep_weight_layout(peft_model)  # the fp32 kernel training computed with, not the CPU's bf16 repacking
    before = prompt_logits(peft_model, tokenizer)
    merged = merge_into_dequantized(peft_model, DTYPES[dtype])
    return merged, merge_gap_line(settings, dtype, logit_gap(before, prompt_logits(merged, tokenizer)))


def merge_gap_line(settings: Mapping[str, Any], dtype: str, gap: Mapping[str, float]) -> str:
    """What a merged model of a quantized base is, and how far it is from what was trained: the one line training and
    export log, and the model card's."""
    return (f"the merged model is the {describe_settings(settings)} base dequantized, plus the LoRA adapter, "
            f"merged in fp32 and stored in {dtype}; against the quantized base with its adapter, its logits on "
            f"{len(MERGE_CHECK_PROMPTS)} fixed prompts differ by at most {gap['max']:.3g} (mean {gap['mean']:.3g}; "
            f"largest logit {gap['scale']:.3g})")
