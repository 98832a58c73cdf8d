"""A merged model and its tokenizer as one GGUF file, written by llama.cpp's own converter and quantizer.

Why these tools: a GGUF is correct when llama.cpp reads it as transformers runs the model, and llama.cpp's own
converter (convert_hf_to_gguf, from the `convert-hf-to-gguf` package) is where each architecture's layout lives:
tensor names, the q/k row permutation, Llama 3's `rope_freqs`, Gemma's +1 on norm weights and its soft-capping and
sliding-window keys, Phi-3's fused projections, the pre-tokenizer table. Copying that by hand grows with every
architecture and goes wrong in the details (what peers' GGUF bug reports are about). The k-quants have no Python
quantizer at all; llama.cpp's `llama_model_quantize` decides each tensor's type as `llama-quantize` does.
export/llama_cpp.py says where each tool comes from and why; neither needs a compiler.

How a file is written: the merged fp32 model is saved as a model folder, the converter writes F32, F16, BF16 or
Q8_0 from it, and for Q4_0 and the k-quants llama.cpp's quantizer quantizes the F32 file (quantizing once from full
precision). What this project adds on top, in the converter's own hooks (export/convert_worker.py):
- the pre-tokenizer name: the split that the tokenizer which trained the model has (tokenizer.json's
  pre_tokenizer) where pre_tokenizer_name can name it, else the name llama.cpp's table holds for the tokenizer's
  hash. transformers reads SmolLM2's vocabulary from its GGUF without the digit split the file declares (`smollm`),
  so a model fine-tuned from that base was trained on GPT-2's split, and its file says `gpt-2`. On SmolLM2's
  vocabulary the two splits give the same tokens (none of its tokens joins a digit to anything), which llama.cpp's
  table shows too: its hash of the fine-tune's tokenizer is SmolLM's. `gpt-2` is as true and older readers (GPT4All
  2.8.2) know it;
- the chat template's end-of-turn token as EOS and EOT: GPT4All 2.x stops at EOS only;
- general.name, the base's license and the sampling settings the model was evaluated with (SAMPLING).
Families whose vocabulary the converter reads only from a SentencePiece model (Gemma 2, Phi-3; Llama 2 and Gemma 3
when there is one) get the base model's tokenizer.model, which transformers 5 no longer saves with a tokenizer.

What can be written (ARCHITECTURES x TYPES): every listed architecture in every type, Q4_0 and the k-quants once
llama.cpp's quantizer is installed (make install). Anything else is refused in one line that says what can be
written, and so is a Gemma 3 configuration that llama.cpp would run otherwise than transformers (gemma3_difference).
GPT-J is refused: llama.cpp names the architecture but has no graph for it (the name was reserved for GPT4All's own
GPT-J backend, which GPT4All later dropped), and transformers has no GGUF reader for it.

As the gguf export format (export/formats.py), `write_export` writes the file, an Ollama Modelfile beside it, and the
model card's lines on how llama.cpp reading the file agrees with the merged model (export/agreement.py).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpt4all_training.errors import UserError
from gpt4all_training.export import llama_cpp
from gpt4all_training.export.agreement import measure
from gpt4all_training.export.formats import ExportRequest, ExportSource, Written
from gpt4all_training.export.template import SAMPLING, ollama_modelfile, sampling_card, template_end_of_turn

if TYPE_CHECKING:  # transformers loads in the functions that need it, not on import
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class GGUFType:
    file_name: str  # the type as file names and llama.cpp print it: Q4_K_M
    converter: str  # the gguf.LlamaFileType the converter writes
    quantize: bool  # then quantized by llama.cpp's quantizer to the llama_ftype MOSTLY_<file_name>


TYPES = {
    "f32": GGUFType("F32", "ALL_F32", False), "f16": GGUFType("F16", "MOSTLY_F16", False),
    "bf16": GGUFType("BF16", "MOSTLY_BF16", False), "q8_0": GGUFType("Q8_0", "MOSTLY_Q8_0", False),
    "q4_0": GGUFType("Q4_0", "ALL_F32", True), "q4_k_m": GGUFType("Q4_K_M", "ALL_F32", True),
    "q5_k_m": GGUFType("Q5_K_M", "ALL_F32", True), "q6_k": GGUFType("Q6_K", "ALL_F32", True),
}
CONVERTER_TYPES = tuple(name for name, gguf_type in TYPES.items() if not gguf_type.quantize)
# transformers' model_type -> llama.cpp's general.architecture, for the families written and checked here.
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                 "gemma3_text": "gemma3", "phi3": "phi3", "smollm3": "smollm3", "gpt_neox": "gptneox"}
GPTJ_REFUSAL = ("--format gguf: GPT-J cannot be exported as GGUF because no GGUF reader runs it (transformers has no "
                "GPT-J GGUF loader and llama.cpp has no GPT-J graph); use --format hf, or fine-tune a Llama-"
                "architecture base such as SmolLM2")

# What llama.cpp calls the pre-tokenizer (its `tokenizer.ggml.pre`), recognised from tokenizer.json's pre_tokenizer.
GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
SMOLLM_PRE_TOKENIZER = [{"type": "Digits", "individual_digits": True}, GPT2_PRE_TOKENIZER]


def check_architecture(config: PretrainedConfig, dtype: str) -> None:
    """Refuse, in one line that says what can be written, a model or type that no tool here writes."""
    model_type = getattr(config, "model_type", None)
    if model_type == "gptj":
        raise UserError(GPTJ_REFUSAL)
    if model_type not in ARCHITECTURES:
        raise UserError(f"--format gguf: model type {model_type!r} is not supported; GGUF is written for "
                        f"{', '.join(sorted(ARCHITECTURES))}; use --format hf")
    if model_type == "gemma3_text" and (difference := gemma3_difference(config)):
        raise UserError(f"--format gguf: llama.cpp would run this Gemma 3 otherwise than transformers: {difference}; "
                        f"the released Gemma 3 text configurations export; use --format hf")
    if TYPES[dtype].quantize and not llama_cpp.QUANTIZER_LIBRARY.is_file():
        raise UserError(f"--dtype {dtype}: llama.cpp's quantizer is not installed ({llama_cpp.QUANTIZER_LIBRARY}); "
                        f"install it with `bash scripts/install_llama_quantizer.sh {llama_cpp.QUANTIZER_DIR}` (make "
                        f"install does, on Linux x86-64 with npm), or write one of {', '.join(CONVERTER_TYPES)}")


def gemma3_difference(config) -> str | None:
    """What of a Gemma 3 config llama.cpp does not read from the file but fixes for every Gemma 3 (its
    llama_model_loader for the architecture), so that the file would run otherwise than transformers; None when
    nothing. Measured on tiny models: each of these moves the logits by 1.6-4.2 where the file is otherwise exact."""
    layers = config.num_hidden_layers
    pattern = ["full_attention" if layer % 6 == 5 else "sliding_attention" for layer in range(layers)]
    if list(config.layer_types) != pattern:
        return "its layer_types (llama.cpp makes every sixth layer full attention and the others sliding-window)"
    # llama.cpp scales queries by 1/sqrt(head_dim), and by 1/sqrt(hidden/heads) for the 62-layer (27B) model.
    scalar = config.hidden_size // config.num_attention_heads if layers == 62 else config.head_dim
    if config.query_pre_attn_scalar != scalar:
        return f"query_pre_attn_scalar {config.query_pre_attn_scalar} (llama.cpp scales queries by 1/sqrt({scalar}))"
    sliding = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention") or {}
    if sliding.get("rope_type", "default") != "default":
        return "RoPE scaling on its sliding-window layers (llama.cpp scales only the full-attention layers)"
    return None


def pre_tokenizer_name(tokenizer) -> str | None:
    """llama.cpp's name for how the tokenizer splits text before BPE, from tokenizer.json; None for a split it has
    no name for here (the converter's hash table may still know the tokenizer)."""
    pre = json.loads(tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence":
        pre = [_pre_tokenizer_core(step) for step in pre["pretokenizers"]]
    else:
        pre = _pre_tokenizer_core(pre)
    if pre == GPT2_PRE_TOKENIZER:
        return "gpt-2"
    if pre == SMOLLM_PRE_TOKENIZER:
        return "smollm"
    return None


def _pre_tokenizer_core(step: dict) -> dict:
    kinds = {"ByteLevel": ("add_prefix_space", "use_regex"), "Digits": ("individual_digits",)}
    keys = kinds.get(step.get("type", ""), ())
    return {"type": step.get("type"), **{key: step.get(key) for key in keys}} if keys else step


def gguf_name(name: str) -> str:
    """transformers loads a llama file whose general.name says "mistral" as Mistral; keep that word out."""
    cleaned = re.sub(r"[-_ ]*mistral[-_ ]*", "-", name, flags=re.IGNORECASE).strip("-_ ")
    return cleaned or "model"


def file_metadata() -> dict:
    """general.* keys for the converter's override file: the sampling settings the model was evaluated with."""
    return {f"general.sampling.{key}": value for key, value in SAMPLING.items()}


@dataclass
class Plan:
    """How one GGUF file comes about: the converter's job, then llama.cpp's quantizer when the type needs it."""

    convert: llama_cpp.ConvertJob
    quantize: tuple[Path, Path, int] | None  # (the converter's F32 file, the file, llama_ftype)


def plan(folder: Path, tokenizer, path: Path, dtype: str, name: str) -> Plan:
    """The jobs that write `path` from a saved model folder (see save_for_conversion)."""
    import gguf

    gguf_type = TYPES[dtype]
    converted = folder.with_name(f"{folder.name}-F32.gguf") if gguf_type.quantize else path
    job = llama_cpp.ConvertJob(folder, converted, gguf_type.converter, gguf_name(name),
                               pre_tokenizer_name(tokenizer), template_end_of_turn(tokenizer),
                               file_metadata())
    quantize = ((converted, path, int(gguf.LlamaFileType[f"MOSTLY_{gguf_type.file_name}"])) if gguf_type.quantize
                else None)
    return Plan(job, quantize)


def sentencepiece_model(tokenizer, sources: Sequence[str | None] = ()) -> Path | None:
    """The SentencePiece model (tokenizer.model) whose pieces are the tokenizer's first tokens: from the tokenizer's
    own folder, else from `sources` (the base model: a folder, or a Hub id in the local cache); None if none."""
    from huggingface_hub import try_to_load_from_cache
    from sentencepiece import SentencePieceProcessor

    for source in (getattr(tokenizer, "name_or_path", None), *sources):
        if not source:
            continue
        candidate: Path | None
        if Path(source).is_dir():
            candidate = Path(source) / "tokenizer.model"
        elif Path(source).exists() or source.count("/") != 1:  # a file (a GGUF base), or not a Hub id
            continue
        else:
            cached = try_to_load_from_cache(source, "tokenizer.model")
            candidate = Path(cached) if isinstance(cached, str) else None
        if candidate is None or not candidate.is_file():
            continue
        pieces = SentencePieceProcessor(model_file=str(candidate))
        count = pieces.get_piece_size()
        if count <= len(tokenizer) and [pieces.id_to_piece(i) for i in range(count)] == \
                tokenizer.convert_ids_to_tokens(list(range(count))):
            return candidate
    return None


def save_for_conversion(model, tokenizer, folder: Path, license_id: str | None = None,
                        sentencepiece: Path | None = None) -> Path:
    """The merged model as the converter reads it: fp32 safetensors, config and tokenizer files, a model card whose
    front matter gives the license (the converter takes general.license from there) and, when given, the tokenizer's
    SentencePiece model. Next to a SentencePiece model the converter takes the added tokens (special or not) from
    tokenizer_config.json's added_tokens_decoder, where transformers 4 wrote them and transformers 5 no longer does."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if license_id:
        (folder / "README.md").write_text(f"---\nlicense: {license_id}\n---\n", encoding="utf-8")
    if sentencepiece is not None:
        shutil.copy(sentencepiece, folder / "tokenizer.model")
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["added_tokens_decoder"] = {str(index): {"content": token.content, "special": token.special}
                                          for index, token in sorted(tokenizer.added_tokens_decoder.items())}
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    return folder


def write_gguf(model, tokenizer, folder: Path, dtype: str, name: str, license_id: str | None = None,
               tokenizer_sources: Sequence[str | None] = ()) -> Path:
    """Write `model` (fp32, merged) and `tokenizer` as `folder/<name>-<TYPE>.gguf`; returns the file.
    `tokenizer_sources`: where else the tokenizer's SentencePiece model may be (the base model)."""
    check_architecture(model.config, dtype)
    path = folder / f"{name}-{TYPES[dtype].file_name}.gguf"
    with tempfile.TemporaryDirectory(dir=folder, prefix="convert-") as scratch:  # on the output's disk
        saved = save_for_conversion(model, tokenizer, Path(scratch) / "model", license_id,
                                    sentencepiece_model(tokenizer, tokenizer_sources))
        steps = plan(saved, tokenizer, path, dtype, name)
        llama_cpp.convert([steps.convert])
        if steps.quantize:
            llama_cpp.quantize([steps.quantize])
    return path


def write_export(source: ExportSource, folder: Path, request: ExportRequest) -> Written:
    """The gguf format: the file, an Ollama Modelfile beside it, and what the model card adds: how often llama.cpp
    reading the file agrees with the merged model, and the sampling settings for the pre-tokenizer it declares."""
    path = write_gguf(source.model, source.tokenizer, folder, request.dtype, request.name,
                      source.license.get("license"), (source.run.config.get("tokenizer_name"), source.base_name))
    (folder / "Modelfile").write_text(ollama_modelfile(path.name, source.tokenizer), encoding="utf-8")
    agreement = measure(path, source.model, source.tokenizer)
    pre = read_gguf_strings(path, ("tokenizer.ggml.pre",)).get("tokenizer.ggml.pre")
    return Written(agreement.card() + sampling_card(pre), agreement)


def read_gguf_strings(path: str | Path, keys: tuple[str, ...]) -> dict[str, str]:
    """The string fields among `keys` of a GGUF file's metadata (the license, the pre-tokenizer)."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    return {key: str(fields[key].contents()) for key in keys if key in fields}
