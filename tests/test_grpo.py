"""objective: grpo on the tiny GPT-J: group advantages by hand, the rewards, the loss and gradients against TRL's
GRPOTrainer for each loss_type, no reference forward at beta 0, a ratio of exactly 1 at num_iterations 1, rollouts
drawn from the weights being trained, failing rewards, learning a rewarded answer and resuming after kills, clean.py
--prompts, the config's refusals and the plan.

Everything but the learning run's interrupted parts runs in this process: the loop's own pieces (objective_for, the
objective's build_model, prepare, step_batches, train_step) or train().
"""

from __future__ import annotations

import copy
import json
import math
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from support.files import read_jsonl, write_config, write_jsonl
from support.launch import explain, run_train
from support.outputs import assert_bitwise_equal_weights, exact_rows

from gpt4all_training.backends.accelerate import backend_for
from gpt4all_training.batch import IGNORE
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.clean import clean
from gpt4all_training.errors import TrainingError, UserError
from gpt4all_training.files import marker_problem
from gpt4all_training.training.loop import prepare, train
from gpt4all_training.training.loss import token_logps
from gpt4all_training.training.objectives import objective_for
from gpt4all_training.training.objectives.grpo import group_advantages
from gpt4all_training.training.objectives.rewards import builtin_reward
from gpt4all_training.training.step import train_step

# Prompts of one length in tokens (TRL left-pads prompts without position ids, so unequal ones would be other
# positions there): one digit apart.
PROMPTS = [{"prompt": f"Say the number {d}.", "answer": str(d), "source": "t"} for d in range(8)]
# Rewards as a user writes them: VARIETY scores a completion by its distinct characters (a spread of rewards from a
# random model), CONSTANT scores every completion alike.
REWARD_FILE = """
import math, os, signal

calls = 0


def variety(completions, **columns):
    return [len(set(c)) / 8 for c in completions]


def constant(completions, **columns):
    return [1.0] * len(completions)


def answer_seven(completions, target, **columns):
    '''1 when the last number of the completion is the target, and, for the resume test, a signal to this
    process at the Nth call when GRPO_TEST_SIGNAL=NAME:N says so.'''
    global calls
    calls += 1
    name, _, at = os.environ.get("GRPO_TEST_SIGNAL", "none:0").partition(":")
    if calls == int(at):
        os.kill(os.getpid(), getattr(signal, "SIG" + name))
    numbers = [[w for w in c.replace(".", " ").split() if w.isdigit()] for c in completions]
    return [float(bool(n) and n[-1] == t) for n, t in zip(numbers, target)]


def fails(completions, **columns):
    global calls
    calls += 1
    if calls < 2:
        return [0.5] * len(completions)
    how = os.environ["GRPO_TEST_FAILURE"]
    if how == "raises":
        raise ValueError("the grader lost its key")
    if how == "nan":
        return [math.nan] * len(completions)
    return [0.5] * (len(completions) - 1)
"""


@pytest.fixture(scope="module")
def prompts_dir(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "numbers_clean.jsonl", PROMPTS).parent


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARD_FILE)
    return path


def grpo_config(model_dir, data_dir, output_dir, reward_file, function: str = "variety", **overrides) -> TrainConfig:
    values = dict(model_name=str(model_dir), dataset_path=str(data_dir), output_dir=str(output_dir), objective="grpo",
                  rewards=[{"module": str(reward_file), "function": function}], num_generations=4,
                  max_completion_length=6, max_length=32, batch_size=2, lr=1e-3, min_lr=1e-3, warmup_steps=0,
                  val_fraction=0.0, num_epochs=10, max_steps=4, eval_every=None, save_every=None, num_proc=1, seed=0,
                  max_grad_norm=None)
    values.update(overrides)
    return validate(TrainConfig(**values))


@dataclass
class Prepared:
    """What train() builds before its first step, built by the loop's own functions."""
    objective: object
    data: object
    model: object
    optimizer: object
    scheduler: object
    backend: object

    def batches(self, step: int, indices: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        return self.objective.step_batches(self.model, self.backend, self.data.train, step, indices, 0)

    def step(self, batches, step: int) -> dict:
        return train_step(self.model, batches, self.backend, self.optimizer, self.scheduler, None, step,
                          self.objective.loss, count=self.objective.count)


def prepared(config: TrainConfig, tokenizer) -> Prepared:
    from accelerate import Accelerator

    backend = backend_for(Accelerator())
    objective = objective_for(config)
    data = objective.load_data(config, tokenizer, lambda line: None, 1)
    torch.manual_seed(config.seed)
    model = objective.build_model(config, tokenizer, backend)
    model, optimizer, scheduler = prepare(model, config, backend, config.max_steps)
    objective.before_training(model, data, backend, tokenizer.pad_token_id, lambda line: None)
    model.train()
    return Prepared(objective, data, model, optimizer, scheduler, backend)


def moved(model, seed: int, scale: float = 0.05):
    """The weights moved by seeded noise (the same move for any copy of the same weights)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


def gradients(model) -> dict[str, torch.Tensor]:
    return {name.removeprefix("module."): p.grad.clone() for name, p in model.named_parameters()
            if p.grad is not None}


def completion_ids(batch, prompt_length: int) -> list[list[int]]:
    """Each row's completion: its real tokens after the prompt (trained or, when masked as truncated, not)."""
    return [row[prompt_length:int(real)].tolist() for row, real in zip(batch["input_ids"],
                                                                       batch["attention_mask"].sum(1))]


# ---------------------------------------------------------------- advantages and rewards (pure)

def test_group_advantages_by_hand():
    """TRL's definition: reward minus the group mean over the Bessel-corrected std + 1e-4."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    advantages, equal = group_advantages(rewards, 4, "group")
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # the std of [1, 0, 0, 1] with Bessel's correction is sqrt(1/3)
    assert advantages[:4].tolist() == pytest.approx([expected, -expected, -expected, expected], abs=1e-6)
    assert abs(expected - 0.866) < 1e-3
    assert advantages[4:].tolist() == [0.0] * 4 and equal.tolist() == [False, True]
    assert group_advantages(rewards, 4, "none")[0][:4].tolist() == [0.5, -0.5, -0.5, 0.5]
    batch, _ = group_advantages(rewards, 4, "batch", rewards.std())
    assert batch[:4].tolist() == pytest.approx([0.5 / (rewards.std().item() + 1e-4) * s for s in (1, -1, -1, 1)])


def test_built_in_rewards():
    def values(entry, completions, max_completion_length=8, **columns):
        reward = builtin_reward(entry, max_completion_length)
        return reward.function(prompts=[""] * len(completions), completions=completions,
                               completion_ids=[[0] * n for n in columns.pop("lengths", [1] * len(completions))],
                               **columns)

    said = ["The answer is 12.", " 12 ", "12 or 13?", "no number", [{"role": "assistant", "content": "x = 1,234"}]]
    answers = ["12", "12", "12", "12", "1234"]
    assert values({"name": "exact_match"}, said, answer=answers) == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert values({"name": "exact_match", "pattern": r"\d+"}, said, answer=answers) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert values({"name": "exact_match", "pattern": r"is (\d+)", "field": "gold"}, said,
                  gold=answers) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert values({"name": "numeric_match"}, said, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert values({"name": "numeric_match", "tolerance": 1.0}, said, answer=["12.5", "14", "13.9", "0", "1,233"]) \
        == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert values({"name": "format", "pattern": r"<a>\d+</a>"}, ["<a>4</a>\n", "x <a>4</a>", "<a>4</a><a>"]) == \
        [1.0, 0.0, 0.0]
    # DAPO's soft overlong penalty, max 8 tokens with a cache of 4: free up to 4, then down to -1 at 8.
    assert values({"name": "length_penalty", "cache": 4}, ["a"] * 4, lengths=[3, 4, 6, 8]) == [0.0, 0.0, -0.5, -1.0]


# ---------------------------------------------------------------- against TRL's GRPOTrainer

@pytest.fixture(scope="module")
def trl_grpo():
    """TRL's GRPOTrainer and GRPOConfig: the test-only oracle (requirements-dev.txt)."""
    trl = pytest.importorskip("trl")
    return trl.GRPOTrainer, trl.GRPOConfig


@pytest.mark.parametrize("loss_type, masked", [("dapo", True), ("grpo", False), ("dr_grpo", False)])
def test_loss_and_gradients_equal_trls_grpo_trainer(loss_type, masked, trl_grpo, tiny_model_dir, tokenizer,
                                                    prompts_dir, reward_file, tmp_path, monkeypatch):
    """TRL 1.16's own scoring, advantages, old and reference log-probabilities and _compute_loss, fed our prompts and
    completions (its rollout_func) and our reward function. num_iterations 2 with the policy moved after sampling, so
    the ratio differs from 1 and clips; beta > 0 against the initial weights. The tolerance is derived from TRL
    itself: the same rows given to it in another order."""
    import datasets

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    GRPOTrainer, GRPOConfig = trl_grpo
    settings = dict(num_generations=4, max_completion_length=6, temperature=0.9, beta=0.04, epsilon=0.2,
                    epsilon_high=0.28, num_iterations=2, loss_type=loss_type, mask_truncated_completions=masked)
    config = grpo_config(tiny_model_dir, prompts_dir, tmp_path, reward_file, **settings)
    run = prepared(config, tokenizer)
    model = moved(run.model, seed=1)  # the policy away from the reference (the initial weights)
    with torch.no_grad():  # EOS likelier, so that completions have several lengths (which the loss types weigh)
        run.backend.unwrap(model).lm_head.bias[tokenizer.eos_token_id] += 5.0
    lengths = run.data.train.lengths()
    pair = next([i, j] for i in range(len(lengths)) for j in range(i + 1, len(lengths)) if lengths[i] == lengths[j])
    [batch] = run.batches(0, [pair])
    prompt_ids = [run.data.train.ids[p] for p in pair for _ in range(4)]
    rows = {"order": list(range(8))}

    def rollout(prompts, trainer):
        ids = completion_ids(batch, len(prompt_ids[0]))
        return {"prompt_ids": [prompt_ids[i] for i in rows["order"]],
                "completion_ids": [ids[i] for i in rows["order"]], "logprobs": [[0.0] * len(ids[i])
                                                                                 for i in rows["order"]]}

    untrained = (batch["labels"] == IGNORE).all(1)
    assert untrained.any() == masked and not untrained.all()  # masked: truncated completions, none trained
    oracle = GRPOTrainer(model=copy.deepcopy(run.backend.unwrap(model)), reward_funcs=[run.objective.rewards[0].function],
                         args=GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8,
                                         report_to=[], use_cpu=True, bf16=False, save_strategy="no", **settings),
                         train_dataset=datasets.Dataset.from_dict({"prompt": ["unused"] * 8}),
                         processing_class=tokenizer, rollout_func=rollout)
    oracle.current_gradient_accumulation_steps = 1
    records = [{"prompt": run.data.train.prompts[p], **run.data.train.fields[p]} for p in pair for _ in range(4)]

    def scored_by_trl(order: list[int]):
        rows["order"] = order
        return oracle._generate_and_score_completions([records[i] for i in order])

    def trl_loss(scored):
        oracle.model.zero_grad()
        loss = oracle._compute_loss(oracle.model, scored)
        loss.backward()
        return loss, gradients(oracle.model)

    # Both orders scored by the weights that sampled; TRL's own numerical spread is the difference between the two.
    swapped_order = [4, 5, 6, 7, 0, 1, 2, 3]
    swapped_scored, scored = scored_by_trl(swapped_order), scored_by_trl(list(range(8)))
    moved(oracle.model.train(), seed=2)  # the policy after an update: the ratio moves away from 1
    swapped, swapped_grads = trl_loss(swapped_scored)
    theirs, their_grads = trl_loss(scored)

    # The same rewards and advantages, old and reference log-probabilities (over the completion's positions).
    assert torch.allclose(scored["advantages"], batch["advantages"], atol=1e-6, rtol=0)
    assert torch.allclose(swapped_scored["advantages"], batch["advantages"][swapped_order], atol=1e-6, rtol=0)
    start = len(prompt_ids[0]) - 1
    width = scored["completion_ids"].shape[1]
    mask = scored["completion_mask"].bool()
    for ours, key in (("old_logps", "old_per_token_logps"), ("ref_logps", "ref_per_token_logps")):
        gap = (batch[ours][:, start:start + width] - scored[key]).abs()[mask].max().item()
        assert gap < 1e-5, (ours, gap)

    moved(model, seed=2)
    ours = run.objective.loss(model, run.backend.to_device(batch)) / run.objective.count(batch)
    ours.backward()
    metrics = run.objective.window_metrics(run.backend)
    our_grads = gradients(model)
    assert our_grads.keys() == their_grads.keys()
    largest = max(g.abs().max().item() for g in their_grads.values())
    trl_spread = max((their_grads[k] - swapped_grads[k]).abs().max().item() for k in their_grads)
    grad_gap = max((our_grads[k] - their_grads[k]).abs().max().item() for k in their_grads)
    loss_gap, loss_spread = abs(ours.item() - theirs.item()), abs(theirs.item() - swapped.item())
    print(f"TRL parity ({loss_type}): loss {ours.item():.6f}, |loss - TRL| {loss_gap:.2e} (TRL's own spread "
          f"{loss_spread:.2e}), max |grad - TRL| {grad_gap:.2e} (TRL's own spread {trl_spread:.2e}, largest grad "
          f"{largest:.2e})")
    # 10x TRL's own spread, and never below 16 units of fp32 rounding of the largest value (a spread that happens
    # to be 0 would otherwise demand bit equality of two different kernels).
    fp32 = torch.finfo(torch.float32).eps
    assert loss_gap <= max(10 * loss_spread, 16 * fp32 * max(1.0, abs(theirs.item())))
    assert grad_gap <= max(10 * trl_spread, 16 * fp32 * largest)
    assert abs(ours.item()) > 1e-3 and largest > 1e-3
    trl_metrics = {key: values[-1] for key, values in oracle._metrics["train"].items()}
    for key in ("kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"):
        assert metrics[key] == pytest.approx(trl_metrics[key], abs=1e-5), key
    assert metrics["clip_ratio/region_mean"] > 0
