"""The training loop, readable top to bottom: `python train.py --config c.yaml [key=value ...]`.

The same code runs under `python`, `accelerate launch` and `torchrun`. The backend (one process, DDP, DeepSpeed,
FSDP2 or XLA) and the objective (fine-tuning, preference tuning or raw-text causal LM) are each chosen once; the loop
asks its components whether they are due (the meter, the evaluator, the checkpointer) and cleans up however it ends.
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import yaml

from gpt4all_training.backends.accelerate import build_backend
from gpt4all_training.backends.backend import Backend
from gpt4all_training.config.blocks import Logging
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.config.secrets import redact
from gpt4all_training.errors import UserError
from gpt4all_training.files import created_folder
from gpt4all_training.model.build import check_max_length
from gpt4all_training.model.isolation import check_isolation
from gpt4all_training.model.loading import tokenizer_for
from gpt4all_training.model.parameters import param_groups
from gpt4all_training.paths import require_dataset
from gpt4all_training.progress import progress as progress_bar
from gpt4all_training.tracking.tracker import Tracker
from gpt4all_training.training.checkpoint import Checkpointer, resume_point, resume_training
from gpt4all_training.training.evaluate import Evaluator
from gpt4all_training.training.final import finish_run
from gpt4all_training.training.meter import ThroughputMeter, peak_memory
from gpt4all_training.training.objectives import objective_for
from gpt4all_training.training.objectives.protocol import TrainingObjective
from gpt4all_training.training.optimizers import build_optimizer
from gpt4all_training.training.precision import resolve_dtype
from gpt4all_training.training.schedule import build_scheduler, schedule_notes, total_optimizer_steps
from gpt4all_training.training.step import train_step
from gpt4all_training.training.stop import GracefulStop


def train(config: TrainConfig, backend: Backend | None = None, evaluators: Sequence[Callable[..., Any]] = (),
          notes: Sequence[str] = ()) -> dict[str, Any]:
    """Train as `config` says; the run's summary (with "exit_code" when a signal stopped it with a checkpoint, and
    "already_finished" when output_dir's run had finished with this config, so nothing was trained).
    `backend` is built from the config when not given (the CLI gives it, to learn whether to exit hard after).
    `evaluators` build more components like the validation loss's, from (config, backend, tokenizer, total_steps,
    log): the stages above training hand theirs in this way (the CLI, eval_tasks_every's harness scores). `notes`
    are lines the caller has to say (the CLI's dtype line), said after the line that says where the run starts."""
    said = list(notes)
    config = resolve_dtype(config, said.append)  # the CLI resolved it already, before building its backend
    backend = backend or build_backend(config)
    log = backend.print
    torch.manual_seed(config.seed)
    created_folder("output_dir", Path(config.output_dir))
    if config.nan_policy == "skip" and not backend.supports_nan_skip:
        raise UserError("nan_policy: 'skip' is not available under DeepSpeed, whose engine applies the update inside "
                        "backward, before the step's loss is known; use 'stop'")
    objective: TrainingObjective = objective_for(config)  # the loop asks nothing of its checks face
    start = resume_point(config, backend, log)  # before the data: cheap, and its line is the first
    if start.finished:  # its line said so; nothing is read or written
        backend.end()
        return {"already_finished": True}
    for line in said:
        log(line)
    assert config.dataset_path is not None  # validate() refuses a config without it
    require_dataset(config.dataset_path)  # a typo is one line now, not after the tokenizer has loaded

    tokenizer = tokenizer_for(config)
    check_max_length(config, tokenizer, config.max_length)  # before the minutes of tokenising
    with contextlib.nullcontext() if objective.prepares_once else backend.main_process_first():
        data = objective.load_data(config, tokenizer, log, backend.world_size)
    log(data.train_stats.describe("train"))
    log(data.val_stats.describe("validation"))
    model = objective.build_model(config, tokenizer, backend)
    sampler = objective.sampler(config, data, backend.world_size, backend.rank)
    total_steps = total_optimizer_steps(sampler.steps_per_epoch, config.num_epochs, config.max_steps)
    model, optimizer, scheduler = prepare(model, config, backend, total_steps)
    objective.before_training(model, data, backend, tokenizer.pad_token_id, log)
    log(objective.steps_line(sampler, total_steps, config.num_epochs))
    for note in schedule_notes(config, total_steps):  # plan's notes, said again where the run starts
        log(f"note: {note}")
    state, lineage = resume_training(config, backend, model, optimizer, scheduler, sampler, start,
                                     data.fingerprint, log, objective)

    tracker = Tracker(config.output_dir, config, config.to_dict(), backend.is_main_process, resume_step=state.step)
    meter = ThroughputMeter(config.log_every, total_steps, sampler.steps_per_epoch, config.nan_policy == "skip")
    evaluator = Evaluator(config, config.batch_size, backend, data.val, tokenizer.pad_token_id, total_steps, log,
                          objective.validation)
    others = [build(config, backend, tokenizer, total_steps, log) for build in evaluators]
    config_yaml = yaml.safe_dump(redact(config.to_dict()), sort_keys=False)
    checkpointer = Checkpointer(config, config_yaml, backend, sampler, total_steps, lineage, data.fingerprint,
                                objective)
    if backend.is_main_process:  # a kill between an earlier save and its rotation left one checkpoint too many
        checkpointer.rotate()
    grads_every = grad_norms_interval(config, backend)
    with contextlib.closing(tracker):  # closed however the run ends; finish_run closes it first on success
        with progress_bar("training", total_steps, backend.is_main_process, unit="it", initial=state.step) \
                as progress, GracefulStop() as stop, gc_frozen():
            model.train()
            while state.step < total_steps:
                stop.last_step = state.step + 1 == total_steps
                with meter.building_batches():
                    batches = objective.step_batches(model, backend, data.train, state.step,
                                                     sampler.step_indices(state.step), tokenizer.pad_token_id)
                result = train_step(model, batches, backend, optimizer, scheduler, config.max_grad_norm, state.step,
                                    objective.loss, config.nan_policy,
                                    grad_norms=grads_every is not None and (state.step + 1) % grads_every == 0,
                                    count=objective.count)
                state = state.after(result)
                meter.add(result)
                progress.update(1)
                if meter.due(state.step):
                    row = {**meter.row(result, state, backend.device), **backend.step_metrics(),
                           **objective.window_metrics(backend)}
                    tracker.log(row, state.step)
                    progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}",
                                         tok_s=f"{row['tokens_per_s']:.0f}")
                if "group_grad_norms" in result:
                    log_grad_norms(tracker, result["group_grad_norms"], state.step)
                with meter.paused():
                    for component in (evaluator, *others):
                        if component.due(state.step):
                            tracker.log(component.run(model, state.step), state.step)
                    stopping = state.step < total_steps and stop.requested(backend)
                    if stopping or checkpointer.due(state.step):
                        checkpointer.save(state, model, optimizer, scheduler)
                if stopping:
                    break
        if state.step < total_steps:  # stopped by a signal: no final/, no push; the checkpoint resumes it
            log(f"stopped by {stop.signal_name} after step {state.step}; its checkpoint is in {config.output_dir}; "
                f"run the same command again to continue")
            backend.end()
            return {"steps": state.step, "trained_tokens": state.trained_tokens, "exit_code": stop.exit_code}

        if stop.received is not None:
            log(f"{stop.signal_name} came during the last step, so the run finished instead of stopping: final/ is "
                f"written and the exit code is 0")

        def summarize() -> dict[str, Any]:
            return {"steps": state.step, "trained_tokens": state.trained_tokens, **evaluator.last, **meter.totals(),
                    **peak_memory(backend.device), "train_examples": len(data.train),
                    "val_examples": len(data.val), **meter.skipped_total()}

        summary = finish_run(config, backend, model, tokenizer, tracker, state.step, summarize, checkpointer)
    backend.end()
    return summary


def prepare(model, config: TrainConfig, backend: Backend, total_steps: int):
    """(model, optimizer, scheduler), wrapped by the backend: the config's optimizer over our parameter groups, our
    lr schedule."""
    optimizer = build_optimizer(config.optimizer, param_groups(model, config.weight_decay, backend.parameter_shape),
                                config.lr, backend.device)
    model, optimizer = backend.prepare(model, optimizer)
    if config.packing:
        check_isolation(model)  # refuse a model that would attend across packed examples (every rank runs it)
    if config.compile:
        backend.unwrap(model).compile()  # in place, inside DDP/DeepSpeed: saving sees the same module
    # Not passed to prepare(): accelerate's wrapper would step it once per process. Built after prepare() on the
    # optimizer that applies the updates (under DeepSpeed CPU offload, DeepSpeedCPUAdam rather than ours).
    return model, optimizer, build_scheduler(backend.stepping_optimizer(optimizer), config, total_steps)


def grad_norms_interval(config: Logging, backend: Backend) -> int | None:
    """log_grads_every, or None (said once) where the gradients are gone before the loop could read them."""
    if config.log_grads_every and not backend.supports_grad_norms:
        backend.print("log_grads_every: not available under DeepSpeed, whose engine consumes the gradients inside "
                      "backward; no gradient norms are logged")
        return None
    return config.log_grads_every


def log_grad_norms(tracker: Tracker, norms: dict[str, torch.Tensor], step: int) -> None:
    """Per parameter group: its gradient norm as a number (grad_norm/<group>), and the norms of its parameters as a
    histogram (grad_norms/<group>: TensorBoard and wandb)."""
    tracker.log({f"grad_norm/{name}": float(values.square().sum().sqrt()) for name, values in norms.items()}, step)
    tracker.log_histograms({f"grad_norms/{name}": values for name, values in norms.items()}, step)


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """The model, data and libraries live for the whole run: keep the garbage collector from scanning them again at
    every collection (on the tiny model 2.5% of the loop's time went to collections)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
