"""The end of a finished run: the replicas compared, final/ written, the summary and report, the Hub upload."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from gpt4all_training.backends.replicas import replica_mismatches
from gpt4all_training.tracking.hub import push_folder
from gpt4all_training.tracking.report import write_report


def save_final(backend, model, tokenizer, folder: Path, merge_lora: bool) -> None:
    """final/: the model (or adapter), tokenizer and generation config in safetensors; optionally final/merged/."""
    state_dict = backend.saveable_state_dict(model)
    unwrapped = backend.unwrap(model)
    if not backend.is_main_process:
        return
    is_peft = hasattr(unwrapped, "get_base_model")
    base = unwrapped.get_base_model() if is_peft else unwrapped
    generation = base.generation_config
    generation.eos_token_id = tokenizer.eos_token_id
    generation.pad_token_id = tokenizer.pad_token_id
    unwrapped.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    generation.save_pretrained(folder)
    if merge_lora and is_peft:
        # After the adapter is saved: merging folds it into the base in place. Master weights are fp32 whatever
        # the compute dtype, so the merge happens in fp32.
        merged = backend.whole_copy(unwrapped, state_dict).merge_and_unload()  # ZeRO-3, XLA: a whole CPU copy
        merged.save_pretrained(folder / "merged", safe_serialization=True)
        tokenizer.save_pretrained(folder / "merged")
        generation.save_pretrained(folder / "merged")


def finish_run(config, backend, model, tokenizer, tracker, step: int,
               summarize: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Everything after the last step of a run that reached it; returns the run's summary (`summarize()`, taken once
    final/ is written, so its peak memory includes the save). Every rank calls it."""
    output_dir = Path(config.output_dir)
    mismatched = replica_mismatches(backend, model)  # DDP, ZeRO-1/2: every rank's copy must equal rank 0's
    if mismatched is not None:
        tracker.log({"replica_mismatches": mismatched}, step)
        if mismatched:
            backend.print(f"warning: {mismatched} parameter tensors differ between ranks; final/ holds rank 0's copy")
    save_final(backend, model, tokenizer, output_dir / "final", config.merge_lora)
    summary = summarize()
    if backend.is_main_process:
        tracker.close()
        report = write_report(output_dir, summary)
        backend.print(f"final model: {output_dir / 'final'}; loss curves: {report}")
    backend.wait_for_everyone()
    if config.push_to_hub and backend.is_main_process:
        push_folder(output_dir / "final", config.save_name, log=backend.print)  # a failure warns; the run succeeds
    return summary
