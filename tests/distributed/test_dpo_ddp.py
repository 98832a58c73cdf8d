"""objective: dpo under DDP: two gloo ranks (batch 1 x accumulation 2 each) train what one process trains with batch
4, the reference log-probabilities precomputed by both ranks together. Tolerances are justified in runs.py."""

from __future__ import annotations

import pytest
from support.files import write_config, write_jsonl
from support.launch import torchrun

from gpt4all_training.config.loader import load_config
from gpt4all_training.training.loop import train

from .runs import LOSS_ATOL, Run, assert_same_training, launch, train_command

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

WORDS = ["apple", "river", "house", "music", "water", "light", "green", "money", "story", "world", "bread", "chair",
         "horse", "paper", "stone", "table", "night", "plant", "sugar", "glass"]


def test_two_ddp_processes_train_dpo_as_one(tiny_model_dir, initial_weights, tmp_path):
    rows = [{"prompt": f"Say {w}.", "chosen": f"{w}.", "rejected": f"{w}, {w} and {w} again.", "source": "t"}
            for w in WORDS]
    data = write_jsonl(tmp_path / "data" / "words_clean.jsonl", rows).parent
    config = write_config(tmp_path, {
        "model_name": str(tiny_model_dir), "dataset_path": str(data), "objective": "dpo", "beta": 0.2,
        "max_length": 32, "batch_size": 1, "gradient_accumulation_steps": 2, "lr": 3.0e-3, "min_lr": 1.0e-4,
        "warmup_steps": 1, "weight_decay": 1.0, "max_grad_norm": 1.0, "max_steps": 4, "eval_every": 2,
        "save_every": None, "val_fraction": 0.2, "seed": 7, "num_proc": 1, "report_to": ["jsonl"]})
    ddp = launch([train_command(torchrun(2), config, tmp_path / "ddp")], tmp_path / "ddp")
    single = tmp_path / "single"
    train(load_config(config, [f"output_dir={single}", "batch_size=4", "gradient_accumulation_steps=1"]))
    reference = Run(single, "", 0.0)

    assert "reference log-probabilities: computed for 16 train and 4 validation pairs" in ddp.log
    assert_same_training(ddp, reference, initial_weights)
    assert ddp.last("replica_mismatches") == 0
    for key in ("rewards/margins", "rewards/accuracies", "val_loss", "val_rewards/margins", "val_rewards/accuracies"):
        assert abs(ddp.last(key) - reference.last(key)) < LOSS_ATOL, key
    assert reference.last("val_pairs") == ddp.last("val_pairs") == 4
