"""Run `gpt4all-training train ARGS` with one fault injected from outside the training code, for the hardening tests.

`FAULT=<kind>:<step>` (the step is 1-based, the fault happens just before that optimiser step runs):
- `nan_loss:K`        the training loss of step K is multiplied by NaN on every rank (the gradients become NaN too);
- `data_vanishes:K`   every *_clean.jsonl under $FAULT_DATA is deleted, except one that is truncated mid-line;
- `read_only:K`       output_dir ($FAULT_OUTPUT) loses its write permission (run it without CAP_DAC_OVERRIDE);
- `stop_rank:K`       this process sends itself $FAULT_SIGNAL (KILL or STOP) when RANK == $FAULT_RANK;
- `metrics_full:K`    no file may grow past metrics.jsonl's size now (RLIMIT_FSIZE), so its next row fails as on a
                      full disk;
- `metrics_read_only:K` metrics.jsonl and output_dir ($FAULT_OUTPUT) lose their write permission, as after a
                      read-only remount (run it without CAP_DAC_OVERRIDE);
- `final_full:0`      just before final/ is written, no file may grow past 300 kB (the model's weights are 0.9 MB).
The production modules are wrapped by name, as tests/resume/crash_runner.py does; nothing in them knows about it.
"""

from __future__ import annotations

import inspect
import os
import resource
import signal
import sys
from pathlib import Path

import gpt4all_training.training.final as final
import gpt4all_training.training.loop as train
import gpt4all_training.training.objectives.sft as sft_objective
from gpt4all_training.cli.main import main

KIND, _, STEP = os.environ.get("FAULT", "none:0").partition(":")
STEP = int(STEP)
current = {"step": 0}  # 1-based number of the optimiser step being run


def break_the_data(folder: Path) -> None:
    files = sorted(folder.glob("*_clean.jsonl"))
    keep = files[-1]
    data = keep.read_bytes()
    keep.write_bytes(data[:len(data) // 2 + 7])  # cut in the middle of a line
    for path in files[:-1]:
        path.unlink()


def wrap_train_step(original):
    signature = inspect.signature(original)

    def train_step(*args, **kwargs):
        current["step"] = signature.bind(*args, **kwargs).arguments["step"] + 1
        if current["step"] == STEP:
            if KIND == "data_vanishes":
                break_the_data(Path(os.environ["FAULT_DATA"]))
            if KIND == "read_only":
                Path(os.environ["FAULT_OUTPUT"]).chmod(0o555)
            if KIND == "metrics_full":
                size = (Path(os.environ["FAULT_OUTPUT"]) / "metrics.jsonl").stat().st_size
                resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
            if KIND == "metrics_read_only":
                (Path(os.environ["FAULT_OUTPUT"]) / "metrics.jsonl").chmod(0o444)
                Path(os.environ["FAULT_OUTPUT"]).chmod(0o555)
            if KIND == "stop_rank" and os.environ.get("RANK", "0") == os.environ["FAULT_RANK"]:
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), getattr(signal, "SIG" + os.environ["FAULT_SIGNAL"]))
        return original(*args, **kwargs)
    return train_step


def wrap_loss(original):
    def token_loss_sum(model, batch):
        loss = original(model, batch)
        return loss * float("nan") if KIND == "nan_loss" and current["step"] == STEP else loss
    return token_loss_sum


def wrap_save_final(original):
    def save_final(*args, **kwargs):
        if KIND == "final_full":
            resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))
        return original(*args, **kwargs)
    return save_final


train.train_step = wrap_train_step(train.train_step)
final.save_final = wrap_save_final(final.save_final)
sft_objective.token_loss_sum = wrap_loss(sft_objective.token_loss_sum)  # the fine-tuning objective's loss

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
