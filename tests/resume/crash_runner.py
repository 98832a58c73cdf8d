"""Run `gpt4all-training train ARGS` and stop it at one chosen point with a real signal, for the resume tests.

`CRASH_AT=<point>:<step>` picks the point (rank 0 only; the training code itself is unchanged):
- `after_step:K`   SIGKILL right after step K's training row is logged;
- `after_save:K`   SIGKILL right after the checkpoint of step K is complete (and rotation ran);
- `during_eval:K`  SIGKILL inside the validation pass of step K, before its second batch;
- `during_save:K`  SIGKILL while step_K.tmp/ is being written: every file is there but the COMPLETE marker;
- `before_rotate:K`  SIGKILL once step_K/ is complete, before the older checkpoints are rotated away;
- `SIGTERM:K` / `SIGINT:K`  send that signal to this process right after step K's training row is logged;
  `SIGTERM+SIGTERM:K` (any signals joined by `+`) sends each in turn.
Works as the script of `python` and of `torchrun`.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import gpt4all_training.training.checkpoint as checkpoint
import gpt4all_training.training.evaluate as evaluate
import gpt4all_training.tracking.tracker as tracking
from gpt4all_training.cli.main import main

POINT, _, STEP = os.environ.get("CRASH_AT", "none:0").partition(":")
STEP = int(STEP)
seen = {"step": 0, "eval_batches": 0}


def kill(signum: int = signal.SIGKILL) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signum)


def wrap_tracker_log(original):
    def log(self, metrics, step):
        original(self, metrics, step)
        if not self.enabled or "loss" not in metrics:
            return
        seen["step"], seen["eval_batches"] = step, 0
        if step == STEP and POINT == "after_step":
            kill()
        if step == STEP and POINT.startswith("SIG"):
            for name in POINT.split("+"):
                kill(getattr(signal, name))
    return log


def wrap_save(original):
    def save(output_dir, state, *args, **kwargs):
        folder = original(output_dir, state, *args, **kwargs)
        if POINT == "after_save" and state.step == STEP and int(os.environ.get("RANK", "0")) == 0:
            kill()
        return folder
    return save


def wrap_eval_loss(original):
    def token_loss_sum(model, batch):
        seen["eval_batches"] += 1
        if POINT == "during_eval" and seen["step"] == STEP and seen["eval_batches"] == 2:
            kill()
        return original(model, batch)
    return token_loss_sum


def wrap_write_marker(original):
    def write_marker(folder):
        if POINT == "during_save" and folder.name == f"step_{STEP}.tmp":
            kill()
        return original(folder)
    return write_marker


def wrap_rotate(original):
    def rotate(output_dir, *args, **kwargs):
        if POINT == "before_rotate" and (Path(output_dir) / f"step_{STEP}").is_dir():
            kill()
        return original(output_dir, *args, **kwargs)
    return rotate


tracking.Tracker.log = wrap_tracker_log(tracking.Tracker.log)
checkpoint.rotate = wrap_rotate(checkpoint.rotate)
checkpoint.save_step_checkpoint = wrap_save(checkpoint.save_step_checkpoint)
evaluate.token_loss_sum = wrap_eval_loss(evaluate.token_loss_sum)
checkpoint.write_marker = wrap_write_marker(checkpoint.write_marker)

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
