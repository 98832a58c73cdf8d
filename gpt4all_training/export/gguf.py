"""Writing a Llama-architecture model and its tokenizer as one GGUF file (llama.cpp, GPT4All, transformers).

Two readers decide what a correct file is: llama.cpp (which GPT4All embeds) and transformers'
`from_pretrained(dir, gguf_file=...)`. The layout below follows what both read:

- Tensor names come from gguf's own name map for LLM_ARCH_LLAMA (`blk.N.attn_q.weight`, ...).
- q and k projections are permuted from Hugging Face's rotate-half layout to llama.cpp's interleaved pairs; the
  key projection uses the KV head count. transformers undoes exactly this on load.
- A tied LM head is left out: both readers then reuse token_embd for the output.
- The tokenizer is a GPT-2-style byte-level BPE (`tokenizer.ggml.model = "gpt2"`): tokens in the byte alphabet,
  merges as "a b" strings, token type 3 (control) for special tokens.
- The chat template goes in `tokenizer.chat_template`, and its end-of-turn token (ChatML's <|im_end|>) in
  `tokenizer.ggml.eot_token_id` and, in place of the tokenizer's own, `tokenizer.ggml.eos_token_id`, as chat models'
  own configs have it (SmolLM2, Qwen): GPT4All 2.x stops at EOS only, and would otherwise write on past the answer.

GPT-J is refused: transformers has no GGUF reader for it, and llama.cpp names the architecture but has no graph
for it (the name was reserved for GPT4All's own GPT-J backend, which GPT4All later dropped).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from gpt4all_training.errors import UserError
from gpt4all_training.export.template import template_end_of_turn

# --dtype -> the GGUF tensor type of every matrix. Vectors (norm weights) always stay F32, as llama.cpp's converter.
TENSOR_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
SUPPORTED_MODEL_TYPES = ("llama",)
GPTJ_REFUSAL = ("--format gguf: GPT-J cannot be exported as GGUF because no GGUF reader runs it (transformers has no "
                "GPT-J GGUF loader and llama.cpp has no GPT-J graph); use --format hf, or fine-tune a Llama-"
                "architecture base such as SmolLM2")

# What llama.cpp calls the pre-tokenizer (its `tokenizer.ggml.pre`), recognised from tokenizer.json's pre_tokenizer.
GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
SMOLLM_PRE_TOKENIZER = [{"type": "Digits", "individual_digits": True}, GPT2_PRE_TOKENIZER]


def check_architecture(config) -> None:
    """Refuse, with the reason, any model this writer cannot lay out correctly."""
    model_type = getattr(config, "model_type", None)
    if model_type == "gptj":
        raise UserError(GPTJ_REFUSAL)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"--format gguf: model type {model_type!r} is not supported (only Llama-architecture "
                        f"models); use --format hf")
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"--format gguf: rope scaling {rope['rope_type']!r} is not supported; use --format hf")


def rope_parameters(config) -> dict[str, Any]:
    """transformers 5 keeps theta and scaling in `rope_parameters`; older configs have `rope_theta`/`rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    scaling = getattr(config, "rope_scaling", None)
    if scaling and "rope_type" not in params:
        params["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return params


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def permute_for_llama_cpp(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of each head go from halves (HF rotate_half: all real parts, then all imaginary) to interleaved pairs.

    The inverse of transformers' `w.reshape(n_head, dim, 2, in).swapaxes(2, 1)` on load.
    """
    dim = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, dim, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama_tensors(model) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, fp32 array in llama.cpp's layout) for every weight the file needs."""
    import gguf

    config = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        stem, _, suffix = hf_name.rpartition(".")
        gguf_stem = name_map.get_name(stem)
        if gguf_stem is None:
            raise UserError(f"--format gguf: weight {hf_name} has no GGUF name; this model is not a plain Llama")
        array = tensor.detach().to(torch.float32).cpu().numpy()
        if gguf_stem.endswith(".attn_q"):
            array = permute_for_llama_cpp(array, config.num_attention_heads)
        elif gguf_stem.endswith(".attn_k"):
            array = permute_for_llama_cpp(array, config.num_key_value_heads)
        yield f"{gguf_stem}.{suffix}", array


def encode_tensor(array: np.ndarray, dtype: str) -> tuple[np.ndarray, Any]:
    """The bytes (or float array) to store and their GGUF type. Vectors stay F32; Q8_0 needs rows of 32."""
    import gguf
    from gguf.quants import QuantError, quantize

    qtype = gguf.GGMLQuantizationType[TENSOR_TYPES[dtype]]
    if array.ndim < 2 or qtype == gguf.GGMLQuantizationType.F32:
        return array, gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), qtype
    try:
        return quantize(array, qtype), qtype
    except QuantError:
        # A row length that is not a multiple of the block size cannot be Q8_0; llama.cpp's converter uses F16 then.
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16


def pre_tokenizer_name(tokenizer, base_pre: str | None = None) -> str:
    """llama.cpp's name for how text is split before BPE. An unknown split is refused: a wrong one mis-tokenises."""
    pre = json.loads(tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence":
        pre = [_pre_tokenizer_core(step) for step in pre["pretokenizers"]]
    else:
        pre = _pre_tokenizer_core(pre)
    if pre == GPT2_PRE_TOKENIZER:
        # A vocabulary read from a GGUF comes back with a plain GPT-2 split; keep the name the base file gave.
        return base_pre or "gpt-2"
    if pre == SMOLLM_PRE_TOKENIZER:
        return "smollm"
    raise UserError(f"--format gguf: the tokenizer's pre-tokenizer {pre} has no llama.cpp name; use --format hf")


def _pre_tokenizer_core(step: dict) -> dict:
    keys = {"ByteLevel": ("add_prefix_space", "use_regex"), "Digits": ("individual_digits",)}.get(step.get("type"), ())
    return {"type": step.get("type"), **{key: step.get(key) for key in keys}} if keys else step


def tokenizer_metadata(tokenizer, vocab_size: int) -> dict[str, Any]:
    """Tokens by id (padded to the model's vocabulary), their types, merges and the special token ids."""
    import gguf

    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    if backend["model"]["type"] != "BPE" or not _is_byte_level(backend):
        raise UserError("--format gguf: only byte-level BPE tokenizers (GPT-2 style) are supported; use --format hf")
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    if len(by_id) > vocab_size:
        raise UserError(f"--format gguf: the tokenizer has {len(by_id)} tokens but the model only {vocab_size}")
    added = {index: token for index, token in tokenizer.added_tokens_decoder.items()}
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")  # llama.cpp's convention for embedding rows with no token
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in backend["model"]["merges"]]
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    end_of_turn = template_end_of_turn(tokenizer)
    return {
        "tokens": tokens, "types": [int(t) for t in types], "merges": merges,
        "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id if end_of_turn is None else end_of_turn,
        "unk": tokenizer.unk_token_id, "pad": tokenizer.pad_token_id,
        "add_bos": len(with_special) > len(plain) and with_special[0] == tokenizer.bos_token_id,
        "add_eos": len(with_special) > len(plain) and with_special[-1] == tokenizer.eos_token_id,
        "chat_template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
        "eot": end_of_turn,
    }


def _is_byte_level(backend: dict) -> bool:
    pre = backend.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return any(step.get("type") == "ByteLevel" for step in steps)


def gguf_name(name: str) -> str:
    """transformers loads a llama file whose general.name says "mistral" as Mistral; keep that word out."""
    cleaned = re.sub(r"[-_ ]*mistral[-_ ]*", "-", name, flags=re.IGNORECASE).strip("-_ ")
    return cleaned or "model"


def write_gguf(model, tokenizer, path: Path, dtype: str, name: str, license_id: str | None = None,
               base_pre_tokenizer: str | None = None) -> Path:
    """Write `model` (fp32, merged) and `tokenizer` to `path` with matrices in `dtype`."""
    import gguf

    config = model.config
    check_architecture(config)
    token_info = tokenizer_metadata(tokenizer, config.vocab_size)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(gguf_name(name))
    if license_id:
        writer.add_license(license_id)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[dtype]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim(config))
    if head_dim(config) != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    writer.add_rope_freq_base(float(rope_parameters(config)["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer, base_pre_tokenizer))
    writer.add_token_list(token_info["tokens"])
    writer.add_token_types(token_info["types"])
    writer.add_token_merges(token_info["merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id),
                     ("eot", writer.add_eot_token_id)):
        if token_info[key] is not None:
            add(token_info[key])
    writer.add_add_bos_token(token_info["add_bos"])
    writer.add_add_eos_token(token_info["add_eos"])
    if token_info["chat_template"]:
        writer.add_chat_template(token_info["chat_template"])

    for tensor_name, array in llama_tensors(model):
        data, qtype = encode_tensor(array, dtype)
        writer.add_tensor(tensor_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_gguf_strings(path: str | Path, keys: tuple[str, ...]) -> dict[str, str]:
    """The string fields among `keys` of a GGUF file's metadata (the license, the pre-tokenizer)."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    return {key: str(fields[key].contents()) for key in keys if key in fields}
