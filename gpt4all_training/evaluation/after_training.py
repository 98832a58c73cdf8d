"""The training config's `eval_tasks`: the harness run on `output_dir/final/` once training has finished.

The training loop knows nothing of this (training sits below the stages); the `train` command checks the task names
before training starts, so a misspelt one fails then rather than after the run, and calls `evaluate_final` on the
main process once the run has written final/. The scores go to output_dir/eval/results.json and, as
`harness/<task>/<metric>` at the run's last step, to the run's own trackers, reopened for it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.evaluation.harness import EvalSettings, Keys, evaluate, task_manager_for
from gpt4all_training.evaluation.results import results_table, tracker_metrics, write_results
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


def evaluate_final(config: TrainConfig, step: int, log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Score final/ on eval_tasks; write and log the results at `step`, the run's last."""
    output_dir = Path(config.output_dir)
    results = evaluate(str(output_dir / "final"), settings_of(config), KEYS)
    path = write_results(results, output_dir / "eval")
    tracker = Tracker(output_dir, config.report_to, config.to_dict(), enabled=True, resume_step=step,
                      project=config.wandb_project_name, entity=config.wandb_entity)
    with contextlib.closing(tracker):
        tracker.log(tracker_metrics(results), step)
    log(results_table(results))
    log(f"harness results: {path}")
    return results
