"""The training loop, readable top to bottom: `python train.py --config c.yaml [key=value ...]`.

The same script runs under `python`, `accelerate launch` and `torchrun`. The loss of an optimiser step is
token-weighted over everything the step trains on: the sum of token losses of all its micro-batches on all ranks,
divided by their total count of trained tokens. So batch 4 x accumulation 1, batch 1 x accumulation 4 and 2 ranks x
batch 2 all take the same step.
"""

from __future__ import annotations

import argparse
import gc
import math
import re
import resource
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml

from gpt4all_training.training.checkpoint import GracefulStop, resume_training, save_step_checkpoint
from gpt4all_training.config.loader import TrainConfig, load_config
from gpt4all_training.data.sft import load_data
from gpt4all_training.backends.accelerate import (backward, build_accelerator, device_batch, finish, micro_batch, replica_mismatches,
                          saveable_state_dict, step_boundary, stepping_optimizer, whole_copy, xla_metrics,
                          zero_stage)
from gpt4all_training.errors import TrainingError, UserError
from gpt4all_training.training.evaluate import evaluate_loss
from gpt4all_training.tracking.hub import push_folder
from gpt4all_training.training.loss import real_token_count, token_loss_sum, trained_token_count
from gpt4all_training.model.loading import (apply_lora, build_model_from_config, count_parameters, load_model, param_groups,
                       resident_parameters, tokenizer_for)
from gpt4all_training.data.batching import batch_fetcher, check_isolation
from gpt4all_training.data.text import CausalLMLoss, RowSampler, fetch_rows, load_pretrain_data
from gpt4all_training.tracking.report import write_report
from gpt4all_training.data.sampling import StepSampler
from gpt4all_training.training.schedule import learning_rate
from gpt4all_training.tracking.tracker import Tracker

def total_optimizer_steps(steps_per_epoch: int, num_epochs: int, max_steps: int | None) -> int:
    """Optimiser steps of the whole run, across epochs: the one number the schedule, plan and loop share."""
    total = steps_per_epoch * num_epochs
    return min(total, max_steps) if max_steps else total


def lr_factor(step: int, config: TrainConfig, total_steps: int) -> float:
    return learning_rate(step, config, total_steps) / config.lr


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak host RSS, and peak GPU memory allocated by torch on a CUDA device, in MiB."""
    peaks = {"peak_rss_mb": round(peak_rss_mb(), 1)}
    if device.type == "cuda":
        peaks["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return peaks


def train_step(model, batches: list[dict[str, torch.Tensor]], accelerator, optimizer, scheduler,
               max_grad_norm: float | None, step: int, loss_fn=token_loss_sum,
               nan_policy: str = "stop") -> dict[str, float]:
    """One optimiser step over this rank's micro-batches. Returns the global, token-weighted step loss and counts.

    A non-finite loss stops the run, or with nan_policy "skip" drops this step's update: every rank sees the same
    reduced loss, so all of them skip together, and the scheduler still steps (the lr stays a function of the step).
    """
    device = accelerator.device
    local = torch.tensor([sum(trained_token_count(b) for b in batches),
                          sum(real_token_count(b) for b in batches),
                          sum(b["input_ids"].numel() for b in batches)], dtype=torch.float64, device=device)
    n_trained, n_real, n_padded = accelerator.reduce(local, reduction="sum").tolist()
    # DDP averages gradients over ranks; scaling by the world size makes the result sum/global-count exactly.
    scale = accelerator.num_processes / max(n_trained, 1.0)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, batch in enumerate(batches):
        batch = device_batch(batch, accelerator)  # under XLA padded to a fixed width bucket: no recompiles
        last = i == len(batches) - 1
        with micro_batch(accelerator, model, last):
            with accelerator.autocast():
                micro_loss = loss_fn(model, batch)
            backward(accelerator, micro_loss * scale)
        loss_sum += micro_loss.detach().double()
    loss = (accelerator.reduce(loss_sum, reduction="sum") / max(n_trained, 1.0)).item()
    skipped = not math.isfinite(loss)
    if skipped and nan_policy != "skip":
        raise TrainingError(f"step {step + 1}: the loss is {loss}; lower lr, check the data, or use float32")
    grad_norm = float("nan") if skipped else accelerator.clip_grad_norm_(model.parameters(),
                                                                         max_grad_norm or float("inf"))
    lr = scheduler.get_last_lr()[0]
    if not skipped:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    step_boundary(accelerator)  # XLA: one graph per step
    return {"loss": loss, "lr": lr, "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "n_trained": n_trained, "n_real": n_real, "n_padded": n_padded, "skipped": int(skipped)}


def save_final(accelerator, model, tokenizer, folder: Path, merge_lora: bool) -> None:
    """final/: the model (or adapter), tokenizer and generation config in safetensors; optionally final/merged/."""
    state_dict = saveable_state_dict(accelerator, model)
    unwrapped = accelerator.unwrap_model(model)
    if not accelerator.is_main_process:
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
        merged = whole_copy(accelerator, unwrapped, state_dict).merge_and_unload()  # ZeRO-3: a whole copy
        merged.save_pretrained(folder / "merged", safe_serialization=True)
        tokenizer.save_pretrained(folder / "merged")
        generation.save_pretrained(folder / "merged")


def require_writable(output_dir: Path) -> None:
    """Create output_dir and prove a file can be written in it: a read-only one would otherwise fail only at the first
    log line or checkpoint, after the data and model are loaded."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as exc:
        raise UserError(f"output_dir {output_dir}: not writable ({exc.strerror or type(exc).__name__}); fix its "
                        f"permissions or choose another output_dir") from None


def train(config: TrainConfig) -> dict[str, Any]:
    accelerator = build_accelerator(config)
    log = accelerator.print
    torch.manual_seed(config.seed)
    output_dir = Path(config.output_dir)
    require_writable(output_dir)
    if config.nan_policy == "skip" and accelerator.state.deepspeed_plugin is not None:
        raise UserError("nan_policy: 'skip' is not available under DeepSpeed, whose engine applies the update inside "
                        "backward, before the step's loss is known; use 'stop'")

    # --- data ---
    tokenizer = tokenizer_for(config)
    with accelerator.main_process_first():
        if config.objective == "causal_lm":  # raw text cut into constant-length rows (pretrain_data.py)
            (train_ds, val_ds), (train_stats, val_stats) = load_pretrain_data(config, tokenizer, log)
        else:
            (train_ds, val_ds), (train_stats, val_stats) = load_data(config, tokenizer)
    log(train_stats.describe("train"))
    log(val_stats.describe("validation"))

    # --- model and optimiser ---
    if config.init == "from_config":
        model = build_model_from_config(config, tokenizer)  # random weights, seeded above
    else:
        model = load_model(config.model_name, config.model_revision, config.gguf_file, config.trust_remote_code,
                           torch.float32, config.gradient_checkpointing)
    if config.lora:
        model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules,
                           config.gradient_checkpointing)
    trainable, total = count_parameters(model)
    log(f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)"
        + (f"; ZeRO-3 partitioned them as they were built: this rank holds {resident_parameters(model):,}"
           if zero_stage(accelerator) == 3 else ""))
    if config.objective == "causal_lm":
        sampler = RowSampler(train_ds, config.batch_size, accelerator.num_processes, accelerator.process_index,
                             config.gradient_accumulation_steps, config.seed, config.max_steps)
    else:
        sampler = StepSampler(len(train_ds), config.batch_size, accelerator.num_processes, accelerator.process_index,
                              config.gradient_accumulation_steps, config.seed,
                              lengths=train_ds["length"] if config.group_by_length else None)
    total_steps = total_optimizer_steps(sampler.steps_per_epoch, config.num_epochs, config.max_steps)
    optimizer = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.999),
                                  eps=1e-8)
    model, optimizer = accelerator.prepare(model, optimizer)
    if config.packing:
        check_isolation(model)  # refuse a model that would attend across packed examples (every rank runs it)
    if config.compile:
        accelerator.unwrap_model(model).compile()  # in place, inside DDP/DeepSpeed: saving sees the same module
    # Not passed to prepare(): accelerate's wrapper would step it once per process. Built after prepare() on the
    # optimiser that applies the updates (under DeepSpeed CPU offload, DeepSpeedCPUAdam rather than ours).
    scheduler = torch.optim.lr_scheduler.LambdaLR(stepping_optimizer(optimizer),
                                                  partial(lr_factor, config=config, total_steps=total_steps))
    if config.objective == "causal_lm" and config.streaming:  # a stream's passes are unknown until each one ends
        log(f"{total_steps} optimiser steps (max_steps) over the stream, passing over it as often as that takes "
            f"(global batch {sampler.examples_per_step} rows)")
    else:
        log(f"{total_steps} optimiser steps: {sampler.steps_per_epoch} per epoch x {config.num_epochs} epochs "
            f"(global batch {sampler.examples_per_step} examples)")

    # --- resume ---
    state = resume_training(config, accelerator, model, optimizer, scheduler, sampler, log)
    config_yaml = yaml.safe_dump(config.to_dict(), sort_keys=False)

    # --- the loop ---
    tracker = Tracker(output_dir, config.report_to, config.to_dict(), accelerator.is_main_process,
                      resume_step=state["step"], project=config.wandb_project_name, entity=config.wandb_entity)
    pad_id = tokenizer.pad_token_id
    progress = _progress(total_steps, state["step"], accelerator.is_main_process)
    val: dict[str, float] = {}
    window = {"time": time.perf_counter(), "real": 0.0, "trained": 0.0, "padded": 0.0}
    run_totals = {"seconds": 0.0, "real": 0.0, "trained": 0.0, "padded": 0.0}
    skipped_steps = {"row": 0, "run": 0}  # nan_policy skip: since the last logged row, and in this process
    fetch = fetch_rows if config.objective == "causal_lm" else batch_fetcher(config.packing, config.max_length)
    loss_fn = CausalLMLoss(config.z_loss) if config.objective == "causal_lm" else token_loss_sum
    model.train()
    stop = GracefulStop()  # SIGTERM/SIGINT: finish the step, checkpoint, exit 128+signal
    # The model, data and libraries live for the whole run: keep the garbage collector from scanning them again at
    # every collection (measured on the tiny model: 2.5% of the loop's time went to collections).
    gc.freeze()
    while state["step"] < total_steps:
        step = state["step"]
        batches = [fetch(train_ds, indices, pad_id) for indices in sampler.step_indices(step)]
        result = train_step(model, batches, accelerator, optimizer, scheduler, config.max_grad_norm, step, loss_fn,
                            config.nan_policy)
        skipped_steps["row"] += result["skipped"]
        skipped_steps["run"] += result["skipped"]
        state = {"step": step + 1, "epoch": (step + 1) / sampler.steps_per_epoch,
                 "trained_tokens": state["trained_tokens"] + int(result["n_trained"])}
        for key in ("real", "trained", "padded"):
            window[key] += result[f"n_{key}"]
        progress.update(1)

        if state["step"] % config.log_every == 0 or state["step"] == total_steps:
            seconds = time.perf_counter() - window["time"]
            row = {"loss": result["loss"], "lr": result["lr"], "grad_norm": result["grad_norm"],
                   "tokens_per_s": window["real"] / seconds, "trained_tokens_per_s": window["trained"] / seconds,
                   "padding_fraction": 1 - window["real"] / max(window["padded"], 1.0),
                   "trained_tokens": state["trained_tokens"], "epoch": state["epoch"],
                   **peak_memory(accelerator.device), **xla_metrics(accelerator)}
            if isinstance(loss_fn, CausalLMLoss):
                row.update(loss_fn.window_metrics(accelerator))  # train/last_loss, train/z_loss (a collective)
            if config.nan_policy == "skip":  # summed over metrics.jsonl: the run's skipped steps, across resumes
                row["skipped_steps"], skipped_steps["row"] = skipped_steps["row"], 0
            run_totals["seconds"] += seconds
            for key in ("real", "trained", "padded"):
                run_totals[key] += window[key]
            tracker.log(row, state["step"])
            progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}",
                                 tok_s=f"{row['tokens_per_s']:.0f}")
            window = {"time": time.perf_counter(), "real": 0.0, "trained": 0.0, "padded": 0.0}

        at_end = state["step"] == total_steps
        paused = time.perf_counter()  # evaluation and saving are not training: keep them out of tokens/s
        if len(val_ds) and ((config.eval_every and state["step"] % config.eval_every == 0) or at_end):
            val = evaluate_loss(model, val_ds, accelerator, config.batch_size, pad_id, config.eval_steps)
            tracker.log(val, state["step"])
            log(f"step {state['step']}: val_loss {val['val_loss']:.4f} val_ppl {val['val_ppl']:.2f}")

        stopping = not at_end and stop.requested(accelerator)
        if (config.save_every and state["step"] % config.save_every == 0 and not at_end) or stopping:
            save_step_checkpoint(output_dir, state, sampler, accelerator, model, optimizer, scheduler, config_yaml,
                                 config.keep_last, config.keep_every)
        window["time"] += time.perf_counter() - paused
        if stopping:
            break
    progress.close()
    gc.unfreeze()
    stop.close()
    if state["step"] < total_steps:  # stopped by a signal: no final/, no push; the checkpoint resumes it
        tracker.close()
        log(f"stopped by {stop.signal_name} after step {state['step']}; its checkpoint is in {output_dir}; "
            f"rerun with resume=auto to continue")
        finish(accelerator, stop.exit_code)  # multi-process ZeRO-3 exits here with the signal's code
        return {"steps": state["step"], "trained_tokens": state["trained_tokens"], "exit_code": stop.exit_code}

    # --- the end ---
    mismatched = replica_mismatches(accelerator, model)  # DDP, ZeRO-1/2: every rank's copy must equal rank 0's
    if mismatched is not None:
        tracker.log({"replica_mismatches": mismatched}, state["step"])
        if mismatched:
            log(f"warning: {mismatched} parameter tensors differ between ranks; final/ holds rank 0's copy")
    save_final(accelerator, model, tokenizer, output_dir / "final", config.merge_lora)
    summary = {"steps": state["step"], "trained_tokens": state["trained_tokens"], **val,
               "trained_tokens_per_s": round(run_totals["trained"] / max(run_totals["seconds"], 1e-9), 1),
               "padding_fraction": round(1 - run_totals["real"] / max(run_totals["padded"], 1.0), 4),
               **peak_memory(accelerator.device), "train_examples": len(train_ds),
               "val_examples": len(val_ds)}
    if config.nan_policy == "skip":
        summary["skipped_steps"] = skipped_steps["run"]
    if accelerator.is_main_process:
        tracker.close()
        report = write_report(output_dir, summary)
        log(f"final model: {output_dir / 'final'}; loss curves: {report}")
    accelerator.wait_for_everyone()
    if config.push_to_hub and accelerator.is_main_process:
        push_folder(output_dir / "final", config.save_name, log=log)  # a failure warns; the run still succeeds
    finish(accelerator)  # under multi-process ZeRO-3 this exits the process (see distributed.finish)
    return summary


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="training", dynamic_ncols=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="training config YAML (see configs/train/)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. lr=1e-4 max_steps=5")


def lost_peer_error(exc: RuntimeError) -> TrainingError | None:
    """A collective that failed because another rank died (gloo: "Connection closed by peer") or stopped answering
    for ddp_timeout_s, as one line; None for any other error, which keeps its traceback."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    first = (str(exc).splitlines() or [""])[0]
    if not isinstance(exc, dist.DistError) and "gloo/" not in first:
        return None
    reason = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0][:200]  # without gloo's "[file.cc:12]" and advice
    return TrainingError(f"rank {dist.get_rank()} of {dist.get_world_size()}: another process of this run died or "
                         f"stopped answering ({reason}); find the first error in the other ranks' output, then "
                         f"rerun with resume=auto to continue from the last checkpoint")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    try:
        summary = train(config)
    except RuntimeError as exc:
        lost = lost_peer_error(exc)
        if lost is None:
            raise
        raise lost from None
    return summary.get("exit_code", 0)  # 128 + signal when SIGTERM/SIGINT stopped it early with a checkpoint
