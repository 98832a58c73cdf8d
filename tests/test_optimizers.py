"""The `optimizer` key: each optimizer's first steps are torch.optim's reference steps within the reference's own
fp32 rounding (measured against the same steps in float64, on the same real gradients); 8-bit AdamW's first step
too, and its next ones within what its quantized moments may move a weight; a run resumed mid-way ends with the
uninterrupted run's weights; and one line where an optimizer cannot run."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file

from support.files import write_jsonl
from support.models import build_tiny_gptj
from gpt4all_training.batch import trained_token_count
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.batching import collate
from gpt4all_training.data.records import load_records
from gpt4all_training.data.sft import tokenize_dataset
from gpt4all_training.errors import UserError
from gpt4all_training.model.parameters import param_groups
from gpt4all_training.training.loop import train
from gpt4all_training.training.loss import token_loss_sum
from gpt4all_training.training.optimizers import build_optimizer

LR, DECAY, STEPS = 1e-2, 0.1, 3
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def batches(clean_dolly, tokenizer) -> list[dict[str, torch.Tensor]]:
    records = load_records(str(clean_dolly)).select(range(12))
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]}
            for r in tokenize_dataset(records, tokenizer, 64, "plain", None)]
    return [collate(rows[i:i + 4], pad_id=0) for i in range(0, 12, 4)]


@pytest.fixture(scope="module")
def gradients(tokenizer, batches) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The tiny GPT-J's weights, and its real gradients on each batch at those weights: what every optimizer is
    given, so that runs differ by their optimizer's arithmetic alone."""
    model = build_tiny_gptj(tokenizer, seed=3).train()
    steps = []
    for batch in batches:
        (token_loss_sum(model, batch) / trained_token_count(batch)).backward()
        steps.append({name: param.grad for name, param in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return {name: param.detach() for name, param in model.named_parameters()}, steps


def weights_after(tokenizer, gradients, make_optimizer, steps: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The tiny GPT-J's weights after `steps` steps of make_optimizer(param_groups), each given a batch's gradient."""
    initial, grads = gradients
    model = build_tiny_gptj(tokenizer, seed=3).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(initial[name])
    optimizer = make_optimizer(param_groups(model, DECAY))
    for step in grads[:steps]:
        for name, param in model.named_parameters():
            param.grad = step[name].to(dtype)
        optimizer.step()
    return {name: param.detach().double() for name, param in model.named_parameters()}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


REFERENCES = {"adamw": lambda groups: torch.optim.AdamW(groups, lr=LR, foreach=False),
              "sgd": lambda groups: torch.optim.SGD(groups, lr=LR, foreach=False)}


@pytest.mark.parametrize("name", ["adamw", "adamw_fused", "adamw_8bit", "sgd"])
def test_the_first_steps_are_the_reference_steps(tokenizer, gradients, name):
    """torch.optim's for-loop implementation is the reference, given the same gradients; its fp32 rounding (against
    the same steps in float64) bounds what another implementation, rounding each operation its own way, may differ
    by: four times that (fused AdamW differs by 0.4 of it, a decay left out by 2,000). 8-bit AdamW's first
    step is AdamW's (its moments are quantized after they are used); each later one can differ by at most what an
    Adam step may move a weight (lr, as |m/sqrt(v)| <= 1)."""
    reference = REFERENCES["sgd" if name == "sgd" else "adamw"]
    ours = lambda groups: build_optimizer(name, groups, LR, CPU)  # noqa: E731
    steps = 1 if name == "adamw_8bit" else STEPS
    expected = weights_after(tokenizer, gradients, reference, steps)
    tolerance = 4 * largest_difference(expected, weights_after(tokenizer, gradients, reference, steps, torch.float64))
    assert largest_difference(weights_after(tokenizer, gradients, ours, steps), expected) <= tolerance
    if name == "adamw_8bit":
        later = largest_difference(weights_after(tokenizer, gradients, reference, STEPS),
                                   weights_after(tokenizer, gradients, ours, STEPS))
        assert 0 < later <= LR * (STEPS - 1)


@pytest.mark.parametrize("name", ["adamw_fused", "adamw_8bit", "sgd"])
def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights(tiny_model_dir, tmp_path, name):
    data = write_jsonl(tmp_path / "data" / "sums_clean.jsonl",
                       [{"prompt": f"What is {i} plus {i}?", "response": f"{2 * i}.", "source": "t"}
                        for i in range(12)]).parent
    values = dict(model_name=str(tiny_model_dir), dataset_path=str(data), output_dir=str(tmp_path / "run"),
                  max_length=32, batch_size=4, val_fraction=0.0, max_steps=3, save_every=1, eval_every=None,
                  num_proc=1, seed=0, dtype="float32", optimizer=name, lr=LR, weight_decay=DECAY)
    train(validate(TrainConfig(**values)))
    final = tmp_path / "run" / "final" / "model.safetensors"
    uninterrupted = load_file(final)
    train(validate(TrainConfig(**values, checkpoint=str(tmp_path / "run" / "step_1"))))
    resumed = load_file(final)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


def test_an_optimizer_that_cannot_run_here_is_one_line(monkeypatch):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    with pytest.raises(UserError, match=r"^optimizer: adamw_fused has no kernel on xla \(torch has one on .*cpu.*"
                                        r"\); use adamw$"):
        build_optimizer("adamw_fused", groups, LR, torch.device("xla"))
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what an install without it imports
    with pytest.raises(UserError, match=r"^optimizer: adamw_8bit needs bitsandbytes, which is not installed here; "):
        build_optimizer("adamw_8bit", groups, LR, CPU)
