"""What a checkpoint holds, writing it so a crash never leaves a half checkpoint that gets loaded, and resuming.
The names of the run folder and of a checkpoint's files are run_folder.py's.

`output_dir/step_N/` holds:
- `model/`: the full model or the adapter (safetensors), `optimizer.pt`, `scheduler.pt`, and `scaler.pt` when
  fp16 uses a gradient scaler; under DeepSpeed, `deepspeed/` (the engine's state, one optimiser partition per rank)
  and under FSDP2, `fsdp/` (each rank's shards of the trainable weights and optimiser state) take the place of
  `optimizer.pt`;
- `rng/rank{r}.pt`: every RNG of each rank (Python, NumPy, torch, CUDA), loadable with `weights_only=True`;
- `state.json`: the global optimiser step and the trained-token count, plus the sampler's state for readers, the
  run's id and the SHA-256 of its data (`data_fingerprint`);
- `data_state.pt`: when the data is streamed, the stream's position (pretrain_data.StreamedRows.state_dict);
- `objective/rank{r}.pt`: what each rank's objective needs for its next step beyond the weights and the step, when
  it needs anything (grpo's sampled rows, saved between two steps that train on them; loadable with
  `weights_only=True`);
- `config.yaml`: the config that produced it (final/ holds one too);
- last, the `COMPLETE` marker, which lists every file's SHA-256.

The sampler's state is the step (a stream adds its position, so that a resume reads on instead of tokenising the
stream again up to it): the order of an epoch is a function of (seed, epoch), and
`epoch, position = divmod(step, steps_per_epoch)`. state.json also records epoch, position, seed and the global
batch, so a resume that would map the step to different examples (another seed, batch or dataset) is refused.

A checkpoint is written as `step_N.tmp/`, fsynced, then renamed to `step_N/`. A folder without a valid marker (or
whose safetensors cannot be read), and any `.tmp` folder, is never loaded.

A run has an id, kept in each of its checkpoints and in `output_dir/run_id` (the run last started there). A fresh
run gets a new one; a resumed run keeps its checkpoint's. `resume=auto` continues the run named in `run_id` (or,
without that file, the newest valid checkpoint) and never another run's checkpoints, which it reports and skips.
With `resume` unset a rerun does the same when `run_id` names a run that left a valid checkpoint, so running the same
command again after a stop continues the run; it refuses, before any data is read, a config that changes what the run
trains. A run that already finished (its final/ is newer than its last checkpoint, or final/ exists and there is no
checkpoint to continue) is never trained again by accident: the same config has nothing to do (one line, exit 0),
and without a checkpoint another config is refused, since it would train from step 0 and replace final/.
`resume=never` starts over in a fresh output_dir: what earlier runs wrote there (checkpoints, final/, run_id, metrics,
report, trackers' files; not the tokenized-data cache, still valid) is moved into `output_dir/set-aside-K/`, never
deleted.
Rotation deletes only this run's checkpoints, and only those older than the newest `keep_last` that verify; it runs
after every save, and when a run starts and ends (a kill between a save and its rotation leaves one too many). It
never deletes another run's checkpoints, a corrupt checkpoint newer than the kept ones, or the checkpoint a resume
started from before a newer valid one exists. A checkpoint this run must replace (its name taken by another run's,
or by one of this run past the step it resumes from) is renamed `step_N.set-aside-K`, never deleted.
"""

from __future__ import annotations

import json
import random
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch
import yaml
from safetensors import SafetensorError

from gpt4all_training.backends.backend import ProcessRanks
from gpt4all_training.config.blocks import Checkpoints
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import TrainingError, UserError, write_failure
# The crash-safe file pieces, under the names readers of checkpoints import from here.
from gpt4all_training.files import MARKER, atomic_write, check_tensor_files, load_tensors, move, replace_folder
from gpt4all_training.files import marker_problem as verify
from gpt4all_training.files import save_tensors as torch_save
from gpt4all_training.files import sha256_file as sha256  # noqa: F401
from gpt4all_training.files import write_marker
from gpt4all_training.model.build import recorded_base_fingerprint
from gpt4all_training.run_folder import (CONFIG_FILE, DATA_STATE_FILE, MODEL_DIR, OBJECTIVE_DIR, OPTIMIZER_FILE,
                                         RNG_DIR, RUN_ID_FILE, RUN_OUTPUTS, SCALER_FILE, SCHEDULER_FILE, STATE_FILE,
                                         building_folder, building_step_folders, final_folder, set_aside_checkpoint,
                                         set_aside_folder, set_aside_folders, step_folder, step_folders)
from gpt4all_training.training.resume_config import (NEW_OUTPUT_DIR, check_config_changes, config_changes,
                                                     described, hyperparameters, refuse_changes,
                                                     restore_hyperparameters)
from gpt4all_training.training.state import TrainState

# Saved in state.json; if any differs at resume, global step s would be other examples than it was.
SAMPLER_KEYS = ("seed", "n_examples", "examples_per_step", "group_by_length")


# ---------------------------------------------------------------- RNG

def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, as plain tensors and lists (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # the legacy form, get_state's default
    state = {
        "python": [list(random.getstate()[1]), random.getstate()[0], random.getstate()[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    words, version, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    name, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- the sampler's state

def training_state(step: int, trained_tokens: int, sampler, run_id: str | None = None,
                   data_fingerprint: str | None = None, base_fingerprint: str | None = None) -> dict[str, Any]:
    """state.json: the step (the only thing resume needs) and what derives from it, for readers and checks, with
    the run's id, its data's content hash and, under a quantized base (which no checkpoint holds), the base's."""
    epoch, position = divmod(step, sampler.steps_per_epoch)
    state = {"step": step, "epoch": epoch, "position": position, "steps_per_epoch": sampler.steps_per_epoch,
             "seed": sampler.seed, "n_examples": sampler.n_examples, "examples_per_step": sampler.examples_per_step,
             "group_by_length": getattr(sampler, "lengths", None) is not None, "world_size": sampler.world_size,
             "trained_tokens": trained_tokens, "run_id": run_id, "data_fingerprint": data_fingerprint}
    if base_fingerprint is not None:
        state["base_fingerprint"] = base_fingerprint
    return state


def check_same_base(state: dict[str, Any], model, folder: Path) -> None:
    """Refuse a resume over a quantized base other than the one the checkpoint's adapter was trained over: the
    same model_name whose files changed, or a bitsandbytes that quantizes them differently."""
    saved, current = state.get("base_fingerprint"), recorded_base_fingerprint(model)
    if saved != current:
        raise UserError(f"checkpoint {folder}: its adapter was trained over a quantized base with fingerprint "
                        f"{(saved or 'none')[:12]}, and the base built now has {(current or 'none')[:12]}: "
                        f"model_name's weights or the bitsandbytes version differ; resume with the base and "
                        f"bitsandbytes the run started with, or start a new output_dir")


def check_resumable(state: dict[str, Any], sampler, folder: Path) -> None:
    """Refuse a resume whose step would point at other examples than the saved run's step did."""
    current = training_state(0, 0, sampler)
    for key in SAMPLER_KEYS:
        if key in state and state[key] != current[key]:
            raise UserError(f"checkpoint {folder}: saved with {key}={state[key]} but this run has {current[key]}; "
                            f"resume with the same seed, data and batch_size x processes x "
                            f"gradient_accumulation_steps, or start a new output_dir")


# ---------------------------------------------------------------- files

def saved_run_id(folder: Path) -> str | None:
    """The run id in the checkpoint's state.json; None when it has none (written before run ids) or is unreadable."""
    try:
        return json.loads((folder / STATE_FILE).read_text(encoding="utf-8")).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def read_run_id(output_dir: str | Path) -> str | None:
    """The id of the run last started in output_dir, or None (no run yet, or one from before run ids)."""
    path = Path(output_dir) / RUN_ID_FILE
    if not path.is_file():
        return None
    return path.read_text(encoding="utf-8").strip() or None


def write_run_id(output_dir: Path, run_id: str) -> None:
    atomic_write(output_dir / RUN_ID_FILE, run_id)


def new_run_id() -> str:
    return secrets.token_hex(8)


def checked(folder: Path, verified: dict[Path, str | None]) -> str | None:
    """verify(folder), computed once per process: rotation asks about the same folders at every save, and hashing a
    large checkpoint takes minutes."""
    if folder not in verified:
        verified[folder] = verify(folder)
    return verified[folder]


def latest_checkpoint(output_dir: str | Path, log: Callable[[str], Any] = print, run_id: str | None = None,
                      verified: dict[Path, str | None] | None = None) -> Path | None:
    """The newest checkpoint that verifies, of the run `run_id` when given. Another run's checkpoints, interrupted
    saves and corrupted checkpoints are reported and skipped."""
    verified = {} if verified is None else verified
    newest, newest_step = None, -1
    for step, folder in reversed(step_folders(output_dir)):
        if run_id is not None and (other := saved_run_id(folder)) != run_id:
            log(f"skipping checkpoint {folder}: written by another run ({other or 'without a run id'}), not by "
                f"{Path(output_dir) / RUN_ID_FILE}'s run {run_id}; to continue that run, pass checkpoint={folder}")
            continue
        problem = checked(folder, verified)
        if problem is None:
            newest, newest_step = folder, step
            break
        log(f"skipping checkpoint {folder}: {problem}")
    for step, folder in building_step_folders(output_dir):
        if step > newest_step:
            log(f"skipping {folder}: a save that was interrupted; it is never loaded")
    return newest


def previous_checkpoint_note(output_dir: Path, run_id: str | None = None) -> str:
    """Which checkpoint a failed write leaves to resume from: the newest complete one (of run `run_id`, when given)."""
    complete = [p for _, p in step_folders(output_dir)
                if (p / MARKER).is_file() and (run_id is None or saved_run_id(p) == run_id)]
    return f"the previous checkpoint {complete[-1]} is intact" if complete else "there is no earlier checkpoint"


def rotate(output_dir: str | Path, run_id: str, keep_last: int | None, keep_every: int | None = None,
           started_from: Path | None = None, verified: dict[Path, str | None] | None = None) -> None:
    """Delete the leftovers of interrupted saves, and the checkpoints of run `run_id` (and `started_from`, the
    checkpoint a resume started from) older than its newest `keep_last` valid ones, sparing multiples of
    `keep_every` (permanent). Another run's checkpoints, and corrupt ones newer than those kept, are left alone.
    Main process only, never during a save."""
    for _, folder in building_step_folders(output_dir):
        shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(building_folder(final_folder(output_dir)), ignore_errors=True)
    if keep_last is None:
        return
    verified = {} if verified is None else verified
    ours = [(step, folder) for step, folder in step_folders(output_dir)
            if folder == started_from or saved_run_id(folder) == run_id]
    valid = 0
    for step, folder in reversed(ours):
        if valid < keep_last:
            valid += checked(folder, verified) is None
        elif not (keep_every and step % keep_every == 0):
            shutil.rmtree(folder, ignore_errors=True)
            verified.pop(folder, None)


def set_aside(folder: Path, log: Callable[[str], Any], why: str) -> Path:
    """Rename a checkpoint this run must not overwrite to step_N.set-aside-K (a name nothing loads or rotates)."""
    number = 1
    while (target := set_aside_checkpoint(folder, number)).exists():
        number += 1
    move(folder, target)
    log(f"{why}: renamed {folder} to {target.name}; nothing loads or deletes it")
    return target


class CheckpointingBackend(ProcessRanks, Protocol):
    """What saving, loading and resuming a checkpoint ask the run's backend (backends/backend.py)."""
    engine_saves_state: bool
    engine_state_dir: str
    engine_name: str

    @property
    def scaler(self): ...

    def print(self, *args, **kwargs) -> None: ...

    def wait_for_everyone(self) -> None: ...

    def unwrap(self, model): ...

    def saveable_state_dict(self, model) -> dict[str, torch.Tensor]: ...

    def optimizer_state_dict(self, optimizer) -> dict[str, Any]: ...

    def save_engine_state(self, model, optimizer, folder: Path) -> None: ...

    def load_engine_state(self, model, optimizer, folder: Path) -> None: ...

    def engine_pickled_types(self) -> list[type]: ...


# ---------------------------------------------------------------- save / load

def save_checkpoint(folder: Path, backend: CheckpointingBackend, model, optimizer, scheduler, state: dict[str, Any],
                    config_yaml: str, data_state: dict[str, Any] | None = None,
                    objective_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the checkpoint atomically. A collective: every rank calls it.

    A failed write (a full disk, a quota) removes the partial `.tmp` folder and raises a one-line TrainingError;
    the previous checkpoints are untouched, since nothing is deleted before a save completes.
    """
    tmp = building_folder(folder)
    try:
        if backend.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / RNG_DIR).mkdir(parents=True)
        backend.wait_for_everyone()
        state_dict = backend.saveable_state_dict(model)  # gathers ZeRO-3 shards: every rank must call it
        torch_save(rng_state(), tmp / RNG_DIR / f"rank{backend.rank}.pt")
        if objective_state:
            (tmp / OBJECTIVE_DIR).mkdir(exist_ok=True)
            torch_save(objective_state, tmp / OBJECTIVE_DIR / f"rank{backend.rank}.pt")
        if backend.engine_saves_state:
            backend.save_engine_state(model, optimizer, tmp / backend.engine_state_dir)
        if backend.is_main_process:
            backend.unwrap(model).save_pretrained(tmp / MODEL_DIR, state_dict=state_dict, safe_serialization=True)
            if not backend.engine_saves_state:
                torch_save(backend.optimizer_state_dict(optimizer), tmp / OPTIMIZER_FILE)
            torch_save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
            if backend.scaler is not None:
                torch_save(backend.scaler.state_dict(), tmp / SCALER_FILE)
            if data_state is not None:
                torch_save(data_state, tmp / DATA_STATE_FILE)
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1), encoding="utf-8")
            (tmp / CONFIG_FILE).write_text(config_yaml, encoding="utf-8")
        backend.wait_for_everyone()
        if backend.is_main_process:
            write_marker(tmp)
            replace_folder(tmp, folder)
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as "I/O error: ..."
        if backend.is_main_process:  # the one writer of the folder; a later rotate() sweeps what remains
            shutil.rmtree(tmp, ignore_errors=True)
        reason, advice = write_failure(exc)
        raise TrainingError(f"step {state['step']}: could not write checkpoint {folder} ({reason}); "
                            f"{previous_checkpoint_note(folder.parent, state.get('run_id'))}. "
                            f"{advice.capitalize()}, then rerun with resume=auto") from exc
    backend.wait_for_everyone()
    return folder


def save_step_checkpoint(output_dir: Path, state: TrainState, checkpointer: Checkpointer, model, optimizer,
                         scheduler) -> Path:
    """The loop's checkpoint: step_N/ with the sampler's state and the run's identity, then rotation of older ones."""
    backend = checkpointer.backend
    folder = step_folder(output_dir, state.step)
    if backend.is_main_process and folder.is_dir() and saved_run_id(folder) != checkpointer.lineage.run_id:
        set_aside(folder, backend.print, f"{folder.name} holds another run's checkpoint")
    save_checkpoint(folder, backend, model, optimizer, scheduler,
                    training_state(state.step, state.trained_tokens, checkpointer.sampler,
                                   checkpointer.lineage.run_id, checkpointer.fingerprint,
                                   recorded_base_fingerprint(model)),
                    checkpointer.config_yaml, checkpointer.sampler.data_state(), checkpointer.objective_state())
    if backend.is_main_process:
        checkpointer.lineage.verified[folder] = None  # just written and hashed
        checkpointer.rotate()
    return folder


@dataclass
class Lineage:
    """Which checkpoints in output_dir are this run's: those with its id, and the one a resume started from."""
    run_id: str
    started_from: Path | None = None
    verified: dict[Path, str | None] = field(default_factory=dict)  # verify() of the folders checked so far


class Checkpointer:
    """The loop's step_N/ checkpoints: due every save_every steps but the last (final/ is written then), and rotated
    when the run starts, after each save, and when the run ends."""

    def __init__(self, settings: Checkpoints, config_yaml: str, backend: CheckpointingBackend, sampler,
                 total_steps: int, lineage: Lineage, fingerprint: str | None, objective) -> None:
        self.output_dir = Path(settings.output_dir)
        self.every, self.keep_last, self.keep_every = settings.save_every, settings.keep_last, settings.keep_every
        self.backend, self.sampler, self.total_steps = backend, sampler, total_steps
        self.objective_state = objective.state_dict  # what the run's objective needs at its next step
        self.lineage, self.fingerprint = lineage, fingerprint
        self.config_yaml = config_yaml  # the run's whole config (redacted), saved in every checkpoint

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0 and step != self.total_steps

    def save(self, state: TrainState, model, optimizer, scheduler) -> Path:
        return save_step_checkpoint(self.output_dir, state, self, model, optimizer, scheduler)

    def rotate(self) -> None:
        """Main process only."""
        rotate(self.output_dir, self.lineage.run_id, self.keep_last, self.keep_every, self.lineage.started_from,
               self.lineage.verified)

    def last_kept(self) -> Path | None:
        """The newest complete checkpoint of this run (or the one it resumed from): what a failed end leaves."""
        ours = [folder for _, folder in step_folders(self.output_dir) if (folder / MARKER).is_file()
                and (folder == self.lineage.started_from or saved_run_id(folder) == self.lineage.run_id)]
        return ours[-1] if ours else None


def load_model_weights(model, model_dir: Path) -> None:
    """Load saved weights (full model or adapter) into an already built model, in place."""
    from safetensors.torch import load_file

    adapter_file = model_dir / "adapter_model.safetensors"
    if adapter_file.is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(adapter_file)))
        return
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise UserError(f"checkpoint {model_dir}: no safetensors weights")
    state_dict = {}
    for shard in shards:
        state_dict.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    # A tied output embedding is saved once, under the input embedding's name; anything else missing is a mismatch.
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise UserError(f"checkpoint {model_dir}: weights do not fit this model (e.g. {(missing or unexpected)[0]})")


def load_checkpoint(folder: Path, backend: CheckpointingBackend, model, optimizer, scheduler,
                    verified: dict[Path, str | None] | None = None) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, scaler and this rank's RNG from a verified checkpoint; return its state.
    `verified` holds what verify() already said about folders (see `checked`)."""
    problem = checked(folder, {} if verified is None else verified)
    if problem is not None:
        raise UserError(f"checkpoint {folder}: {problem}; pick another step_N folder")
    if backend.engine_saves_state:
        engine_dir = folder / backend.engine_state_dir
        if not engine_dir.is_dir():
            raise UserError(f"checkpoint {folder}: written without {backend.engine_name}, so it has no engine state "
                            f"to resume a {backend.engine_name} run from; resume it with the launcher it was written "
                            f"with")
        check_tensor_files(engine_dir, backend.engine_pickled_types())
        backend.load_engine_state(model, optimizer, engine_dir)
    else:
        if not (folder / OPTIMIZER_FILE).is_file():
            raise UserError(f"checkpoint {folder}: written under DeepSpeed or FSDP2 (its state is in deepspeed/ or "
                            f"fsdp/); resume it with the same launch")
        load_model_weights(backend.unwrap(model), folder / MODEL_DIR)
        optimizer.load_state_dict(load_tensors(folder / OPTIMIZER_FILE, map_location="cpu"))
    scheduler.load_state_dict(load_tensors(folder / SCHEDULER_FILE))
    if (folder / SCALER_FILE).is_file() and backend.scaler is not None:
        backend.scaler.load_state_dict(load_tensors(folder / SCALER_FILE))
    rng_file = folder / RNG_DIR / f"rank{backend.rank}.pt"
    if rng_file.is_file():
        set_rng_state(load_tensors(rng_file))
    return json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))


# ---------------------------------------------------------------- resuming

@dataclass
class ResumePoint:
    """Where a run starts, decided before any data is read: the checkpoint it continues (None: step 0), whether a
    plain rerun chose it (`resume` unset), what verify() said about the folders looked at, and whether the run in
    output_dir already finished with this config (then there is nothing to train)."""
    folder: Path | None
    rerun: bool = False
    verified: dict[Path, str | None] = field(default_factory=dict)
    finished: bool = False

    @property
    def alternative(self) -> str:
        """What else a refused resume can do, besides keeping the checkpoint's values."""
        if self.rerun:
            return f"pass resume=never to start over, setting that run aside, or {NEW_OUTPUT_DIR}"
        return NEW_OUTPUT_DIR


def find_resume_checkpoint(checkpoint: str | None, resume: str | None, output_dir: str | Path,
                           log: Callable[[str], Any] = print,
                           verified: dict[Path, str | None] | None = None) -> Path | None:
    """`checkpoint=PATH` names the folder; `resume=auto` (or `checkpoint=auto`) takes the newest valid one in
    output_dir of the run last started there (see the module's docstring) and starts fresh when there is none;
    `resume` unset does the same when output_dir/run_id names a run, so a rerun continues it; `resume=never` starts
    fresh."""
    if checkpoint and resume == "never":
        raise UserError(f"checkpoint={checkpoint} and resume=never: one continues a run, the other starts over; "
                        f"drop one of them")
    if checkpoint and checkpoint != "auto":
        path = Path(checkpoint)
        if not path.is_dir():
            raise UserError(f"checkpoint: {path} is not a folder; give a step_N folder, or use resume=auto")
        return path
    if checkpoint == "auto" or resume == "auto":
        run_id = read_run_id(output_dir)
        found = latest_checkpoint(output_dir, log, run_id, verified)
        if found is None:
            of_run = f" of its run {run_id}" if run_id else ""
            log(f"resume=auto: no complete checkpoint{of_run} in {output_dir}; starting fresh")
        return found
    if resume == "never":
        return None
    run_id = read_run_id(output_dir)
    found = latest_checkpoint(output_dir, log, run_id, verified) if run_id else None
    existing = step_folders(output_dir)
    if found is None and existing:
        log(f"note: {output_dir} already holds checkpoints (newest {existing[-1][1].name}) but this run starts "
            f"fresh: none is a valid checkpoint of the run last started there ({RUN_ID_FILE}); continue one with "
            f"checkpoint=PATH. They stay: this run never rotates them away, and sets aside one whose name it needs")
    return found


def finished_after(output_dir: Path, folder: Path) -> bool:
    """Whether a complete final/ was written after checkpoint `folder`: by the run named in output_dir/run_id (every
    run rewrites that file when it starts), so that run reached its last step after this checkpoint."""
    final_marker, marker = final_folder(output_dir) / MARKER, folder / MARKER
    return final_marker.is_file() and final_marker.stat().st_mtime_ns > marker.stat().st_mtime_ns


def start_over(output_dir: Path, log: Callable[[str], Any]) -> None:
    """resume=never: move what earlier runs wrote into output_dir (RUN_OUTPUTS) into output_dir/set-aside-K/, the
    next free K, so the run starts in a fresh folder and nothing of the previous one is deleted. Anything else in
    output_dir stays where it is. Main process only."""
    taken = [number for number, _ in set_aside_folders(output_dir)]
    moving = sorted(p for p in output_dir.iterdir() if RUN_OUTPUTS.match(p.name))
    if not moving:
        return
    target = set_aside_folder(output_dir, max(taken, default=0) + 1)
    target.mkdir()
    for path in moving:
        move(path, target / path.name)
    log(f"resume=never: moved the previous run's files ({', '.join(p.name for p in moving)}) into {target}; "
        f"nothing was deleted; training from step 0")


def finished_without_checkpoint(output_dir: Path, config: TrainConfig) -> str:
    """The line for a run into an output_dir whose final/ holds a finished run and no checkpoint to continue it
    from: nothing to do when this config trains what that run trained (final/config.yaml); otherwise refused in one
    line naming the changed keys, since training from step 0 would replace its final/."""
    path = final_folder(output_dir) / CONFIG_FILE
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        saved = None
    start_over_instead = ("choose a new output_dir, or pass resume=never to train from step 0 with the finished run "
                          "set aside (not deleted)")
    if not isinstance(saved, dict):
        raise UserError(f"output_dir {output_dir}: holds a finished run (final/) without a readable {path.name}, so "
                        f"whether this config trains the same cannot be told; {start_over_instead}")
    changes = config_changes(saved, config, {}, None)
    if changes:
        raise UserError(f"output_dir {output_dir}: holds a finished run (final/) that left no checkpoint to "
                        f"continue, and this config changes what it trained: {described(changes)}; "
                        f"{start_over_instead}")
    return (f"output_dir {output_dir}: its last run finished (final/) with this config; nothing to do. To train "
            f"again from step 0, pass resume=never (the finished run is set aside, not deleted) or choose another "
            f"output_dir")


def resume_point(config: TrainConfig, backend: CheckpointingBackend, log: Callable[[str], Any] = print) -> ResumePoint:
    """Decide where the run starts before any data is read, and say so first: the checkpoint it continues (see
    find_resume_checkpoint), checked against this config; or step 0, in a fresh output_dir under resume=never.
    Refused in one line: a checkpoint that does not verify, a config that changes what its run trains (the data's
    content is compared later, once it is read), and a config that changes what a finished run without checkpoints
    trained (its final/ would be replaced). A run that already finished with this config (a plain rerun, or
    resume=auto with no checkpoint) is `finished`, said in one line: there is nothing to train."""
    output_dir = Path(config.output_dir)
    resume = getattr(config, "resume", None)
    found: list[str] = []  # what the search reported, said after the line that says what the run does
    start = ResumePoint(None, rerun=not config.checkpoint and resume is None)
    start.folder = find_resume_checkpoint(config.checkpoint, resume, output_dir, found.append, start.verified)
    if resume == "never":
        if backend.is_main_process:
            start_over(output_dir, log)
        backend.wait_for_everyone()  # no rank reads output_dir while it is being emptied
    folder = start.folder
    if folder is None and resume != "never" and final_folder(output_dir).is_dir():
        log(finished_without_checkpoint(output_dir, config))
        start.finished = True
        return start
    if folder is None and start.rerun and (run_id := read_run_id(output_dir)) and not step_folders(output_dir):
        # A run stopped before its first save: nothing to continue, no model to keep; only its record is replaced.
        found.insert(0, f"note: the run last started in {output_dir} ({run_id}) left no checkpoint and no final/, "
                        f"so this run starts from step 0 and its metrics replace that run's")
    if folder is not None:
        problem = checked(folder, start.verified)
        if problem is not None:
            raise UserError(f"checkpoint {folder}: {problem}; pick another step_N folder")
        saved_state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
        saved = yaml.safe_load((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        changes = config_changes(saved, config, saved_state, None,
                                 compare_data=not saved_state.get("data_fingerprint"))
        refuse_changes(folder, changes, config, start.alternative)
        if start.rerun and not changes and finished_after(output_dir, folder):
            log(f"output_dir {output_dir}: its last run finished (final/ is newer than its last checkpoint, "
                f"{folder.name}) with this config; nothing to do. To train again, pass resume=never (from step 0; "
                f"the finished run is set aside, not deleted) or resume=auto (from {folder.name}), or choose "
                f"another output_dir")
            start.finished = True
            return start
        if start.rerun:
            log(f"resuming: {output_dir} holds a checkpoint of its last run ({saved_run_id(folder)}), {folder}; "
                f"continuing it (resume=never starts over, setting that run aside)")
        else:
            log(f"resuming from {folder}")
    for line in found:
        log(line)
    return start


def load_objective_state(folder: Path, backend: CheckpointingBackend, objective) -> None:
    """Give the objective this rank's objective/rank{r}.pt, when the checkpoint holds objective state: written by
    as many processes as this run has, or refused (each rank's state belongs to its own share of the step)."""
    saved = sorted((folder / OBJECTIVE_DIR).glob("rank*.pt"))
    if not saved:
        return
    if len(saved) != backend.world_size:
        raise UserError(f"checkpoint {folder}: was written between two steps that train on the same sampled "
                        f"completions, by {len(saved)} processes; resume it with {len(saved)} processes, or from an "
                        f"earlier checkpoint")
    objective.load_state_dict(load_tensors(folder / OBJECTIVE_DIR / f"rank{backend.rank}.pt"))


def resume_training(config: TrainConfig, backend: CheckpointingBackend, model, optimizer, scheduler, sampler,
                    start: ResumePoint, fingerprint: str | None = None, log: Callable[[str], Any] = print,
                    objective=None) -> tuple[TrainState, Lineage]:
    """The state to start the loop from, restored from `start`'s checkpoint (else step 0), and the run's lineage;
    `objective` gets back its state (load_state_dict) when the checkpoint holds one. A checkpoint whose config
    trained something else than this one (or its data had another `fingerprint`) is refused, unless
    resume_allow_changes lists the changed keys. The main process then records the run in output_dir, and sets
    aside this run's checkpoints past the step it resumes from."""
    output_dir = Path(config.output_dir)
    folder, verified = start.folder, start.verified
    state, lineage = TrainState(), Lineage(new_run_id(), verified=verified)
    if folder is not None:
        saved = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
        changed = check_config_changes(folder, yaml.safe_load((folder / CONFIG_FILE).read_text(encoding="utf-8")),
                                       config, saved, fingerprint, sampler.steps_per_epoch, log, start.alternative)
        fresh = hyperparameters(scheduler)
        check_same_base(saved, model, folder)  # before the adapter is loaded over it
        saved = load_checkpoint(folder, backend, model, optimizer, scheduler, verified)
        check_resumable(saved, sampler, folder)
        if changed:
            restore_hyperparameters(scheduler, *fresh)
        if (folder / DATA_STATE_FILE).is_file():
            if not getattr(sampler.store, "streaming", False):
                raise UserError(f"checkpoint {folder}: holds data_state.pt, a streamed run's position, but this run "
                                f"does not stream its data; resume it with the config it was written with (its "
                                f"config.yaml), or remove the stray file")
            sampler.load_data_state(load_tensors(folder / DATA_STATE_FILE))
        load_objective_state(folder, backend, objective)
        state = TrainState(saved["step"], saved["trained_tokens"])
        lineage = Lineage(saved.get("run_id") or new_run_id(), folder, verified)
        epoch, position = divmod(state.step, sampler.steps_per_epoch)
        log(f"resumed from {folder} at step {state.step} (epoch {epoch + 1}, step {position} of "
            f"{sampler.steps_per_epoch} in it; {state.trained_tokens:,} tokens trained so far)")
    backend.wait_for_everyone()  # every rank has read output_dir before the main process changes it
    if backend.is_main_process:
        for step, later in step_folders(output_dir):
            if step > state.step and saved_run_id(later) == lineage.run_id:
                set_aside(later, log, f"{later.name} is this run's, past step {state.step} where it resumes")
        write_run_id(output_dir, lineage.run_id)
    return state, lineage
