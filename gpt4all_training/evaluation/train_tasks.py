"""The training config's `eval_tasks`: the harness on final/ once training has finished, and with
`eval_tasks_every` on the model being trained, every N steps.

Training sits below the stages, so the loop knows nothing of the harness: the `train` command checks the task names
before training starts (a misspelt one fails then rather than after the run), hands the loop a `TaskEvaluator` (a
component the loop asks whether it is due, like its validation loss), and calls `evaluate_final` on the main process
once the run has written final/. The scores go to output_dir/eval/results.json (final/) and, as
`harness/<task>/<metric>` at their step, to the run's trackers.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import UserError
from gpt4all_training.evaluation.harness import EvalSettings, Keys, evaluate, load_tasks, score, task_manager_for
from gpt4all_training.evaluation.results import (interval_table, report_rows, results_table, tracker_metrics,
                                                write_results)
from gpt4all_training.run_folder import EVAL_DIR, final_folder
from gpt4all_training.tracking.report import write_report
from gpt4all_training.tracking.tracker import Tracker

KEYS = Keys(tasks="eval_tasks", include_path="eval_include_path")


def settings_of(config: TrainConfig) -> EvalSettings:
    return EvalSettings(tasks=tuple(config.eval_tasks or ()),
                        include_paths=(config.eval_include_path,) if config.eval_include_path else (),
                        limit=config.eval_tasks_limit, dtype=config.dtype)


def check_eval_tasks(config: TrainConfig) -> None:
    """Every name in eval_tasks is a task the harness can find (a UserError naming the first that is not)."""
    if config.eval_tasks:
        settings = settings_of(config)
        task_manager_for(settings.tasks, settings.include_paths, KEYS)


def evaluate_final(config: TrainConfig, summary: dict[str, Any], log: Callable[[str], Any] = print
                   ) -> dict[str, Any]:
    """Score final/ on eval_tasks; write and log the results at the run's last step, and write report.html again
    with the scores and their intervals."""
    output_dir = Path(config.output_dir)
    results = evaluate(str(final_folder(output_dir)), settings_of(config), KEYS)
    path = write_results(results, output_dir / EVAL_DIR)
    tracker = Tracker(output_dir, config, config.to_dict(), enabled=True, resume_step=summary["steps"])
    with contextlib.closing(tracker):
        tracker.log(tracker_metrics(results), summary["steps"])
    write_report(output_dir, summary, report_rows(results))
    log(results_table(results))
    log(interval_table(results))
    log(f"harness results: {path}")
    return results


@contextlib.contextmanager
def random_state_kept():
    """The harness seeds Python's, NumPy's and torch's generators; training continues with the states it had, so a
    run scores the same weights whether or not it evaluates on the way."""
    python, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy_state)


class TaskEvaluator:
    """eval_tasks on the model being trained, every eval_tasks_every steps (not at the last step: final/ is scored
    after the run). The main process scores the whole model while the others wait, so it needs every rank to hold
    the whole model: one process, DDP or ZeRO-1/2, not parameter sharding (ZeRO-3, FSDP2)."""

    def __init__(self, config: TrainConfig, backend, tokenizer, total_steps: int, log: Callable[[str], Any]):
        if backend.partitions_parameters:
            raise UserError("eval_tasks_every: not available when parameters are sharded across processes (ZeRO-3, "
                            "FSDP2); unset it, eval_tasks still scores final/")
        self.settings, self.backend, self.tokenizer = settings_of(config), backend, tokenizer
        self.every, self.total_steps, self.log = config.eval_tasks_every, total_steps, log

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0 and step < self.total_steps

    def run(self, model, step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.backend.is_main_process:
            manager = task_manager_for(self.settings.tasks, self.settings.include_paths, KEYS)
            tasks = load_tasks(manager, self.settings.tasks, KEYS)
            with random_state_kept(), self.backend.autocast():
                results = score(self.backend.unwrap(model), self.tokenizer, manager, tasks, self.settings,
                                f"the model at step {step}")
            model.train()  # the harness put it in eval mode
            metrics = tracker_metrics(results)
            self.log(f"step {step}: " + ", ".join(f"{key} {value:.4f}" for key, value in metrics.items()))
        self.backend.wait_for_everyone()
        return metrics
