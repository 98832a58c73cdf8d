"""training/objectives/: every objective the config offers is registered and has both faces (the loop's and the
checks')."""

from __future__ import annotations

import typing

from gpt4all_training.config.blocks import Objective as ObjectiveBlock
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.training.objectives import OBJECTIVES, objective_for
from gpt4all_training.training.objectives.protocol import ObjectiveChecks, TrainingObjective


def test_every_objective_the_config_offers_is_registered_with_both_faces():
    choices = typing.get_args(typing.get_type_hints(ObjectiveBlock)["objective"])
    assert sorted(OBJECTIVES) == sorted(choices)
    for name in choices:
        objective = objective_for(TrainConfig(objective=name))
        assert objective.name == name
        assert isinstance(objective, TrainingObjective) and isinstance(objective, ObjectiveChecks)
