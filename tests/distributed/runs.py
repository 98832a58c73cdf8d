"""Launching training for real (subprocesses, gloo on CPU) and reading what a run left behind.

The commands are the documented ones (docs/distributed.md) with CPU device counts: `accelerate launch --config_file
configs/accelerate/<file>.yaml --num_processes 2 ... train.py --config ...`. Each launch gets a free
--main_process_port, so tests running next to other launches never share a rendezvous.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from support.files import read_jsonl
from support.launch import ACCELERATE, launch_env
from support.models import weights
from support.paths import REPO

ACCELERATE_CONFIGS = REPO / "configs" / "accelerate"
DEEPSPEED_CONFIGS = REPO / "configs" / "deepspeed"
IGNORE = -100
# Tolerances of 2-process runs against the 1-process reference (fp32, 8 AdamW steps, lr 3e-3 full / 3e-2 LoRA,
# weight decay 1.0), measured with this code on the tiny GPT-J. Correct runs differ only in the order the ranks'
# gradients are summed (and, with offload, DeepSpeed's CPU Adam in place of torch's); the "wrong" columns are the
# same launches with the loss normalisation broken on purpose (no x world-size factor; a per-rank token mean).
#                                          correct (worst)           wrong (best)   tolerance
#   per-step loss, absolute                6.6e-7                    4.8e-3         LOSS_ATOL 1e-5
#   gradient norm, relative                4.6e-6 (offload)          3.9e-2         GRAD_NORM_RTOL 1e-4
#   full weights, ||w - w_ref|| / ||w_ref - w_init||, worst tensor
#                                          1.1e-3 (QLoRA)            6.0e-2         UPDATE_RTOL 2e-3
#   LoRA adapters, max |w - w_ref|         2.7e-4 (every launcher)   4.0e-2         WEIGHT_ATOL 1e-3
# Full weights are compared relative to how far training moved them, not with one absolute bound: an embedding row
# whose gradient is a near-cancelling sum is divided by that sum's magnitude in Adam, so summation order alone moves
# such a row by up to 1.6e-4 (5 rows of 1000 under ZeRO-3) while every other tensor agrees within 7.4e-6. The LoRA
# bound has the same cause: one element of one lora_A, whose gradient nearly cancels, moves by 2.7e-4 under every
# 2-process launcher (DDP, ZeRO-2 offload, ZeRO-3, FSDP2) alike, a batch of 4 in one process against 2 x 2.
LOSS_ATOL = 1e-5
GRAD_NORM_RTOL = 1e-4
UPDATE_RTOL = 2e-3
WEIGHT_ATOL = 1e-3
# final/ reloaded against the validation loss the in-memory model measured at the last step: the same weights,
# batched differently, agree within 1.2e-7.
VAL_LOSS_ATOL = 1e-5
# final/'s logits against the 1-process model's: within 2.0e-5 (ZeRO-3's embedding rows); a wrong normalisation
# moves weights by ~1e-2.
LOGITS_ATOL = 1e-4

# Wall seconds of each launch in this session, by output folder name, for the terminal summary.
LAUNCH_SECONDS: dict[str, float] = {}


@dataclass
class Run:
    output_dir: Path
    log: str

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.output_dir / "metrics.jsonl")

    def train_rows(self) -> list[dict[str, Any]]:
        return [row for row in self.metrics() if "loss" in row]

    def series(self, key: str) -> list[float]:
        return [row[key] for row in self.train_rows()]

    def last(self, key: str) -> Any:
        return [row[key] for row in self.metrics() if key in row][-1]

    @property
    def final(self) -> Path:
        return self.output_dir / "final"


def accelerate(config_file: str, *flags: str) -> list[str]:
    """`accelerate launch --config_file configs/accelerate/CONFIG_FILE FLAGS` (the part before train.py)."""
    return [ACCELERATE, "launch", "--config_file", str(ACCELERATE_CONFIGS / config_file), *flags]


def train_command(launcher: list[str], config: Path, output_dir: Path, *overrides: str) -> list[str]:
    return [*launcher, "train.py", "--config", str(config), f"output_dir={output_dir}", *overrides]


def launch(commands: list[list[str]], output_dir: Path, timeout: float = 1200,
           env: dict[str, str] | None = None) -> Run:
    """Start every command at once (one per machine of a multi-node run), wait for all, require exit code 0.
    `env` adds variables to the launch environment."""
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    logs = [output_dir.with_name(f"{output_dir.name}.{i}.log") for i in range(len(commands))]
    start = time.perf_counter()
    processes = []
    for command, log in zip(commands, logs):
        with open(log, "w") as sink:
            processes.append(subprocess.Popen(command, cwd=REPO, env={**launch_env(), **(env or {})}, stdout=sink,
                                              stderr=subprocess.STDOUT))
    try:
        codes = [process.wait(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    LAUNCH_SECONDS[output_dir.name] = time.perf_counter() - start
    text = "\n".join(log.read_text(errors="replace") for log in logs)
    assert codes == [0] * len(commands), f"exit codes {codes} for {commands}\n{text[-6000:]}"
    return Run(output_dir, text)


def finished_run(output_dir: Path) -> Run:
    """The Run of a launch that `launch` completed earlier, perhaps in another test worker: its folder and logs."""
    logs = sorted(output_dir.parent.glob(f"{output_dir.name}.*.log"), key=lambda log: int(log.suffixes[-2][1:]))
    return Run(output_dir, "\n".join(log.read_text(errors="replace") for log in logs))


# ---------------------------------------------------------------- reading models back

def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def relative_update_difference(run: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                               initial: dict[str, torch.Tensor]) -> float:
    """max over tensors of ||run - reference|| / ||reference - initial||: the disagreement as a share of training's
    own change to that tensor."""
    assert run.keys() == reference.keys() == initial.keys()
    return max(((run[k] - reference[k]).norm() / (reference[k] - initial[k]).norm()).item() for k in run)


def assert_same_training(run: Run, reference: Run, initial: dict[str, torch.Tensor] | None = None) -> None:
    """The same steps, learning rates (our warmup + cosine), losses and gradient norms, and the same final weights:
    relative to training's change when `initial` weights are given (full models), else absolutely (adapters)."""
    assert run.series("step") == reference.series("step") == list(range(1, len(reference.series("step")) + 1))
    assert run.series("lr") == reference.series("lr")
    assert run.series("trained_tokens") == reference.series("trained_tokens")
    for got, want in zip(run.series("loss"), reference.series("loss")):
        assert abs(got - want) < LOSS_ATOL
    for got, want in zip(run.series("grad_norm"), reference.series("grad_norm")):
        assert abs(got - want) < GRAD_NORM_RTOL * want
    if initial is not None:
        assert relative_update_difference(weights(run.final), weights(reference.final), initial) < UPDATE_RTOL
    else:
        assert max_difference(weights(run.final), weights(reference.final)) < WEIGHT_ATOL


def load_final(folder: Path):
    """final/ as a user loads it: plain transformers, plus PEFT when it is an adapter folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = folder / "adapter_config.json"
    if not adapter.is_file():
        return AutoModelForCausalLM.from_pretrained(folder).eval()
    base_path = json.loads(adapter.read_text())["base_model_name_or_path"]
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), folder).eval()


def padded_batch(dataset, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    rows = [dataset[i] for i in indices]
    width = max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": torch.full((len(rows), width), pad_id), "labels": torch.full((len(rows), width), IGNORE),
             "attention_mask": torch.zeros((len(rows), width), dtype=torch.long)}
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, :n] = torch.tensor(row["input_ids"])
        batch["labels"][i, :n] = torch.tensor(row["labels"])
        batch["attention_mask"][i, :n] = 1
    return batch


@torch.no_grad()
def validation_loss(model, dataset, pad_id: int, batch_size: int = 8) -> float:
    """Token-weighted NLL over the whole split from full logits: written independently of evaluate.py and loss.py."""
    total, count = 0.0, 0
    for start in range(0, len(dataset), batch_size):
        batch = padded_batch(dataset, list(range(start, min(len(dataset), start + batch_size))), pad_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        targets = batch["labels"][:, 1:]
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)).double(), targets.reshape(-1),
                                 ignore_index=IGNORE, reduction="sum").item()
        count += int((targets != IGNORE).sum())
    return total / count


@torch.no_grad()
def logits_of(model, dataset, pad_id: int, indices: list[int]) -> torch.Tensor:
    batch = padded_batch(dataset, indices, pad_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits[batch["attention_mask"].bool()]


def merged_vs_adapter_difference(final: Path, validation) -> float:
    """Largest logit difference between final/merged and final/ (base + adapter) on four validation examples: a merge
    must fold in the whole adapter, built from the gathered weights, not one rank's partition or shards."""
    from transformers import AutoModelForCausalLM

    val_ds, pad_id = validation
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    indices = [0, 1, 2, 3]
    return (logits_of(merged, val_ds, pad_id, indices) - logits_of(load_final(final), val_ds, pad_id, indices)
            ).abs().max().item()


def final_logit_difference(final: Path, reference_final: Path, validation) -> float:
    """Largest logit difference between two runs' final/ models on four validation examples."""
    val_ds, pad_id = validation
    indices = [0, 1, 2, 3]
    return (logits_of(load_final(final), val_ds, pad_id, indices)
            - logits_of(load_final(reference_final), val_ds, pad_id, indices)).abs().max().item()
