"""After a resume the metrics continue the same record: rows after the checkpoint are dropped (they are replayed),
a line cut by the crash is dropped, and wandb continues the same run."""

from __future__ import annotations

import json

from gpt4all_training.config.blocks import Logging
from gpt4all_training.run_folder import WANDB_ID_FILE
from gpt4all_training.tracking.tracker import Tracker, read_metrics, wandb_run_id


def test_resume_drops_rows_after_the_checkpoint_and_a_cut_line(tmp_path):
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
    tracker = Tracker(tmp_path, Logging(report_to=["jsonl"]), {}, enabled=True, resume_step=3)
    assert read_metrics(tmp_path / "metrics.jsonl") == rows[:3]
    tracker.log({"loss": 0.25}, 4)
    assert read_metrics(tmp_path / "metrics.jsonl") == [*rows[:3], {"step": 4, "loss": 0.25}]
    tracker.close()


def test_wandb_run_id_is_kept_for_a_resume_and_renewed_for_a_fresh_start(tmp_path):
    first = wandb_run_id(tmp_path, resume_step=0)
    assert (tmp_path / WANDB_ID_FILE).read_text() == first
    assert wandb_run_id(tmp_path, resume_step=12) == first
    fresh = wandb_run_id(tmp_path, resume_step=0)
    assert fresh != first and (tmp_path / WANDB_ID_FILE).read_text() == fresh
