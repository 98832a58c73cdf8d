"""objective: dpo under the launchers of sft: two gloo ranks (batch 1 x accumulation 2 each) under DDP (torchrun),
DeepSpeed ZeRO-2 and FSDP2 (accelerate launch) train what one process trains with batch 4, the reference
log-probabilities precomputed by both ranks together. Tolerances are justified in runs.py."""

from __future__ import annotations

import pytest
from support.files import write_config, write_jsonl
from support.launch import accelerate_deepspeed, accelerate_fsdp2, torchrun
from support.paths import REPO

from gpt4all_training.config.loader import load_config
from gpt4all_training.training.loop import train

from .runs import LOSS_ATOL, Run, assert_same_training, launch, train_command

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

WORDS = ["apple", "river", "house", "music", "water", "light", "green", "money", "story", "world", "bread", "chair",
         "horse", "paper", "stone", "table", "night", "plant", "sugar", "glass"]
LAUNCHERS = {"ddp": lambda: torchrun(2),
             "zero2": lambda: accelerate_deepspeed(2, REPO / "configs" / "deepspeed" / "ds_config.json"),
             "fsdp2": lambda: accelerate_fsdp2(2)}


@pytest.fixture(scope="module")
def dpo_config(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dpo")
    rows = [{"prompt": f"Say {w}.", "chosen": f"{w}.", "rejected": f"{w}, {w} and {w} again.", "source": "t"}
            for w in WORDS]
    data = write_jsonl(folder / "data" / "words_clean.jsonl", rows).parent
    return write_config(folder, {
        "model_name": str(tiny_model_dir), "dataset_path": str(data), "objective": "dpo", "beta": 0.2,
        "max_length": 32, "batch_size": 1, "gradient_accumulation_steps": 2, "lr": 3.0e-3, "min_lr": 1.0e-4,
        "warmup_steps": 1, "weight_decay": 1.0, "max_grad_norm": 1.0, "max_steps": 4, "eval_every": 2,
        "save_every": None, "val_fraction": 0.2, "seed": 7, "num_proc": 1, "report_to": ["jsonl"]})


@pytest.fixture(scope="module")
def single_dpo_run(dpo_config, tmp_path_factory):
    """The same pairs in one process, batch 4: what every 2-rank launch must equal."""
    out = tmp_path_factory.mktemp("dpo-single")
    train(load_config(dpo_config, [f"output_dir={out}", "batch_size=4", "gradient_accumulation_steps=1"]))
    return Run(out, "")


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_two_processes_train_dpo_as_one(name, dpo_config, single_dpo_run, initial_weights, tmp_path):
    run = launch([train_command(LAUNCHERS[name](), dpo_config, tmp_path / name)], tmp_path / name)

    assert "reference log-probabilities: computed for 16 train and 4 validation pairs" in run.log
    assert_same_training(run, single_dpo_run, initial_weights)
    if name != "fsdp2":  # DDP and ZeRO-2 keep a whole copy on every rank, which must equal rank 0's
        assert run.last("replica_mismatches") == 0
    for key in ("rewards/margins", "rewards/accuracies", "val_loss", "val_rewards/margins", "val_rewards/accuracies"):
        assert abs(run.last(key) - single_dpo_run.last(key)) < LOSS_ATOL, key
    assert single_dpo_run.last("val_pairs") == run.last("val_pairs") == 4
