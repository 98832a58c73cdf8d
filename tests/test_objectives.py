"""training/objectives/: every objective the config offers is registered and has both faces (the loop's and the
checks'); `data` asks the objective, not the config, whether it can show its examples; and the loop builds each
step's batches through the objective with the very model it trains, holding the weights the previous update left,
timed apart from the update."""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
import typing

import pytest
import torch
from support.files import write_config, write_jsonl
from support.paths import REPO

import gpt4all_training.training.loop as loop
from gpt4all_training.cli import data as data_command
from gpt4all_training.config.blocks import Objective as ObjectiveBlock
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import UserError
from gpt4all_training.model.loading import load_model
from gpt4all_training.tracking.tracker import read_metrics
from gpt4all_training.training.objectives import OBJECTIVES, objective_for
from gpt4all_training.training.objectives.protocol import ObjectiveChecks, TrainingObjective
from gpt4all_training.training.objectives.sft import FineTuning

# How long the planted step_batches waits: the batch time each row must show at least.
BATCH_DELAY = 0.05


def test_every_objective_the_config_offers_is_registered_with_both_faces():
    choices = typing.get_args(typing.get_type_hints(ObjectiveBlock)["objective"])
    assert sorted(OBJECTIVES) == sorted(choices)
    for name in choices:
        objective = objective_for(TrainConfig(objective=name))
        assert objective.name == name
        assert isinstance(objective, TrainingObjective) and isinstance(objective, ObjectiveChecks)


def test_every_key_the_objectives_table_names_is_a_config_key():
    """A misspelt key in config/objectives.py's table would otherwise go unchecked until a config set it."""
    keys = {f.name for f in dataclasses.fields(TrainConfig)}
    for spec in OBJECTIVES.values():
        assert set(spec.keys) | set(spec.refuses) <= keys, spec.name
        assert set(spec.defaults) <= set(spec.keys), spec.name


def objectives_listed(page: str) -> list[str]:
    """The objectives the `objective` row of a page's table of keys names, in order."""
    row = next(line for line in page.splitlines() if line.startswith("| `objective: "))
    return re.findall(r"`(\w+)` \(", row.split("|")[2])


def test_docs_training_lists_exactly_the_objectives_of_the_table():
    assert objectives_listed((REPO / "docs" / "training.md").read_text(encoding="utf-8")) == list(OBJECTIVES)
    # A page that leaves one out (the row as it read before grpo was listed) is caught.
    planted = "| `objective: sft` | `sft` (prompts), `causal_lm` (raw text), `dpo` ([pairs](preference.md)) |"
    assert objectives_listed(planted) == ["sft", "causal_lm", "dpo"] != list(OBJECTIVES)


@pytest.mark.parametrize("name", ["causal_lm", "dpo"])
def test_data_refuses_an_objective_whose_examples_it_cannot_show_by_name(name, tmp_path):
    config = write_config(tmp_path, {"objective": name, "model_name": "org/model",
                                     "dataset_path": str(tmp_path), "output_dir": str(tmp_path / "run")})
    with pytest.raises(UserError) as refused:
        data_command.run(argparse.Namespace(config=str(config), overrides=[], show=3, dump=None))
    assert str(refused.value) == (f"{config}: objective {name}: `data` shows and dumps sft examples only; `plan` "
                                  f"counts this objective's tokens and `check` tries a step of it")


def weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


@pytest.mark.integration
def test_each_steps_batches_are_built_from_the_model_being_trained_after_the_previous_update(
        tiny_model_dir, tmp_path, monkeypatch):
    """What an objective that samples from its policy relies on: step_batches sees the model train_step updates, in
    train mode, holding exactly the weights the previous update left (no stale copy); and the time it takes is the
    row's batch_seconds, not part of update_seconds."""
    data = write_jsonl(tmp_path / "data" / "sums_clean.jsonl",
                       [{"prompt": f"What is {i} plus {i}?", "response": f"{2 * i}.", "source": "t"}
                        for i in range(8)]).parent
    seen, updated = [], []
    step_batches, train_step = FineTuning.step_batches, loop.train_step

    def watched_step_batches(self, model, backend, dataset, step, indices, pad_id):
        seen.append((step, model, model.training, weights(model)))
        time.sleep(BATCH_DELAY)
        return step_batches(self, model, backend, dataset, step, indices, pad_id)

    def watched_train_step(model, batches, *args, **kwargs):
        result = train_step(model, batches, *args, **kwargs)
        updated.append((model, weights(model)))
        return result

    monkeypatch.setattr(FineTuning, "step_batches", watched_step_batches)
    monkeypatch.setattr(loop, "train_step", watched_train_step)
    config = validate(TrainConfig(model_name=str(tiny_model_dir), dataset_path=str(data),
                                  output_dir=str(tmp_path / "run"), max_length=32, batch_size=4, lr=1e-2, min_lr=1e-2,
                                  warmup_steps=0, val_fraction=0.0, num_epochs=2, max_steps=3, eval_every=None,
                                  save_every=None, num_proc=1, seed=0, report_to=["jsonl"]))
    loop.train(config)

    assert [step for step, *_ in seen] == [0, 1, 2]
    assert all(model is updated[0][0] and training for _, model, training, _ in seen)
    assert torch.equal(seen[0][3], weights(load_model(str(tiny_model_dir))))
    for (_, _, _, before), (_, after), (_, _, _, next_seen) in zip(seen, updated, seen[1:]):
        assert not torch.equal(before, after)
        assert torch.equal(next_seen, after)
    rows = [row for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["batch_seconds"] >= BATCH_DELAY and row["update_seconds"] > 0 for row in rows)
