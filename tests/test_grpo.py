"""objective: grpo on the tiny GPT-J: group advantages by hand, the rewards, the loss and gradients against TRL's
GRPOTrainer for each loss_type, no reference forward at beta 0, a ratio of exactly 1 at num_iterations 1, rollouts
drawn from the weights being trained, failing rewards, learning a rewarded answer and resuming after kills.

Everything but the learning run's interrupted parts runs in this process: the loop's own pieces (objective_for, the
objective's build_model, prepare, step_batches, train_step) or train().
"""

from __future__ import annotations

import copy
import json
import math
import re
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from support.files import read_jsonl, write_config, write_jsonl
from support.launch import accelerate_deepspeed, accelerate_fsdp2, explain, run_train, torchrun
from support.paths import REPO
from support.outputs import assert_bitwise_equal_weights, exact_rows, max_weight_difference
from hardening.harness import error_lines

from gpt4all_training.backends.accelerate import backend_for
from gpt4all_training.cli.main import main
from gpt4all_training.batch import IGNORE
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.rewards import REWARD_KINDS
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import TrainingError, UserError
from gpt4all_training.files import marker_problem
from gpt4all_training.training.loop import prepare, train
from gpt4all_training.training.loss import token_logps
from gpt4all_training.training.objectives import objective_for
from gpt4all_training.training.objectives.grpo.rollout import group_advantages, kv_cache_bytes
from gpt4all_training.training.objectives.grpo.rewards import Reward, builtin_reward, load_user_reward, score
from gpt4all_training.training.step import train_step

# Prompts of one length in tokens (TRL left-pads prompts without position ids, so unequal ones would be other
# positions there): one digit apart.
PROMPTS = [{"prompt": f"Say the number {d}.", "answer": str(d), "source": "t"} for d in range(8)]
# Rewards as a user writes them: VARIETY scores a completion by its distinct characters (a spread of rewards from a
# random model), CONSTANT scores every completion alike.
REWARD_FILE = """
import math, os, signal, sys

import numpy as np

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
    '''0.5 for every completion at the first call; from the second on, what GRPO_TEST_FAILURE says: "raises",
    "nan", "short" (one value too few) or "return EXPRESSION" (evaluated, with n the number of completions).'''
    global calls
    calls += 1
    how = os.environ.get("GRPO_TEST_FAILURE")
    if calls < 2 or how is None:
        return [0.5] * len(completions)
    if how == "raises":
        raise ValueError("the grader lost its key")
    if how == "nan":
        return [math.nan] * len(completions)
    if how.startswith("return "):
        return eval(how.removeprefix("return "), globals(), {"n": len(completions)})
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


def grpo_values(model_dir, data_dir, output_dir, reward_file, function: str = "variety", **overrides) -> dict:
    values = dict(model_name=str(model_dir), dataset_path=str(data_dir), output_dir=str(output_dir), objective="grpo",
                  rewards=[{"module": str(reward_file), "function": function}], num_generations=4,
                  max_completion_length=6, max_length=32, batch_size=2, lr=1e-3, min_lr=1e-3, warmup_steps=0,
                  val_fraction=0.0, num_epochs=10, max_steps=4, eval_every=None, save_every=None, num_proc=1, seed=0,
                  max_grad_norm=None, dtype="float32")
    values.update(overrides)
    return values


def grpo_config(model_dir, data_dir, output_dir, reward_file, function: str = "variety", **overrides) -> TrainConfig:
    return validate(TrainConfig(**grpo_values(model_dir, data_dir, output_dir, reward_file, function, **overrides)))


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


REWARDS_TABLE = "| `name` | keys | what it scores |"


def reward_kinds_listed(page: str) -> dict[str, list[str]]:
    """{name: its keys} of the rows of a page's table of rewards built in."""
    table = page.split(REWARDS_TABLE, 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]*) \|", table, re.MULTILINE)
    return {name: re.findall(r"`(\w+)`", keys) for name, keys in rows}


def test_docs_list_exactly_the_reward_kinds_of_the_table_with_their_keys():
    kinds = {name: list(kind.keys) for name, kind in REWARD_KINDS.items()}
    assert reward_kinds_listed((REPO / "docs" / "preference.md").read_text(encoding="utf-8")) == kinds
    # A page missing a kind, or a key of one, is caught.
    planted = (f"{REWARDS_TABLE}\n|---|---|---|\n| `exact_match` | `field` | 1 when equal |\n"
               f"| `format` | `pattern` (required) | 1 when it matches |\n")
    assert reward_kinds_listed(planted) == {"exact_match": ["field"], "format": ["pattern"]} != kinds


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
    oracle = GRPOTrainer(model=copy.deepcopy(run.backend.unwrap(model)),
                         reward_funcs=[run.objective.rewards[0].function],
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


# ---------------------------------------------------------------- the reference, the ratio, the rollout policy

class ForwardCounter:
    """Counts the forwards of the model's own module that score whole rows (no KV cache): the loss's and the
    reference's, not the decoder's steps."""

    def __init__(self, module) -> None:
        self.count = 0
        module.register_forward_pre_hook(self.seen, with_kwargs=True)

    def seen(self, module, args, kwargs) -> None:
        self.count += not kwargs.get("use_cache", False)


@pytest.mark.parametrize("beta, lora", [(0.0, False), (0.1, False), (0.1, True)])
def test_the_reference_runs_only_with_beta_and_equal_rewards_move_nothing(beta, lora, tiny_model_dir, tokenizer,
                                                                          prompts_dir, reward_file, tmp_path):
    """beta 0: no reference at all (no frozen copy, no forward with the adapter disabled): sampling two micro-batches
    runs no scoring forward. beta > 0: one reference forward per micro-batch (the frozen copy's, or the policy's with
    the adapter off). A constant reward gives every group advantages 0: with beta 0 the loss and every gradient are 0
    exactly."""
    config = grpo_config(tiny_model_dir, prompts_dir, tmp_path, reward_file, "constant", beta=beta, lora=lora,
                         gradient_accumulation_steps=2)
    run = prepared(config, tokenizer)
    policy = run.backend.unwrap(model=run.model)
    policy = policy.get_base_model() if lora else policy
    counters = {"policy": ForwardCounter(policy)}
    if run.objective.frozen is not None:
        counters["frozen"] = ForwardCounter(run.objective.frozen)
    assert (run.objective.frozen is not None) == (beta > 0 and not lora)
    batches = run.batches(0, [[0, 1], [2, 3]])
    seen = {name: counter.count for name, counter in counters.items()}
    expected = {"policy": 2 if lora and beta else 0, **({"frozen": 2} if "frozen" in counters else {})}
    assert seen == expected
    assert all(("ref_logps" in batch) == (beta > 0) for batch in batches)
    assert all(batch["advantages"].eq(0).all() for batch in batches)
    if beta == 0:
        loss = run.objective.loss(run.model, run.backend.to_device(batches[0]))
        loss.backward()
        assert loss.item() == 0.0
        assert all(g.eq(0).all() for g in gradients(run.model).values()) and gradients(run.model)


@pytest.mark.parametrize("iterations", [1, 2])
def test_one_iteration_keeps_the_ratio_at_one_so_the_clip_never_fires(iterations, tiny_model_dir, tokenizer,
                                                                      prompts_dir, reward_file, tmp_path):
    """With a clip of 1e-6 any ratio but exactly 1 would clip. num_iterations 1: no token is clipped at any step.
    num_iterations 2: the second step on the same completions (the weights moved by the first) clips tokens."""
    config = grpo_config(tiny_model_dir, prompts_dir, tmp_path, reward_file, epsilon=1e-6, num_iterations=iterations,
                         lr=1e-2)
    run = prepared(config, tokenizer)
    clipped = []
    for step in range(3):
        indices = run.objective.sampler(config, run.data, 1, 0).step_indices(step)
        batches = run.batches(step, indices)
        assert all(("old_logps" in batch) == (iterations > 1) for batch in batches)  # 1: ratio = exp(logp - logp)
        run.step(batches, step)
        clipped.append(run.objective.window_metrics(run.backend)["clip_ratio/region_mean"])
    assert clipped[0] == 0.0
    if iterations == 1:
        assert clipped == [0.0, 0.0, 0.0]
    else:
        assert clipped[1] > 0.1 and clipped[2] == 0.0  # step 3 samples afresh: its ratio is 1 again


def test_the_rollout_policy_is_the_trained_policy(tiny_model_dir, tokenizer, prompts_dir, reward_file, tmp_path):
    """After an update, the next sampling's log-probabilities (the decoder's, of the tempered distribution) are those
    a fresh forward of the updated weights gives the same rows, not those of the weights before the update."""
    config = grpo_config(tiny_model_dir, prompts_dir, tmp_path, reward_file, temperature=0.7, lr=1e-2)
    run = prepared(config, tokenizer)
    sampler = run.objective.sampler(config, run.data, 1, 0)
    before = copy.deepcopy(run.backend.unwrap(run.model)).eval()
    run.step(run.batches(0, sampler.step_indices(0)), 0)
    [batch] = run.batches(1, sampler.step_indices(1))
    after = copy.deepcopy(run.backend.unwrap(run.model)).eval()
    trained = batch["labels"][:, 1:] != IGNORE
    with torch.no_grad():
        fresh, stale = (token_logps(model, batch, 0.7)[0] for model in (after, before))
    sampled = batch["sampled_logps"]
    assert (sampled - fresh).abs()[trained].max() < 1e-5
    assert (sampled - stale).abs()[trained].max() > 1e-2
    run.step([batch], 1)
    assert run.objective.window_metrics(run.backend)["sampling/sampling_logp_difference/max"] < 1e-5


# ---------------------------------------------------------------- a user's reward that fails

@pytest.mark.parametrize("how, message", [
    ("raises", "raised ValueError: the grader lost its key"),
    ("nan", "returned nan for completion 1; return finite numbers"),
    ("short", "returned 7 values for 8 completions; return one number per completion"),
])
def test_a_failing_reward_stops_the_run_in_one_line_keeping_the_last_checkpoint(
        how, message, tiny_model_dir, tokenizer, prompts_dir, reward_file, tmp_path, monkeypatch):
    """The reward works at step 1 and fails at step 2: one line naming the file and the function, and step_1/ (saved
    before) is whole; a fixed reward then continues from it."""
    import importlib

    monkeypatch.setenv("GRPO_TEST_FAILURE", how)
    monkeypatch.setattr(importlib.util, "spec_from_file_location", fresh_module(importlib.util.spec_from_file_location))
    config = grpo_config(tiny_model_dir, prompts_dir, tmp_path / "run", reward_file, "fails", save_every=1,
                         keep_last=3)
    with pytest.raises(TrainingError) as stopped:
        train(config)
    line = str(stopped.value)
    assert line == (f"reward fails in {reward_file} {message}; fix it, then run the same command again to continue "
                    f"from the last checkpoint")
    assert sorted(p.name for p in (tmp_path / "run").glob("step_*")) == ["step_1"]
    assert marker_problem(tmp_path / "run" / "step_1") is None
    monkeypatch.delenv("GRPO_TEST_FAILURE")
    summary = train(config)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert summary["steps"] == 4 and [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(row["reward"] == 0.5 and row["rewards/fails/mean"] == 0.5 and row["frac_reward_zero_std"] == 1.0
               for row in rows)
    assert all(0 < row["generation_seconds"] < row["batch_seconds"] and row["completions/mean_length"] > 0 and
               row["entropy"] > 0 and row["clip_ratio/region_mean"] == 0.0 for row in rows)
    report = (tmp_path / "run" / "report.html").read_text(encoding="utf-8")
    for panel, series in (("completion-rewards", "rewards-fails-mean"), ("completion-signal", "frac-reward-zero-std"),
                          ("kl-entropy", "entropy"), ("completion-length", "completions-mean-length"),
                          ("step-time", "generation-seconds")):
        assert f"id='panel-{panel}'" in report and f'id="{series}"' in report, panel


# What a reward may do wrong, as the expression its function returns (n: the number of completions), and the rest of
# the line that stops the run ("reward fails in FILE ..."): exits, values that are no real number or no finite one,
# containers of another kind or shape, and exceptions raised while its values are read.
BAD_REWARDS = [
    ("sys.exit(0)", "exited (SystemExit: 0); a reward returns its values, it does not end the process"),
    ("sys.exit('the grader gave up')",
     "exited (SystemExit: 'the grader gave up'); a reward returns its values, it does not end the process"),
    ("exit(3)", "exited (SystemExit: 3); a reward returns its values, it does not end the process"),
    ("[10**400] * n", "returned an integer of 1329 bits for completion 1, beyond a float's range; return finite numbers"),
    ("[0.5] * (n - 1) + [-10**400]",
     "returned an integer of 1329 bits for completion 8, beyond a float's range; return finite numbers"),
    ("[0.5 + 1j] * n", "returned (0.5+1j) for completion 1, not a real number; return one real number per completion"),
    ("np.full(n, 2j)", "returned 2j for completion 1, not a real number; return one real number per completion"),
    ("__import__('torch').full((n,), 1j)",
     "returned 1j for completion 1, not a real number; return one real number per completion"),
    ("[None] * n", "returned None for completion 1, not a real number; return one real number per completion"),
    ("['0.5'] * n", "returned '0.5' for completion 1, not a real number; return one real number per completion"),
    ("[__import__('decimal').Decimal('0.5')] * n",
     "returned Decimal('0.5') for completion 1, not a real number; return one real number per completion"),
    ("np.zeros((n, 2))",
     "returned array([0., 0.]) for completion 1, not a real number; return one real number per completion"),
    ("[math.inf] * n", "returned inf for completion 1; return finite numbers"),
    ("[0.5] * (n - 1) + [-math.inf]", "returned -inf for completion 8; return finite numbers"),
    ("np.full(n, np.nan)", "returned nan for completion 1; return finite numbers"),
    ("None", "returned None, not a list of 8 numbers (one per completion)"),
    ("0.5", "returned float, not a list of 8 numbers (one per completion)"),
    ("'0.5' * n", "returned str, not a list of 8 numbers (one per completion)"),
    ("{i: 0.5 for i in range(n)}", "returned dict, not a list of 8 numbers (one per completion)"),
    ("np.array(0.5)", "returned ndarray, not a list of 8 numbers (one per completion)"),
    ("np.zeros((1, n))", "returned 1 values for 8 completions; return one number per completion"),
    ("[0.5] * (n + 1)", "returned 9 values for 8 completions; return one number per completion"),
    ("(1 / 0 for _ in range(n))", "raised ZeroDivisionError: division by zero"),
    ("(_ for _ in ()).throw(RecursionError('too deep'))", "raised RecursionError: too deep"),
    ("(_ for _ in ()).throw(GeneratorExit)", "raised GeneratorExit"),
]
N = 8


def scored_at_the_second_call(reward_file, expression: str, monkeypatch) -> tuple:
    """score() at `fails`'s first call (fine) and second (returning `expression`), the file freshly imported."""
    monkeypatch.setenv("GRPO_TEST_FAILURE", f"return {expression}")
    reward = Reward("fails", 1.0, str(reward_file))
    load_user_reward(reward, lambda line: None)
    completions = [f"answer {i}" for i in range(N)]
    first = score([reward], ["q"] * N, completions, [[1, 2]] * N, {"answer": ["7"] * N})
    assert first[1] is None and first[0].tolist() == [[0.5]] * N
    return score([reward], ["q"] * N, completions, [[1, 2]] * N, {"answer": ["7"] * N})


@pytest.mark.parametrize("expression, message", BAD_REWARDS, ids=[expression for expression, _ in BAD_REWARDS])
def test_a_reward_that_exits_raises_or_returns_no_finite_real_number_is_one_line(expression, message, reward_file,
                                                                                monkeypatch):
    """score() never raises for the user's code: it gives the one line naming the file and the function."""
    values, problem = scored_at_the_second_call(reward_file, expression, monkeypatch)
    assert values.shape == (0, 1) and problem == f"reward fails in {reward_file} {message}"


@pytest.mark.parametrize("expression, expected", [
    ("[True, False] * (n // 2)", [1.0, 0.0] * 4), ("np.arange(n) % 2 == 0", [1.0, 0.0] * 4),
    ("np.arange(n, dtype=np.int64)", list(range(8))), ("np.full(n, 0.25, dtype=np.float32)", [0.25] * 8),
    ("__import__('torch').full((n,), -0.5)", [-0.5] * 8), ("[np.float64(2.0)] * n", [2.0] * 8),
    ("(i for i in range(n))", list(range(8))), ("(0.5,) * n", [0.5] * 8),
    ("[__import__('fractions').Fraction(1, 4)] * n", [0.25] * 8), ("[10**300] * n", [1e300] * 8),
])
def test_real_numbers_of_any_kind_are_a_rewards_values(expression, expected, reward_file, monkeypatch):
    """Python's, numpy's and torch's real numbers, in any sequence or iterator; True and False count as 1 and 0."""
    values, problem = scored_at_the_second_call(reward_file, expression, monkeypatch)
    assert problem is None and values[:, 0].tolist() == expected


def test_ctrl_c_in_a_reward_stays_an_interrupt(reward_file, monkeypatch):
    with pytest.raises(KeyboardInterrupt):
        scored_at_the_second_call(reward_file, "(_ for _ in ()).throw(KeyboardInterrupt)", monkeypatch)


@pytest.mark.parametrize("top_level, message", [
    ("import sys\nsys.exit(0)\n", "exited (SystemExit: 0); a reward returns its values, it does not end the process"),
    ("raise SystemExit('no grader here')\n",
     "exited (SystemExit: 'no grader here'); a reward returns its values, it does not end the process"),
    ("1 / 0\n", "raised ZeroDivisionError: division by zero"),
])
def test_a_reward_file_that_exits_or_raises_as_it_is_imported_is_one_line(top_level, message, tmp_path):
    path = tmp_path / "exits.py"
    path.write_text(top_level + "def score(completions, **columns):\n    return [1.0] * len(completions)\n")
    with pytest.raises(UserError) as refused:
        load_user_reward(Reward("score", 1.0, str(path)), lambda line: None)
    assert str(refused.value) == f"rewards: importing {path} {message}"


@pytest.mark.parametrize("expression, message", [BAD_REWARDS[0], BAD_REWARDS[3], BAD_REWARDS[5]],
                         ids=["sys.exit(0)", "10**400", "complex"])
def test_train_ends_with_exit_1_and_one_line_when_a_reward_exits_or_returns_no_real_number(
        expression, message, tiny_model_dir, prompts_dir, reward_file, tmp_path, capsys, monkeypatch):
    """Through the command line: a reward that calls sys.exit(0) (the run ended with exit 0, no message, no final/),
    returns 10**400 (an OverflowError traceback) or complex numbers (trained on their real part) at step 2: exit 1,
    one error line naming the file and the function and no traceback; step_1/, saved before, verifies and nothing
    after it was written."""
    monkeypatch.setenv("GRPO_TEST_FAILURE", f"return {expression}")
    out = tmp_path / "run"
    config = write_config(tmp_path, grpo_values(tiny_model_dir, prompts_dir, out, reward_file, "fails",
                                                save_every=1, keep_last=3))
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(config)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err
    assert error_lines(err) == [f"error: reward fails in {reward_file} {message}; fix it, then run the same command "
                                f"again to continue from the last checkpoint"]
    assert sorted(p.name for p in out.glob("step_*")) == ["step_1"] and not (out / "final").exists()
    assert marker_problem(out / "step_1") is None
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1]


def fresh_module(original):
    """importlib's spec_from_file_location, each call a module of its own: every run imports the reward file afresh
    (its call counter at 0), as a new process would."""
    count = iter(range(1_000_000))

    def spec(name, location, *args, **kwargs):
        return original(f"{name}_{next(count)}", location, *args, **kwargs)
    return spec


@pytest.mark.parametrize("entry, message", [
    ({"module": "no/such/rewards.py", "function": "score"},
     "rewards: module no/such/rewards.py: no such file; give the path of the Python file that defines score"),
    ({"module": "REWARDS", "function": "scorer"},
     "rewards: module REWARDS defines no function 'scorer' at its top level (it defines: variety, constant, "
     "answer_seven, fails); fix function or the file"),
])
def test_a_missing_reward_file_or_function_is_one_line_before_the_model_loads(entry, message, tiny_model_dir,
                                                                            prompts_dir, reward_file, tmp_path):
    entry = {key: str(reward_file) if value == "REWARDS" else value for key, value in entry.items()}
    config = grpo_config(tiny_model_dir, prompts_dir, tmp_path, reward_file)
    config.rewards = [entry]
    with pytest.raises(UserError) as refused:
        train(config)
    assert str(refused.value) == message.replace("REWARDS", str(reward_file))
    assert not (tmp_path / "run_id").exists()


# ---------------------------------------------------------------- learning, and resuming exactly

SEVEN = [{"prompt": f"Question {i}: say a number.", "target": "7", "source": "t"} for i in range(32)]


def learning_values(model_dir, data_dir, reward_file, **overrides) -> dict:
    values = dict(model_name=str(model_dir), dataset_path=str(data_dir), objective="grpo",
                  rewards=[{"module": str(reward_file), "function": "answer_seven"}], num_generations=8,
                  max_completion_length=4, max_length=32, batch_size=8, lr=3e-2, min_lr=3e-2, warmup_steps=0,
                  max_grad_norm=1.0, num_epochs=50, max_steps=20, val_fraction=0.0, eval_every=None, save_every=1,
                  keep_last=3, num_proc=1, seed=0, report_to=["jsonl"], dtype="float32")
    values.update(overrides)
    return values


@pytest.mark.slow
@pytest.mark.integration
def test_a_rewarded_answer_is_learned_and_a_kill_between_sampling_and_update_resumes_bitwise(
        tiny_model_dir, reward_file, tmp_path):
    """The reward is 1 when the last number a completion says is 7, which the random model says in under 2% of its
    completions: within 20 steps the mean reward passes 0.8. The same run, SIGKILLed by its reward function at the
    8th sampling (after sampling step 8's completions, before its update), then run again, resumes from step_7 and
    ends with the rows and weights of the run that never stopped, bit for bit. 16 completions of each prompt, so that
most steps see a 7 somewhere (with 8, a run can go a dozen steps without one: no signal)."""
    data = write_jsonl(tmp_path / "data" / "seven_clean.jsonl", SEVEN).parent
    config = write_config(tmp_path, learning_values(tiny_model_dir, data, reward_file, num_generations=16))
    train(load_config(config, [f"output_dir={tmp_path / 'whole'}"]))
    rewards = [row["reward"] for row in exact_rows(tmp_path / "whole")]
    assert rewards[0] < 0.2 and rewards[-1] > 0.8, rewards
    assert len(rewards) == 20

    killed = run_train(config, tmp_path / "resumed", env={"GRPO_TEST_SIGNAL": "KILL:8"})
    assert killed.returncode == -signal.SIGKILL, explain(killed)
    assert [row["step"] for row in read_jsonl(tmp_path / "resumed" / "metrics.jsonl")][-1] == 7
    resumed = run_train(config, tmp_path / "resumed")
    assert resumed.returncode == 0, explain(resumed)
    assert "resumed from" in resumed.stdout + resumed.stderr and "step_7" in resumed.stdout + resumed.stderr
    assert exact_rows(tmp_path / "resumed") == exact_rows(tmp_path / "whole")
    assert_bitwise_equal_weights(tmp_path / "resumed" / "final", tmp_path / "whole" / "final")


def test_a_stop_between_two_steps_on_the_same_completions_resumes_with_them(tiny_model_dir, reward_file, tmp_path,
                                                                            monkeypatch):
    """num_iterations 2: a SIGTERM at the second sampling (step 3) stops after step 3 with a checkpoint holding the
    completions step 4 trains on again (objective/rank0.pt); the resumed run takes them back and repeats the run that
    never stopped bit for bit."""
    import importlib

    monkeypatch.setattr(importlib.util, "spec_from_file_location", fresh_module(importlib.util.spec_from_file_location))
    data = write_jsonl(tmp_path / "data" / "seven_clean.jsonl", SEVEN).parent
    values = learning_values(tiny_model_dir, data, reward_file, num_iterations=2, max_steps=6, num_generations=4,
                             batch_size=4)
    train(validate(TrainConfig(**values, output_dir=str(tmp_path / "whole"))))
    monkeypatch.setenv("GRPO_TEST_SIGNAL", "TERM:2")
    stopped = train(validate(TrainConfig(**values, output_dir=str(tmp_path / "resumed"))))
    assert stopped["steps"] == 3 and stopped["exit_code"] == 128 + signal.SIGTERM
    saved = torch.load(tmp_path / "resumed" / "step_3" / "objective" / "rank0.pt", weights_only=True)
    assert int(saved["step"]) == 2 and saved["batch0.input_ids"].shape[0] == 16
    assert not (tmp_path / "resumed" / "step_2" / "objective").exists()  # step 3 samples afresh: nothing to keep
    monkeypatch.delenv("GRPO_TEST_SIGNAL")
    train(validate(TrainConfig(**values, output_dir=str(tmp_path / "resumed"))))
    assert exact_rows(tmp_path / "resumed") == exact_rows(tmp_path / "whole")
    assert_bitwise_equal_weights(tmp_path / "resumed" / "final", tmp_path / "whole" / "final")


# ---------------------------------------------------------------- two processes

# Every 3rd token id ends a completion (as chat models list several EOS ids): a random model's completions then stop
# at many lengths, and the ranks' decodes at different turns (FSDP2 without lockstep hangs in the first step).
EVERY_EOS = 3


@pytest.fixture(scope="module")
def one_process_runs(tiny_model_dir, prompts_dir, reward_file, tmp_path_factory) -> Path:
    """The 2-process comparison's config and its 1-process runs: "one" (4 prompts a step) and "accumulated" (the
    same steps as 2 micro-batches of 2 prompts), on a copy of the tiny model whose generation config names every
    EVERY_EOS-th id an EOS."""
    import shutil

    folder = tmp_path_factory.mktemp("grpo-processes")
    model_dir = Path(shutil.copytree(tiny_model_dir, folder / "model"))
    (model_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": list(range(0, 1000, EVERY_EOS))}))
    values = {"model_name": str(model_dir), "dataset_path": str(prompts_dir), "objective": "grpo",
              "rewards": [{"module": str(reward_file), "function": "variety"}], "num_generations": 4,
              "max_completion_length": 6, "max_length": 32, "lr": 1e-2, "min_lr": 1e-2, "warmup_steps": 0,
              "val_fraction": 0.0, "num_epochs": 10, "max_steps": 3, "eval_every": None, "save_every": None,
              "num_proc": 1, "seed": 0, "report_to": ["jsonl"], "lora": True, "lora_r": 4, "lora_alpha": 8,
              "lora_dropout": 0.0, "beta": 0.04, "dtype": "float32"}
    config = write_config(folder, values)
    train(load_config(config, [f"output_dir={folder / 'one'}", "batch_size=4"]))
    train(load_config(config, [f"output_dir={folder / 'accumulated'}", "batch_size=2",
                               "gradient_accumulation_steps=2"]))
    return config


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["ddp", "fsdp2", "zero2"])
def test_two_processes_train_as_one(launcher, one_process_runs, tmp_path):
    """DDP, DeepSpeed ZeRO-2, and FSDP2 decoding in lockstep, on 2 ranks (2 prompts each) against 1 process (4 prompts a step): the
    same completions (seeded per prompt; of many lengths, so FSDP2's ranks finish decoding at different turns), so
    the same rewards to the bit, and losses and weights equal within a tolerance derived from one process itself: the
    same steps as 2 micro-batches of 2 prompts (gradient accumulation) sum in another order, as the ranks do; their
    difference, times 10, bounds the one between the ranks and one process. LoRA with beta > 0: the reference is the
    base with the adapter disabled, on sharded weights under FSDP2."""
    config, folder = one_process_runs, one_process_runs.parent
    launchers = {"ddp": lambda: torchrun(2), "fsdp2": lambda: accelerate_fsdp2(2),
                 "zero2": lambda: accelerate_deepspeed(2, REPO / "configs" / "deepspeed" / "ds_config.json")}
    two = run_train(config, tmp_path / "two", "batch_size=2",
                    launcher=launchers[launcher](), timeout=300)
    assert two.returncode == 0, explain(two)
    assert ("FSDP2: 2 GPTJBlock units and the root, sharded over 2 processes" in two.stdout) == (launcher == "fsdp2")
    one, accumulated, ranks = ([row for row in exact_rows(path) if "loss" in row]
                               for path in (folder / "one", folder / "accumulated", tmp_path / "two"))
    assert len(one) == len(accumulated) == len(ranks) == 3
    assert [row["reward"] for row in ranks] == [row["reward"] for row in one] == \
        [row["reward"] for row in accumulated]
    assert len({row["reward"] for row in one}) > 1  # the weights moved: each step sampled other completions
    # Completions ended at an EOS and at the limit alike.
    assert sum(row["completions/clipped_ratio"] for row in one) > 0 and all(row["completions/mean_length"] < 6
                                                                             for row in one)
    assert [row["completions/mean_length"] for row in ranks] == [row["completions/mean_length"] for row in one]

    def loss_gap(rows) -> float:
        return max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, one))

    fp32 = torch.finfo(torch.float32).eps
    weight_spread = max_weight_difference(folder / "accumulated" / "final", folder / "one" / "final")
    weight_gap = max_weight_difference(tmp_path / "two" / "final", folder / "one" / "final")
    print(f"grpo {launcher} 2 ranks vs 1: loss {loss_gap(ranks):.2e} (accumulation's {loss_gap(accumulated):.2e}), "
          f"weights {weight_gap:.2e} (accumulation's {weight_spread:.2e})")
    assert loss_gap(ranks) <= max(10 * loss_gap(accumulated), 16 * fp32)
    assert weight_gap <= max(10 * weight_spread, 16 * fp32)


# ---------------------------------------------------------------- plan

def test_plan_counts_prompts_and_completions_at_their_longest_and_states_the_reference(tiny_model_dir, prompts_dir,
                                                                                       reward_file, tokenizer,
                                                                                       tmp_path):
    """4 steps of 2 prompts: each of the 8 prompts once, 4 completions each counted at max_completion_length (6);
    beta 0: no reference; beta > 0 in full fine-tuning: a frozen fp32 copy (4 bytes a parameter) in memory."""
    from gpt4all_training.preflight.plan import make_plan

    config = grpo_config(tiny_model_dir, prompts_dir, tmp_path, reward_file)
    plan = make_plan(config)
    lengths = objective_for(config).load_data(config, tokenizer, print, 1).train.lengths()
    prompt_tokens = sum(lengths)
    assert (plan.train_examples, plan.run.examples, plan.run.trained) == (8, 8, 8 * 4 * 6)
    assert plan.run.tokens == 4 * (prompt_tokens + 8 * 6)
    assert "grpo: examples are prompts; each optimizer step trains on 4 completions of each of its 2 prompts, " \
           "sampled afresh every 1 step(s): 32 completions in the run" in "\n".join(plan.notes)
    assert "grpo reference: none (beta 0): no KL term and no reference forward" in plan.notes
    # The KV cache of 2 x 4 rows: keys and values x 2 layers x 4 heads x 16 values x 4 bytes per token.
    kv_mib = 2 * 2 * 8 * (max(lengths) + 6) * 4 * 16 * 4 / 2**20
    assert f"8 rows with a KV cache of at most {kv_mib:,.1f} MiB" in "\n".join(plan.notes)
    assert kv_cache_bytes(config, 8, 20) == 2 * 2 * 8 * 20 * 4 * 16 * 4
    assert plan.memory["full (DDP)"].reference == 0 and "ZeRO-3" in plan.memory
    frozen = make_plan(grpo_config(tiny_model_dir, prompts_dir, tmp_path, reward_file, beta=0.1))
    assert frozen.memory["full (DDP)"].reference == 4 * frozen.shape.parameters
    assert "ZeRO-3" not in frozen.memory  # refused there: no process holds a whole model to copy
    assert any(note.startswith("grpo reference: a frozen fp32 copy") for note in frozen.notes)


class PartitioningBackend:
    """What FSDP2 and ZeRO-3 on several processes tell an objective: each holds part of every parameter."""
    partitions_parameters = True


def test_a_frozen_copy_under_partitioned_parameters_is_refused_naming_what_works(tiny_model_dir, prompts_dir,
                                                                                 reward_file, tmp_path):
    config = grpo_config(tiny_model_dir, prompts_dir, tmp_path, reward_file, beta=0.1)
    with pytest.raises(UserError) as error:
        objective_for(config).build_model(config, None, PartitioningBackend())
    assert str(error.value) == ("objective grpo: beta > 0 in full fine-tuning keeps a frozen copy of the whole model "
                                "in every process, which ZeRO-3 and FSDP2 partition; use lora: true (the reference is "
                                "the base with the adapter disabled) or beta: 0")


def test_prompts_written_only_as_messages_end_with_the_generation_prompt(chat_tokenizer):
    """A dataset of message prompts alone (no text one to encode): each prompt is the chat template's rendering with
    the generation prompt."""
    from gpt4all_training.data.prompt_records import encode_prompt_records

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say 7."}]
    [ids] = encode_prompt_records([{"prompt": messages}], chat_tokenizer, "chat")
    expected = chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat_tokenizer.decode(ids) == expected and expected.endswith("<|im_start|>assistant\n")


def test_check_reads_prompts_and_its_dry_run_samples_and_updates(tiny_model_dir, prompts_dir, reward_file, tmp_path):
    """`check` on a grpo config: the dataset check counts prompts, and the 2-step dry run samples completions and
    updates on them."""
    from gpt4all_training.preflight.check import run_checks

    config = write_config(tmp_path, {"model_name": str(tiny_model_dir), "dataset_path": str(prompts_dir),
                                     "objective": "grpo", "rewards": [{"module": str(reward_file),
                                                                       "function": "variety"}],
                                     "num_generations": 4, "max_completion_length": 6, "max_length": 32,
                                     "batch_size": 2, "max_steps": 4, "val_fraction": 0.0, "num_proc": 1,
                                     "dtype": "float32"})
    lines: list[str] = []
    outcomes = run_checks(str(config), [f"output_dir={tmp_path / 'out'}"], report=lines.append)
    assert all(o.ok for o in outcomes), lines
    assert f"ok    dataset: {prompts_dir}: 8 records, all with prompt (text)" in lines
    assert lines[-1].startswith("ok    dry run: 2 steps on 2 prompts x 4 completions passed"), lines[-1]
