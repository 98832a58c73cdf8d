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
- the pre-tokenizer name when llama.cpp's hash table does not know the tokenizer (a fine-tune's own tokenizer, or
  one read back from a GGUF, which transformers returns without the digit split): the base GGUF's name when the
  training tokenizer came from it, else the name tokenizer.json's split has in llama.cpp;
- the chat template's end-of-turn token as EOS and EOT: GPT4All 2.x stops at EOS only;
- general.name, the base's license and the sampling settings the model was evaluated with (SAMPLING).

What can be written (ARCHITECTURES x TYPES): every listed architecture in F32, F16, BF16 and Q8_0; Q4_0 and the
k-quants for the architectures the installed quantizer knows (llama_cpp.QUANTIZER_ARCHITECTURES). Anything else is
refused in one line that says what can be written. GPT-J is refused: llama.cpp names the architecture but has no
graph for it (the name was reserved for GPT4All's own GPT-J backend, which GPT4All later dropped), and transformers
has no GGUF reader for it.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpt4all_training.errors import UserError
from gpt4all_training.export import llama_cpp
from gpt4all_training.export.template import SAMPLING, template_end_of_turn

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
# Gemma 3 is left out: llama.cpp b11549 reads the converter's Gemma 3 file with logits far from transformers' (even
# at the first position), so the file would not be the model that was trained.
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                 "phi3": "phi3", "smollm3": "smollm3", "gpt_neox": "gptneox"}
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
    architecture = ARCHITECTURES[model_type]
    if TYPES[dtype].quantize and architecture not in llama_cpp.QUANTIZER_ARCHITECTURES:
        raise UserError(f"--dtype {dtype}: llama.cpp's quantizer installed here (gpt4all 2.8.2's, mid-2024) predates "
                        f"{architecture}; for {model_type} write one of {', '.join(CONVERTER_TYPES)} (and quantize "
                        f"it with a current llama-quantize)")


def pre_tokenizer_name(tokenizer, base_pre: str | None = None) -> str | None:
    """llama.cpp's name for how text is split before BPE, from tokenizer.json; None for a split it has no name for
    here (the converter's hash table may still know the tokenizer)."""
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


def plan(folder: Path, tokenizer, path: Path, dtype: str, name: str, base_pre_tokenizer: str | None = None) -> Plan:
    """The jobs that write `path` from a saved model folder (see save_for_conversion)."""
    import gguf

    gguf_type = TYPES[dtype]
    converted = folder.with_name(f"{folder.name}-F32.gguf") if gguf_type.quantize else path
    job = llama_cpp.ConvertJob(folder, converted, gguf_type.converter, gguf_name(name),
                               pre_tokenizer_name(tokenizer, base_pre_tokenizer), template_end_of_turn(tokenizer),
                               file_metadata())
    quantize = ((converted, path, int(gguf.LlamaFileType[f"MOSTLY_{gguf_type.file_name}"])) if gguf_type.quantize
                else None)
    return Plan(job, quantize)


def save_for_conversion(model, tokenizer, folder: Path, license_id: str | None = None) -> Path:
    """The merged model as the converter reads it: fp32 safetensors, config and tokenizer files, a model card whose
    front matter gives the license (the converter takes general.license from there), and the SentencePiece model
    of the folder the tokenizer came from (transformers 5 no longer saves it; the converter reads Gemma 2's and
    Phi-3's vocabulary from it)."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if license_id:
        (folder / "README.md").write_text(f"---\nlicense: {license_id}\n---\n", encoding="utf-8")
    sentencepiece = Path(getattr(tokenizer, "name_or_path", "") or "") / "tokenizer.model"
    if sentencepiece.is_file():
        shutil.copy(sentencepiece, folder / "tokenizer.model")
    return folder


def write_gguf(model, tokenizer, folder: Path, dtype: str, name: str, license_id: str | None = None,
               base_pre_tokenizer: str | None = None) -> Path:
    """Write `model` (fp32, merged) and `tokenizer` as `folder/<name>-<TYPE>.gguf`; returns the file."""
    check_architecture(model.config, dtype)
    path = folder / f"{name}-{TYPES[dtype].file_name}.gguf"
    with tempfile.TemporaryDirectory(dir=folder, prefix="convert-") as scratch:  # on the output's disk
        saved = save_for_conversion(model, tokenizer, Path(scratch) / "model", license_id)
        steps = plan(saved, tokenizer, path, dtype, name, base_pre_tokenizer)
        llama_cpp.convert([steps.convert])
        if steps.quantize:
            llama_cpp.quantize([steps.quantize])
    return path


def read_gguf_strings(path: str | Path, keys: tuple[str, ...]) -> dict[str, str]:
    """The string fields among `keys` of a GGUF file's metadata (the license, the pre-tokenizer)."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    return {key: str(fields[key].contents()) for key in keys if key in fields}
