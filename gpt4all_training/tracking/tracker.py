"""Metrics to metrics.jsonl, TensorBoard and wandb behind one small interface; main process only.

A resumed run continues the same record: metrics.jsonl drops the rows logged after the checkpoint (they are
replayed, exactly), TensorBoard purges them, and wandb continues the same run (its id is kept in output_dir) without
re-sending steps it already has, so its step never goes backwards.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from gpt4all_training.config.blocks import Logging
from gpt4all_training.config.secrets import redact, scrub, streams_beneath_scrubbing
from gpt4all_training.errors import TrainingError, write_failure
from gpt4all_training.files import atomic_write
from gpt4all_training.run_folder import METRICS_FILE, TENSORBOARD_DIR, WANDB_ID_FILE

SECRET_KEYS = ("token", "password", "secret", "api_key")


def public_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config as it may be logged: anything that looks like a credential is left out, and a credential from the
    environment pasted into another value is hidden."""
    return redact({k: v for k, v in config.items() if not k.lower().endswith(SECRET_KEYS)})


def metrics_write_error(path: Path, exc: OSError, when: str) -> TrainingError:
    reason, advice = write_failure(exc)
    return TrainingError(f"{when}: could not write {path} ({reason}); {advice}, then rerun with resume=auto to "
                         f"continue from the last checkpoint")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (none when there is no file), up to a line cut by a crash, or otherwise not a row
    (not UTF-8, not a JSON object): everything before it is intact. Blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            break
        if not isinstance(row, dict):
            break
        rows.append(row)
    return rows


def wandb_run_id(output_dir: str | Path, resume_step: int) -> str:
    """The wandb run of this output_dir: the saved one when resuming, a new one (saved) otherwise."""
    path = Path(output_dir) / WANDB_ID_FILE
    if resume_step > 0 and path.is_file():
        return path.read_text(encoding="utf-8").strip()
    run_id = secrets.token_hex(6)  # wandb ids: up to 64 of [a-z0-9_-]
    atomic_write(path, run_id)
    return run_id


def wandb_settings(output_dir: str | Path) -> Any:
    """wandb's settings for a run in `output_dir`. Its metadata (host, hardware, git state, the program) records the
    command line and the run's folder in the run file; where either holds a secret, wandb records no metadata."""
    import wandb

    recorded = [*sys.argv, os.path.abspath(output_dir), os.getcwd()]
    return wandb.Settings(x_disable_meta=any(scrub(text) != text for text in recorded))


class Tracker:
    """The trackers `settings.report_to` names, in output_dir; `config` is the run's whole config, as wandb records
    it (public_config)."""

    def __init__(self, output_dir: str | Path, settings: Logging, config: dict[str, Any], enabled: bool,
                 resume_step: int = 0):
        report_to = settings.report_to
        self.enabled = enabled
        self.metrics_path = Path(output_dir) / METRICS_FILE
        self.jsonl = enabled and "jsonl" in report_to
        self.tensorboard = self.wandb_run = None
        if not enabled:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        if self.jsonl:
            # On resume, rows logged after the checkpoint are replayed; drop them so steps stay unique and monotone.
            kept = [r for r in read_metrics(self.metrics_path) if r.get("step", 0) <= resume_step]
            try:
                atomic_write(self.metrics_path, (json.dumps(r) + "\n" for r in kept))
            except OSError as exc:
                raise metrics_write_error(self.metrics_path, exc, f"step {resume_step}") from None
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(Path(output_dir) / TENSORBOARD_DIR), purge_step=resume_step + 1)
        if "wandb" in report_to:
            with streams_beneath_scrubbing():  # wandb's copy of the console (its run file) gets the scrubbed lines
                import wandb

            # A credential pasted into the project or entity would otherwise be stored in wandb's own files.
            self.wandb_run = wandb.init(project=redact(settings.wandb_project_name),
                                        entity=redact(settings.wandb_entity), config=public_config(config),
                                        dir=str(output_dir), id=wandb_run_id(output_dir, resume_step),
                                        resume="allow", settings=wandb_settings(output_dir))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        row = {"step": step, **metrics}
        if self.jsonl:
            try:
                with open(self.metrics_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
            except OSError as exc:  # a full disk, a read-only remount
                raise metrics_write_error(self.metrics_path, exc, f"step {step}") from None
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, step)
        if self.wandb_run is not None and step >= self.wandb_run.step:  # a resumed run already has earlier steps
            self.wandb_run.log(metrics, step=step)

    def log_histograms(self, values: dict[str, Any], step: int) -> None:
        """Distributions (a tensor of values each) to TensorBoard and wandb; metrics.jsonl keeps numbers only."""
        if self.tensorboard is not None:
            for key, tensor in values.items():
                self.tensorboard.add_histogram(key, tensor, step)
        if self.wandb_run is not None and step >= self.wandb_run.step:
            import wandb

            self.wandb_run.log({key: wandb.Histogram(tensor.numpy()) for key, tensor in values.items()}, step=step)

    def close(self) -> None:
        """Flush and close the trackers; closing again does nothing."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
