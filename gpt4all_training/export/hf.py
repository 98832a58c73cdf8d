"""Export a trained model for inference in one of the formats of export/formats.py (a slim Hugging Face folder, written
here by `write_hf`, or a GGUF file, by gguf.py): `export` reads and merges the input, writes the format's files with a
model card into a folder of their own and renames it into place.

`--from` takes any of:
- a training checkpoint `step_N/`: the weights in `step_N/model/`; optimiser, scheduler and RNG state are ignored.
  A checkpoint written under DeepSpeed ZeRO-2/3 holds shards instead, which are consolidated to fp32;
- `final/` or `final/merged/`: a full model folder or a PEFT adapter folder;
- an adapter folder whose adapter_config.json names its base (`--base` overrides it);
- any model folder, or a `.gguf` file.

A LoRA adapter is merged in fp32 into fp32 base weights (a GGUF base is dequantised first); only the merged result
is cast to the export dtype. Merging into already-rounded bf16 or quantised weights is what ruins peers' exports.

Both formats carry the chat template and its end-of-turn token (export/template.py); a GGUF gets an Ollama Modelfile.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from safetensors import SafetensorError

from gpt4all_training.config.secrets import scrub
from gpt4all_training.errors import UserError, write_failure
from gpt4all_training.export.agreement import Agreement
from gpt4all_training.export.formats import (ExportFormat, ExportRequest, ExportSource, RunInfo, Written,
                                             chosen_dtype, format_named)
from gpt4all_training.export.gguf import read_gguf_strings
from gpt4all_training.export.template import add_template_to_tokenizer_config, stop_token_ids
from gpt4all_training.backends.deepspeed import deepspeed_pickled_types
from gpt4all_training.files import MARKER, check_tensor_files, marker_problem, new_folder, writable_folder
from gpt4all_training.model.loading import (adapter_base, adapter_quantization, is_adapter_folder, load_model,
                                            load_tokenizer)
from gpt4all_training.model.names import portable_name, resolved_name
from gpt4all_training.model.quantization import (describe_settings, is_quantized, is_quantizing, keep_weight_layout,
                                                 logit_gap, merge_gap_line, merge_measured, prompt_logits,
                                                 quantization_settings)
from gpt4all_training.readers import parse_yaml, read_json, read_model_config, read_text, read_yaml
from gpt4all_training.run_folder import (CONFIG_FILE, MERGED_DIR, METRICS_FILE, MODEL_DIR, STATE_FILE,
                                         is_merged_folder, run_of)
from gpt4all_training.tracking.tracker import read_metrics

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
                "pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# License conditions that travel with a fine-tune, by the license id in the base's metadata.
LICENSE_NOTICES = {
    "llama2": "Llama 2 Community License: keep its notice and acceptable use policy with the model.",
    "llama3": 'Meta Llama 3 License: display "Built with Meta Llama 3"; the model name must begin with "Llama 3".',
    "llama3.1": 'Llama 3.1 Community License: display "Built with Llama"; the model name must begin with "Llama".',
    "llama3.2": 'Llama 3.2 Community License: display "Built with Llama"; the model name must begin with "Llama".',
    "llama3.3": 'Llama 3.3 Community License: display "Built with Llama"; the model name must begin with "Llama".',
    "gemma": "Gemma Terms of Use: pass them and the use restrictions on with the model.",
}


# ---------------------------------------------------------------- reading the input


def read_run_info(source: Path) -> RunInfo:
    folders = [source] if source.is_dir() else []
    if is_merged_folder(source):
        folders.append(source.parent)  # final/config.yaml: the run that trained the adapter merged here
    if (run_dir := run_of(source)) is not None:
        folders.append(run_dir)  # where metrics.jsonl lives
    info = RunInfo()
    if config_path := _first(folders, CONFIG_FILE):
        info.config = run_mapping(read_yaml(config_path, "--from") or {}, config_path)
    if state_path := _first(folders, STATE_FILE):
        info.state = run_mapping(read_json(state_path, "--from"), state_path)
    if metrics_path := _first(folders, METRICS_FILE):
        info.losses, info.last_logged_step = final_losses(metrics_path)
    return info


def run_mapping(value: Any, path: Path) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UserError(f"--from {path}: expected a mapping of key: value, as a training run writes it")
    return value


def _first(folders: list[Path], name: str) -> Path | None:
    return next((folder / name for folder in folders if (folder / name).is_file()), None)


def final_losses(metrics_path: Path) -> tuple[dict[str, float], int | None]:
    """The last logged value of every `*loss*` metric (train and validation are logged at different steps)."""
    losses: dict[str, float] = {}
    last_step = None
    for row in read_metrics(metrics_path):
        for key, value in row.items():
            if "loss" in key and isinstance(value, (int, float)):
                losses[key] = float(value)
        if isinstance(row.get("step"), int):
            last_step = row["step"]
    return losses, last_step


def has_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in WEIGHT_FILES)


def find_zero_checkpoint(folder: Path) -> tuple[Path, str] | None:
    """(checkpoint dir, tag) of DeepSpeed ZeRO shards under `folder`: a tag folder such as `pytorch_model/` or
    `global_step10/` holding `*model_states.pt`, at most two levels down."""
    states = sorted(folder.glob("*/*model_states.pt")) + sorted(folder.glob("*/*/*model_states.pt"))
    tags = sorted({path.parent for path in states})
    if not tags:
        return None
    if len(tags) > 1:
        latest = tags[0].parent / "latest"
        chosen = [tag for tag in tags if latest.is_file() and tag.name == read_text(latest, "--from").strip()]
        if len(chosen) != 1:
            raise UserError(f"--from {folder}: several DeepSpeed checkpoints ({', '.join(t.name for t in tags)}); "
                            f"point --from at one step folder")
        tags = chosen
    return tags[0].parent, tags[0].name


def consolidate_zero_checkpoint(checkpoint_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """fp32 weights gathered from every rank's ZeRO-2/3 partition, once the files are checked to hold no code."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    check_tensor_files(checkpoint_dir / tag, deepspeed_pickled_types())
    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)


def resolve_base(name: str, run_config: dict[str, Any]) -> str:
    """A base `load_model` can open. A folder holding only GGUF files means its one .gguf file (or the run's
    `gguf_file`); PEFT records such a base as the folder when it was loaded with gguf_file=."""
    path = Path(name)
    if path.is_dir() and not (path / "config.json").is_file():
        if run_config.get("gguf_file") and (path / run_config["gguf_file"]).is_file():
            return str(path / run_config["gguf_file"])
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(ggufs[0])
        raise UserError(f"base model {name}: no config.json and {len(ggufs)} .gguf files; "
                        f"pass --base path/to/model.gguf")
    return name


def run_base(run_config: dict[str, Any]) -> str | None:
    name = run_config.get("model_name")
    if name and run_config.get("gguf_file") and not name.endswith(".gguf"):
        return str(Path(name) / run_config["gguf_file"])
    return name


def default_base(model_dir: Path, run_config: dict[str, Any]) -> str | None:
    """The base the run fine-tuned: as the adapter recorded it, else the run config's model_name."""

    if is_adapter_folder(str(model_dir)):
        return resolve_base(adapter_base(str(model_dir)), run_config)
    name = run_base(run_config)
    return resolve_base(name, run_config) if name else None


def merge_adapter(base_name: str, adapter_dir: Path):
    """Load the base in fp32, apply the adapter in fp32, and fold it into the weights. An adapter trained over a
    quantized base (its run's config.yaml says so) comes back unmerged, over that base quantized again: it is merged
    into the dequantized base once the tokenizer is there to measure the gap (`merged_quantized`)."""
    from peft import PeftModel

    base_model = load_model(base_name, dtype=torch.float32,
                            quantization=adapter_quantization(str(adapter_dir), torch.float32))
    model = PeftModel.from_pretrained(base_model, str(adapter_dir))
    return model if is_quantized(model) else model.merge_and_unload()


def merged_quantized(path: Path, model, tokenizer, run_config: dict[str, Any]) -> tuple[Any, str | None]:
    """(the model to export, the line that says it is a quantized base dequantized plus its adapter and how far its
    logits are from what was trained) for a QLoRA run's adapter or its final/merged; (model, None) otherwise."""
    if is_quantized(model):
        return merge_measured(model, tokenizer, "float32")
    settings = quantization_settings(run_config)
    if not (is_quantizing(settings) and path.name == MERGED_DIR and is_adapter_folder(str(path.parent))):
        return model, None
    trained = load_model(str(path.parent), dtype=torch.float32)  # the adapter over its base quantized again
    keep_weight_layout(trained)
    gap = logit_gap(prompt_logits(trained, tokenizer), prompt_logits(model, tokenizer))
    return model, merge_gap_line(settings, run_config.get("merge_dtype", "float32"), gap)


def model_from_state_dict(state_dict: dict[str, torch.Tensor], model_dir: Path, base_name: str | None,
                          where: str):
    """Put consolidated ZeRO weights into a model: the architecture from `model_dir/config.json` or the base; a
    PEFT state dict (keys `base_model.model.*`) gets its adapter rebuilt from adapter_config.json, then merged."""
    from transformers import AutoConfig, AutoModelForCausalLM

    is_peft = any(key.startswith("base_model.model.") for key in state_dict)
    if (model_dir / "config.json").is_file() and not is_peft:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    elif base_name:
        model = load_model(base_name, dtype=torch.float32)
    else:
        raise UserError(f"{where}: DeepSpeed shards but no config.json and no base model; pass --base")
    if is_peft:
        from peft import LoraConfig, get_peft_model

        if not (model_dir / "adapter_config.json").is_file():
            raise UserError(f"{where}: DeepSpeed LoRA shards need {model_dir / 'adapter_config.json'}")
        model = get_peft_model(model, LoraConfig.from_pretrained(str(model_dir)))
    load_all_weights(model, state_dict, where)
    return model.merge_and_unload() if is_peft else model


def load_all_weights(model, state_dict: dict[str, torch.Tensor], where: str) -> None:
    """load_state_dict that accepts a tied weight stored under one of its names, and nothing else missing."""
    result = model.load_state_dict(state_dict, strict=False)
    aliases: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), set()).add(name)
    names = {name: group for group in aliases.values() for name in group}
    missing = [key for key in result.missing_keys if not names.get(key, {key}) & state_dict.keys()]
    if missing or result.unexpected_keys:
        raise UserError(f"{where}: the DeepSpeed weights do not fit the model ({len(missing)} missing, e.g. "
                        f"{missing[:2]}; {len(result.unexpected_keys)} unexpected, e.g. "
                        f"{result.unexpected_keys[:2]}); pass the right --base")


def base_license(base_name: str | None) -> dict[str, str]:
    """license / license_name / license_link as the base declares them (GGUF metadata or model card front matter)."""
    if not base_name:
        return {}
    path = Path(base_name)
    if path.suffix == ".gguf" and path.is_file():

        keys = {"general.license": "license", "general.license.name": "license_name",
                "general.license.link": "license_link"}
        return {keys[key]: value for key, value in read_gguf_strings(path, tuple(keys)).items()}
    card = path / "README.md"
    if card.is_file():
        front = read_text(card, "base model card").split("---")
        if len(front) >= 3 and not front[0].strip():
            meta = parse_yaml(front[1], f"base model card {card}") or {}
            if not isinstance(meta, dict):
                return {}
            return {key: str(meta[key]) for key in ("license", "license_name", "license_link") if meta.get(key)}
    return {}


def load_source(source: str, base: str | None = None) -> ExportSource:
    """Everything the writers need: an fp32 model with LoRA merged, its tokenizer and what the run recorded."""

    path = Path(resolved_name(source))  # a packaged model's short name (smollm2) is its file
    if not path.exists():
        raise UserError(f"--from {source}: not found")
    if (path / MARKER).is_file() and (problem := marker_problem(path)):  # a checkpoint or final/ that lists its files
        raise UserError(f"--from {source}: {problem}; export another checkpoint")
    run = read_run_info(path)
    model_dir = path / MODEL_DIR if (path / MODEL_DIR).is_dir() else path
    base_name = resolve_base(base, run.config) if base else None
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"--from {source}: a file must be a .gguf model; otherwise give a folder")
        model, base_name = load_model(str(path), dtype=torch.float32), str(path)
    elif has_weights(model_dir) and is_adapter_folder(str(model_dir)):
        base_name = base_name or default_base(model_dir, run.config)
        assert base_name is not None  # an adapter folder names its base
        model = merge_adapter(base_name, model_dir)
    elif has_weights(model_dir):
        model = load_model(str(model_dir), dtype=torch.float32)
        base_name = base_name or run_base(run.config) or str(model_dir)  # no run: the folder is its own base
    elif zero := find_zero_checkpoint(path):
        base_name = base_name or default_base(model_dir, run.config)
        model = model_from_state_dict(consolidate_zero_checkpoint(*zero), model_dir, base_name,
                                      f"--from {source}")
    else:
        raise UserError(f"--from {source}: no model weights (model.safetensors, adapter_model.safetensors) "
                        f"and no DeepSpeed shards")
    tokenizer_names = [str(model_dir)] if any((model_dir / f).is_file() for f in TOKENIZER_FILES) else []
    tokenizer_names += [name for name in (run.config.get("tokenizer_name"), base_name) if name]
    if not tokenizer_names:
        raise UserError(f"--from {source}: no tokenizer next to the weights and no base model to take it from")
    tokenizer = load_tokenizer(tokenizer_names[0], key="--from")
    model, merge_note = merged_quantized(path, model, tokenizer, run.config)
    license_fields = base_license(base_name) or base_license(str(model_dir))
    return ExportSource(model.eval(), tokenizer, base_name, run, license_fields, merge_note)


def local_config(source: Path, base: str | None):
    """The model config when it is on disk next to the input (the model's own, or its adapter's base)."""
    from transformers import AutoConfig

    model_dir = source / MODEL_DIR if (source / MODEL_DIR).is_dir() else source
    candidates = [base, str(model_dir)]
    if base is None and is_adapter_folder(str(model_dir)):
        candidates.append(adapter_base(str(model_dir)))
    for candidate in candidates:
        if candidate and (Path(candidate) / "config.json").is_file():
            read_model_config(candidate, "--from")  # JSON, an object, no code of its own: or one line
            try:
                return AutoConfig.from_pretrained(candidate)
            except (ValueError, KeyError) as exc:  # a model_type transformers does not know
                raise UserError(f"--from {Path(candidate) / 'config.json'}: transformers cannot read it "
                                f"({(str(exc).splitlines() or [type(exc).__name__])[0][:160]})") from None
    return None


# ---------------------------------------------------------------- writing


def training_method(config: dict[str, Any]) -> str:
    if not config:
        return "unknown"
    if not config.get("lora"):
        return "full fine-tuning"
    settings = quantization_settings(config)
    if is_quantizing(settings):
        return (f"QLoRA (r={config.get('lora_r')}, alpha={config.get('lora_alpha')}) over a "
                f"{describe_settings(settings)} base, merged in fp32 into the dequantized base")
    return f"LoRA (r={config.get('lora_r')}, alpha={config.get('lora_alpha')}), merged in fp32"


def declared_name(base_gguf: Path | None) -> str | None:
    """The organization and name a GGUF base declares (e.g. HuggingFaceTB Smollm2 135M ...); its path may say less."""
    if base_gguf is None:
        return None
    fields = read_gguf_strings(base_gguf, ("general.organization", "general.name"))
    return " ".join(fields[key] for key in ("general.organization", "general.name") if key in fields) or None


def model_card(name: str, source: ExportSource, spec: ExportFormat, dtype: str) -> str:
    """README.md: front matter the Hub reads, then what was trained on what, for how long, with what result."""
    front: dict[str, Any] = {"license": source.license.get("license", "unknown")}
    front.update({key: value for key, value in source.license.items() if key != "license"})
    if source.base_name and not Path(source.base_name).exists():
        front["base_model"] = source.base_name  # only Hub ids; a local path means nothing to readers
    front["tags"] = ["gpt4all-training", spec.card_tag]
    config = source.run.config
    rows = [
        ("Base model", portable_name(source.base_name) if source.base_name else "unknown"),
        ("Training data", config.get("dataset_path", "unknown")
         + (f" (revision {config['revision']})" if config.get("revision") else "")),
        ("Training steps", source.run.steps if source.run.steps is not None else "unknown"),
        ("Method", training_method(config)),
    ]
    if declared := declared_name(source.base_gguf):
        rows.insert(1, ("Base model, as its GGUF names it", declared))
    rows += [(f"Final {key}", f"{value:.4f}") for key, value in sorted(source.run.losses.items())]
    rows += [("Export", f"{spec.name} {dtype}"), ("License", source.license.get("license", "unknown"))]
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {name}", "",
             "Fine-tuned with gpt4all-training.", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in rows]
    if source.merge_note:
        lines += ["", "## Quantized base", "", source.merge_note[0].upper() + source.merge_note[1:] + "."]
    notice = LICENSE_NOTICES.get(source.license.get("license", ""))
    if notice:
        lines += ["", "## License", "", notice]
    elif "license" not in source.license:
        lines += ["", "## License", "", "The base model's license was not found; check it before sharing this model."]
    if config:
        lines += ["", "## Training config", "", "```yaml", yaml.safe_dump(config, sort_keys=False).strip(), "```"]
    return "\n".join(lines) + "\n"


def write_hf(source: ExportSource, folder: Path, request: ExportRequest) -> Written:
    """The hf format: a slim safetensors folder that transformers, vLLM and TGI load."""
    stops = stop_token_ids(source.tokenizer)
    if len(stops) > 1:  # generate() stops at any of them: a chat turn ends on its end-of-turn token
        source.model.generation_config.eos_token_id = stops
    source.model.to(DTYPES[request.dtype]).save_pretrained(folder, max_shard_size=request.max_shard_size)
    source.tokenizer.save_pretrained(folder)
    add_template_to_tokenizer_config(folder, source.tokenizer)
    return Written()


def check_output_folder(out: Path) -> None:
    """Before the slow load: `--to` names a folder that does not exist or is empty, and it and the folder it is
    built beside can be written."""
    if out.suffix == ".gguf":
        raise UserError(f"--to {out}: give a folder; the .gguf file and README.md are written inside it")
    writable_folder("--to", out, new=True)


def write_folder_atomically(out: Path, fill: Callable[[Path], None]) -> None:
    """Build the export in a folder of its own beside OUT (`OUT.partial-<random>`) and rename it into place, so a
    crash never leaves a half export at OUT, and two exports to one OUT never touch each other's files. A failed
    write (a full disk, a read-only target) removes what this export wrote and nothing else, in one line."""
    check_output_folder(out)
    try:
        with new_folder(out, marker=False) as partial:
            fill(partial)
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as "I/O error: ..."
        if getattr(exc, "errno", None) in (errno.ENOTEMPTY, errno.EEXIST):
            raise UserError(f"--to {out}: another export finished there while this one ran; its files are kept. "
                            f"Choose a new folder") from None
        reason, advice = write_failure(exc, "--to")
        raise UserError(f"--to {out}: could not write the export ({reason}); nothing was left behind. "
                        f"{advice.capitalize()}, then run again") from None


@dataclass
class Exported:
    files: list[Path]
    agreement: Agreement | None  # a GGUF's, with the merged model it was written from


def export(source: str, to: str, fmt: str, dtype: str | None = None, base: str | None = None,
           max_shard_size: str = "2GB") -> list[Path]:
    """Export `source` to the folder `to`; returns the files written."""
    return export_with_agreement(source, to, fmt, dtype, base, max_shard_size).files


def export_with_agreement(source: str, to: str, fmt: str, dtype: str | None = None, base: str | None = None,
                          max_shard_size: str = "2GB") -> Exported:
    """Export `source` to the folder `to` in the format `fmt` (export/formats.py); the files written and, for a GGUF,
    its agreement with the merged model (in its model card too)."""
    spec = format_named(fmt)
    request = ExportRequest(Path(to).name, chosen_dtype(spec, dtype), max_shard_size)
    out = Path(to)
    check_output_folder(out)  # before the slow load
    # A broken or foreign config.json: one line, before the slow load.
    config = local_config(Path(resolved_name(source)), base)
    if config is not None:
        spec.refuse(config, request.dtype)  # before loading weights
    loaded = load_source(source, base)
    spec.refuse(loaded.model.config, request.dtype)
    written = Written()

    def fill(folder: Path) -> None:
        nonlocal written
        card = model_card(out.name, loaded, spec, request.dtype)
        written = spec.write()(loaded, folder, request)
        card += "".join(f"{line}\n" for line in written.card)
        (folder / "README.md").write_text(scrub(card), encoding="utf-8")

    write_folder_atomically(out, fill)
    return Exported(sorted(out.iterdir()), written.agreement)
