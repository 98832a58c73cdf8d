"""param_groups: which parameters weight decay applies to, by name."""

from __future__ import annotations

import torch
from torch import nn

from gpt4all_training.backends.deepspeed import zero3_shape
from gpt4all_training.model.parameters import param_groups


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(4))
        self.mixing = nn.Parameter(torch.zeros(4, 4))


def group_names(model: nn.Module, groups: list[dict]) -> list[list[str]]:
    """Each group's parameters by name, in model.parameters() order (a module's own parameters first)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in groups]


def test_matrices_decay_and_biases_norms_and_embeddings_do_not():
    model = Block()
    groups = param_groups(model, weight_decay=0.1)
    assert [group["weight_decay"] for group in groups] == [0.1, 0.0]
    assert group_names(model, groups) == [["mixing", "proj.weight"],
                                          ["scale", "embed.weight", "proj.bias", "norm.weight", "norm.bias"]]


def test_a_zero3_partition_is_grouped_by_its_real_shape():
    """Under ZeRO-3 every parameter is a flat partition; ds_shape keeps the shape it had, which DeepSpeed's backend
    gives as the parameter's shape."""
    model = Block()
    for param in model.parameters():
        param.ds_shape = param.shape
        param.data = param.data.reshape(-1)
    assert group_names(model, param_groups(model, weight_decay=0.1, shape=zero3_shape)) == [
        ["mixing", "proj.weight"], ["scale", "embed.weight", "proj.bias", "norm.weight", "norm.bias"]]
