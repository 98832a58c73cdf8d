"""Loading a model and tokenizer from a Hub id, a local folder, a GGUF file or a LoRA adapter folder."""

from __future__ import annotations

import contextlib
import functools
import pickle
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError

from gpt4all_training.config.blocks import ModelSource
from gpt4all_training.errors import UserError
from gpt4all_training.model.chat_templates import apply_chat_template_option
from gpt4all_training.model.names import missing_path_error, packaged_model, portable_name, resolved_name
from gpt4all_training.model.quantization import (bnb_config, describe_settings, forget_quantization,
                                                 is_quantizing, quantization_settings)
from gpt4all_training.paths import closest_sibling
from gpt4all_training.readers import parse_json, read_json, read_text, shown_path
from gpt4all_training.run_folder import (CONFIG_FILE, MERGED_DIR, MODEL_DIR, STATE_FILE, is_final_folder,
                                         is_step_folder)

# Files a tokenizer is read from; a folder with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
# The JSON files transformers reads a tokenizer from, where a folder has them, and the chat template's text file.
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "vocab.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def model_source(name: str, gguf_file: str | None = None, key: str = "model_name") -> tuple[str, dict[str, Any]]:
    """Split `model_name` into what from_pretrained takes: a packaged model's short name (model/names.py) or a
    `.gguf` path becomes its folder plus `gguf_file`. A path-like name that does not exist is refused here, before
    anything asks the Hub. `key` is the config key that named it, for the error lines."""
    packaged = packaged_model(name, key)
    if packaged is not None:
        return str(packaged.parent), {"gguf_file": packaged.name}
    if name.endswith(".gguf"):
        path = Path(name)
        if not path.is_file():
            meant = closest_sibling(path)
            raise UserError(f"{key}: GGUF file {name} not found" + (f"; did you mean {meant}?" if meant else ""))
        return str(path.parent), {"gguf_file": path.name}
    if gguf_file:
        return name, {"gguf_file": gguf_file}
    if (missing := missing_path_error(name, key)) is not None:
        raise missing
    path = Path(name).expanduser()
    if (path / MODEL_DIR).is_dir() and (path / STATE_FILE).is_file():
        instead = (f"give its model folder, {path / MODEL_DIR} (a checkpoint holds no tokenizer: set tokenizer_name to "
                   f"the base model)" if key == "model_name" else "give the base model's tokenizer")
        raise UserError(f"{key}: {name} is a training checkpoint; {instead}")
    return name, {}


def refusal(what: str, exc: Exception) -> UserError | None:
    """transformers' two refusals to run a stranger's code, as one line naming `what`; None for other errors."""
    if isinstance(exc, pickle.UnpicklingError):  # torch.load(weights_only=True) met a pickle that is not tensors
        return UserError(f"{what}: a .bin/pickle weights file holds objects other than tensors, and loading them "
                         f"could run code; refused. Use safetensors weights, or a file from a source you trust")
    if isinstance(exc, ValueError) and "trust_remote_code" in str(exc):
        return UserError(f"{what}: ships its own Python code (auto_map in its config); set trust_remote_code: true "
                         f"only if you have read that code and trust it")
    return None


def is_adapter_folder(name: str) -> bool:
    return (Path(name) / "adapter_config.json").is_file()


@contextlib.contextmanager
def loading_errors(what: str):
    """from_pretrained failures a user can fix become one UserError line: a missing or unreadable model, custom code
    without trust_remote_code, a pickle that would run code. Anything else is a bug and raises as it is."""
    try:
        yield
    except OSError as exc:
        raise UserError(f"{what}: cannot load ({str(exc).splitlines()[0]})") from None
    except SafetensorError as exc:
        reason = (str(exc).splitlines() or [""])[0][:200]
        raise UserError(f"{what}: unreadable safetensors weights ({reason}); the file is corrupt or cut short: copy "
                        f"or export it again") from None
    except (ValueError, pickle.UnpicklingError) as exc:
        refused = refusal(what, exc)
        if refused is None:
            raise
        raise refused from None


@contextlib.contextmanager
def gguf_parsed_once():
    """While this lasts, each GGUF file's header is parsed once and gguf's tensor-name table built once per
    architecture. transformers parses a file's header anew for the config, the tokenizer and the weights, and
    rebuilds the tensor-name table for every module of the model (hundreds of times); each depends only on its
    arguments, and together they were most of a GGUF model's load time. Nested uses share the outer one's parses."""
    import gguf

    if hasattr(gguf.get_tensor_name_map, "cache_info"):
        yield
        return
    originals = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(gguf.GGUFReader)  # transformers imports both by name at each call
    gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = originals


def load_tokenizer(name: str, revision: str | None = None, gguf_file: str | None = None,
                   trust_remote_code: bool = False, key: str = "model_name"):
    """A fast tokenizer with a pad token: EOS stands in when the model has none (no new tokens are ever added).
    `key` is the config key that named it, for the error lines."""
    from transformers import AutoTokenizer

    source, extra = model_source(name, gguf_file, key)
    if is_adapter_folder(source) and not (Path(source) / "tokenizer_config.json").is_file():
        source, extra = model_source(adapter_base(source), None, key)  # a GGUF base: its folder and file
    folder = Path(source).expanduser()
    if not extra and folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        # transformers would build an empty tokenizer (one token, every text encoded as nothing) from such a folder.
        raise UserError(f"{key}: {name} holds no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...); set "
                        f"tokenizer_name to the model the tokenizer comes from")
    try:
        with loading_errors(f"{key} {name}"):
            if not extra and saved_as_generic_tokenizer(folder):
                # transformers 5 rebuilds some families' tokenizers (Qwen2's) in their own class whatever a
                # folder's tokenizer.json says, so another tokenizer saved with such a model (a trained one, an
                # `init: from_config` run's) would split text otherwise than when it was saved.
                from transformers import TokenizersBackend

                tokenizer = TokenizersBackend.from_pretrained(source)
            else:
                with gguf_parsed_once() if extra.get("gguf_file") else contextlib.nullcontext():
                    tokenizer = AutoTokenizer.from_pretrained(source, revision=revision, use_fast=True,
                                                              trust_remote_code=trust_remote_code, **extra)
    except Exception:
        # transformers reads these files with json.load and indexes what it gets, so a damaged one surfaces as
        # whichever error that meets first (JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, ...),
        # naming no file: find the file, or let the error stand when every file reads.
        problem = None if extra else tokenizer_file_problem(folder, f"{key} {name}: tokenizer file")
        if problem is None:
            raise
        raise problem from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_file_problem(folder: Path, what: str) -> UserError | None:
    """The first of `folder`'s tokenizer files that is not UTF-8 text, or (TOKENIZER_JSON_FILES) not a JSON object,
    or a tokenizer.json that `tokenizers` cannot read, as one line naming it after `what`; None when all of them
    read."""
    from tokenizers import Tokenizer

    advice = "restore the file from where the model came from"
    for path in (folder / name for name in (*TOKENIZER_JSON_FILES, CHAT_TEMPLATE_FILE)):
        if not path.is_file():
            continue
        try:
            text = read_text(path, what)
        except UserError as exc:  # not UTF-8: the line says what to do
            return exc
        if path.name == CHAT_TEMPLATE_FILE:
            continue
        try:
            content = parse_json(text, f"{what} {shown_path(path)}")
        except UserError as exc:
            return UserError(f"{exc}; {advice}")
        if not isinstance(content, dict):
            return UserError(f"{what} {shown_path(path)}: expected a JSON object, got {type(content).__name__}; "
                             f"{advice}")
        if path.name == "tokenizer.json":
            try:
                Tokenizer.from_file(str(path))
            except Exception as exc:  # the Rust library raises the base class, with serde's reason
                reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
                return UserError(f"{what} {shown_path(path)}: not a tokenizer the tokenizers library can read "
                                 f"({reason}); {advice}")
    return None


def saved_as_generic_tokenizer(folder: Path) -> bool:
    """Whether a local folder's tokenizer was saved as a plain tokenizer.json tokenizer, not a family's class."""
    config = folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").is_file() or not config.is_file():
        return False
    saved = read_json(config, "tokenizer")
    return isinstance(saved, dict) and saved.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")


def tokenizer_for(config: ModelSource):
    """The tokenizer a train, inference, generate, plan or check config names (its model's, unless tokenizer_name),
    with the config's chat_template when it sets one."""
    name = config.tokenizer_name or config.model_name
    assert name is not None  # validate() requires one of them
    tokenizer = load_tokenizer(name, config.model_revision, config.gguf_file, config.trust_remote_code,
                               "tokenizer_name" if config.tokenizer_name else "model_name")
    return apply_chat_template_option(tokenizer, config.chat_template)


def adapter_base(adapter_dir: str) -> str:
    """The base model an adapter names, as loading code can open it: a packaged model recorded by its short name
    (or, by adapters saved before short names, by a path inside some installation's venv) is this installation's."""
    path = Path(adapter_dir) / "adapter_config.json"
    config = read_json(path, "adapter")
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(base, str) or not base:
        raise UserError(f"adapter {path}: names no base model (base_model_name_or_path); set it, or name the "
                        f"base model (export: --base)")
    return resolved_name(base)


def is_checkpoint(path: Path) -> bool:
    return is_step_folder(path) and (path / MODEL_DIR).is_dir()


def training_run_config(name: str) -> tuple[Path, dict[str, Any]] | None:
    """(its file, the config) of the training run that wrote the model at `name`: the config.yaml in a checkpoint
    `step_N/` or in `final/`, also found from their `model/` and `merged/` folders; None for any other model."""
    path = Path(name)
    folders = [path, path.parent] if path.name in (MODEL_DIR, MERGED_DIR) else [path]
    for folder in folders:
        file = folder / CONFIG_FILE
        if file.is_file() and (is_checkpoint(folder) or is_final_folder(folder)):
            run = yaml.safe_load(file.read_text(encoding="utf-8"))
            return (file, run) if isinstance(run, dict) else None
    return None


def adapter_quantization(adapter_dir: str, dtype: torch.dtype):
    """The bitsandbytes config of the base an adapter was trained over, as its training run's config.yaml (beside it
    in final/ or step_N/) records it, computing in `dtype`; None for an unquantized base or an adapter without its
    run. An adapter trained over a quantized base is loaded over the same quantized base: the function it learned."""
    found = training_run_config(adapter_dir)
    settings = quantization_settings(found[1] if found else {})
    return bnb_config(settings, dtype) if is_quantizing(settings) else None


def describe_quantization(adapter_dir: str) -> str | None:
    """'4-bit nf4, double quantization' for an adapter trained over a quantized base (its run's config.yaml)."""
    found = training_run_config(adapter_dir)
    settings = quantization_settings(found[1] if found else {})
    return describe_settings(settings) if is_quantizing(settings) else None


def load_model(name: str, revision: str | None = None, gguf_file: str | None = None,
               trust_remote_code: bool = False, dtype: torch.dtype = torch.float32, key: str = "model_name", *,
               quantization=None, device: torch.device | None = None):
    """An AutoModelForCausalLM in `dtype`; with `quantization` (a bitsandbytes config) its linear layers quantized as
    they load, on `device` (None: the CPU). An adapter folder loads as base plus adapter (a PeftModel), the base
    quantized as its training run's was unless `quantization` says otherwise. `key` is the option that named it,
    for the error lines."""
    from transformers import AutoModelForCausalLM

    if is_adapter_folder(name):
        from peft import PeftModel

        quantization = quantization or adapter_quantization(name, dtype)
        base = load_model(adapter_base(name), revision, None, trust_remote_code, dtype, key,
                          quantization=quantization, device=device)
        with loading_errors(f"{key} {name}"):
            return PeftModel.from_pretrained(base, name)
    source, extra = model_source(name, gguf_file, key)
    if quantization is not None:
        extra["quantization_config"] = quantization
        if device is not None:
            extra["device_map"] = {"": device}
    # transformers 5 always builds the model empty and loads weights into it (what low_cpu_mem_usage was), and
    # under ZeRO-3 partitions each parameter as it is built, so no rank ever holds a whole fp32 copy.
    with loading_errors(f"{key} {name}"), gguf_parsed_once() if extra.get("gguf_file") else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(source, revision=revision, dtype=dtype,
                                                     trust_remote_code=trust_remote_code, **extra)
    if extra.get("gguf_file"):
        if quantization is None:
            # GGUF weights arrive dequantised; drop the quantisation marker so the model saves as plain safetensors.
            forget_quantization(model)
        # Recorded as the base of any adapter trained on it, so the adapter folder alone finds its base again: a
        # packaged model by its short name, which every installation resolves (not a path inside this venv).
        model.name_or_path = portable_name(Path(source) / extra["gguf_file"])
    return model


def model_config(name: str, revision: str | None = None, gguf_file: str | None = None,
                 trust_remote_code: bool = False, key: str = "model_name"):
    """The model's config without its weights (an adapter's base's): what the checks before the data read."""
    from transformers import AutoConfig

    if is_adapter_folder(name):
        name, revision, gguf_file = adapter_base(name), None, None
    source, extra = model_source(name, gguf_file, key)
    with loading_errors(f"{key} {name}"):
        return AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code, **extra)


def check_positions(model_or_config, max_length: int) -> None:
    """Refuse a max_length beyond the model's table of positions: the first example that long would fail inside the
    forward pass (an index out of range). Given the model's config, before the data is tokenised."""
    config = getattr(model_or_config, "config", model_or_config)
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if positions and max_length > positions:
        raise UserError(f"max_length: {max_length} exceeds the model's {positions} positions; set max_length to at "
                        f"most {positions}")
