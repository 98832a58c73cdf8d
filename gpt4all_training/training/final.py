"""The end of a finished run: the replicas compared, final/ written, the summary and report, the Hub upload."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from safetensors import SafetensorError

from gpt4all_training.backends.replicas import ComparingBackend, replica_mismatches
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import TrainingError, write_failure
from gpt4all_training.files import replace_folder, write_marker
from gpt4all_training.model.build import quantized_whole_copy
from gpt4all_training.model.quantization import DTYPES, is_quantized, merge_measured
from gpt4all_training.tracking.hub import push_folder
from gpt4all_training.tracking.report import write_report
from gpt4all_training.run_folder import CONFIG_FILE, MERGED_DIR, building_folder, final_folder, merged_folder
from gpt4all_training.training.checkpoint import Checkpointer


class FinishingBackend(ComparingBackend, Protocol):
    """What the end of a run asks the run's backend (backends/backend.py): the replicas compared, final/ written."""

    @property
    def is_main_process(self) -> bool: ...

    def print(self, *args, **kwargs) -> None: ...

    def wait_for_everyone(self) -> None: ...

    def saveable_state_dict(self, model) -> dict[str, torch.Tensor]: ...

    def whole_copy(self, unwrapped, state_dict: dict[str, torch.Tensor]): ...


def save_final(backend: FinishingBackend, model, tokenizer, folder: Path, merge_lora: bool, config_yaml: str,
               merge_dtype: str = "float32") -> None:
    """final/: the model (or adapter), tokenizer and generation config in safetensors, and the run's config (what
    inference and export read to know how it was trained); optionally final/merged/.
    Written as a checkpoint is: into final.tmp/, with a COMPLETE marker listing every file's SHA-256, fsynced, then
    renamed, so a crash or a full disk never leaves a final/ that looks whole (a failed write removes final.tmp/ and
    raises; an earlier final/ stays until the new one is complete)."""
    state_dict = backend.saveable_state_dict(model)
    unwrapped = backend.unwrap(model)
    if not backend.is_main_process:
        return
    tmp = building_folder(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_final(unwrapped, backend, state_dict, tokenizer, tmp, merge_lora, merge_dtype)
        (tmp / CONFIG_FILE).write_text(config_yaml, encoding="utf-8")
        write_marker(tmp)
        replace_folder(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_final(unwrapped, backend: FinishingBackend, state_dict, tokenizer, folder: Path, merge_lora: bool,
                merge_dtype: str = "float32") -> None:
    is_peft = hasattr(unwrapped, "get_base_model")
    base = unwrapped.get_base_model() if is_peft else unwrapped
    generation = base.generation_config
    generation.eos_token_id = tokenizer.eos_token_id
    generation.pad_token_id = tokenizer.pad_token_id
    unwrapped.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    generation.save_pretrained(folder)
    if merge_lora and is_peft:
        # After the adapter is saved: merging folds it into the base in place, in fp32 (a LoRA base stored in the
        # compute dtype, model/build.py, is widened first: exactly, and it is what the adapter was trained over);
        # only the merged model is cast to merge_dtype.
        if is_quantized(unwrapped):
            merged = merge_quantized(unwrapped, backend, state_dict, tokenizer, merge_dtype)
        else:
            whole = backend.whole_copy(unwrapped, state_dict).float()  # ZeRO-3, XLA: a CPU copy
            merged = whole.merge_and_unload(progressbar=True)  # PEFT's bar: "Unloading and merging model", n/N
            merged = merged.to(DTYPES[merge_dtype])
        merged.save_pretrained(folder / MERGED_DIR, safe_serialization=True)
        tokenizer.save_pretrained(folder / MERGED_DIR)
        generation.save_pretrained(folder / MERGED_DIR)


def merge_quantized(unwrapped, backend: FinishingBackend, state_dict, tokenizer, merge_dtype: str):
    """The adapter merged into its quantized base dequantized (the function it was trained over), with one line that
    says so and how far the merged model's logits are from the quantized base with its adapter."""
    whole = quantized_whole_copy(unwrapped, state_dict) if backend.partitions_parameters else unwrapped
    merged, line = merge_measured(whole, tokenizer, merge_dtype)
    backend.print(f"final/merged: {line}")
    return merged


def finish_run(config: TrainConfig, backend: FinishingBackend, model, tokenizer, tracker, step: int,
               summarize: Callable[[], dict[str, Any]], checkpointer: Checkpointer) -> dict[str, Any]:
    """Everything after the last step of a run that reached it; returns the run's summary (`summarize()`, taken once
    final/ is written, so its peak memory includes the save). Every rank calls it. Checkpoints are rotated once
    final/ is complete, and never when it could not be written."""
    output_dir = Path(config.output_dir)
    mismatched = replica_mismatches(backend, model)  # DDP, ZeRO-1/2: every rank's copy must equal rank 0's
    if mismatched is not None:
        tracker.log({"replica_mismatches": mismatched}, step)
        if mismatched:
            backend.print(f"warning: {mismatched} parameter tensors differ between ranks; final/ holds rank 0's copy")
    final = final_folder(output_dir)
    try:
        save_final(backend, model, tokenizer, final, config.merge_lora, checkpointer.config_yaml, config.merge_dtype)
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as "I/O error: ..."
        reason, advice = write_failure(exc)
        last = checkpointer.last_kept()
        kept = (f"the checkpoint {last} is kept: resume=auto trains on from it and writes final/" if last else
                "no checkpoint of this run exists, so its trained weights are lost; set save_every to keep "
                "checkpoints")
        raise TrainingError(f"step {step}: could not write the final model {final} ({reason}); nothing was left "
                            f"in {final}; {kept}. {advice.capitalize()}, then run again") from None
    summary = summarize()
    if backend.is_main_process:
        checkpointer.rotate()
        tracker.close()
        try:
            report = write_report(output_dir, summary)
        except OSError as exc:  # the model is safe in final/; a missing report is worth a warning, not a failure
            reason, advice = write_failure(exc)
            backend.print(f"warning: could not write the report in {output_dir} ({reason}); {advice}; the model "
                          f"is complete in {final}", file=sys.stderr)
            report = None
        merged = merged_folder(output_dir)  # named where the next command needs it: generate, serve, export take it
        written = f"final model: {final}" + (f"; merged model: {merged}" if merged.is_dir() else "")
        backend.print(f"{written}; loss curves: {report or 'none'}")
    backend.wait_for_everyone()
    if config.push_to_hub and config.save_name and backend.is_main_process:  # validate() requires save_name
        push_folder(final, config.save_name, log=backend.print)  # a failure warns; the run succeeds
    return summary
