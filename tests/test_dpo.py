"""objective: dpo on the tiny GPT-J: the loss at the reference point, the loss and gradients against a hand computation
and against TRL's DPOTrainer, batch/accumulation parity, learning a preference rule, exact resume, pair tokenization
with the masks sft uses, the config's refusals and bad preference data.

Everything runs in this process: the loop's own pieces (objective_for, the objective's build_model, prepare,
train_step) or train().
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from support.files import write_jsonl
from support.outputs import assert_bitwise_equal_weights, exact_rows

from gpt4all_training.backends.accelerate import backend_for
from gpt4all_training.batch import IGNORE
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.chat import tokenized_conversations
from gpt4all_training.data.pairs import load_preference_records, tokenize_message_pairs, tokenize_text_pairs
from gpt4all_training.data.sft import tokenize_batch
from gpt4all_training.errors import UserError
from gpt4all_training.training.loop import prepare, train
from gpt4all_training.training.objectives import objective_for
from gpt4all_training.training.step import train_step

LN2 = torch.tensor(math.log(2), dtype=torch.float32).item()  # what -log sigmoid(0) is in fp32
PAIRS = [("What is the capital of France?", "Paris.", "London, I think."), ("Name a primary colour.", "Red.", "A dog."),
         ("What is two plus two?", "Four.", "Five or so."), ("Say hello.", "Hello!", "No."),
         ("Which animal barks?", "A dog.", "A cat, usually."), ("What do bees make?", "Honey.", "Paper."),
         ("Opposite of hot?", "Cold.", "Warm, or hot."), ("Largest planet?", "Jupiter.", "The moon.")]
# The rule test: the chosen answer says the word once, the rejected one repeats it. Held-out words are never trained.
WORDS = ["apple", "river", "house", "music", "water", "light", "green", "money", "story", "world", "bread", "chair",
         "horse", "paper", "stone", "table", "night", "plant", "sugar", "glass", "train", "cloud", "field", "heart",
         "piano", "ocean", "tiger", "lemon", "smile", "dream", "beach", "metal", "sheep", "snake", "grape", "candy"]


def pair_rows(pairs) -> list[dict]:
    return [{"prompt": p, "chosen": c, "rejected": r, "source": "t"} for p, c, r in pairs]


def rule_pairs(words) -> list[tuple[str, str, str]]:
    return [(f"Say {w}.", f"{w}.", f"{w}, {w} and {w} again.") for w in words]


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs_clean.jsonl", pair_rows(PAIRS)).parent


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One tokenized-data cache for the module's runs: each data and settings is tokenized (and scored by the
    reference) once."""
    return tmp_path_factory.mktemp("dpo-cache")


def dpo_config(model_dir, data_dir, output_dir, **overrides) -> TrainConfig:
    values = dict(model_name=str(model_dir), dataset_path=str(data_dir), output_dir=str(output_dir), objective="dpo",
                  max_length=48, batch_size=4, lr=1e-3, min_lr=1e-3, warmup_steps=0, val_fraction=0.0,
                  num_epochs=10, max_steps=10, eval_every=None, save_every=None, num_proc=1, seed=0,
                  max_grad_norm=None, dtype="float32")
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

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return self.objective.fetch(self.data.train, indices, 0)


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


# ---------------------------------------------------------------- an independent computation

def hand_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the sum of log-probabilities of the answer tokens, from the full logits, and their count."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    mask = targets != IGNORE
    logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (logp * mask).sum(1), mask.sum(1)


def hand_loss(policy, reference, batch, loss_type: str, beta: float, smoothing: float, gamma: float,
              sft_weight: float = 0.0):
    pi, n = hand_logps(policy, batch)
    with torch.no_grad():
        ref = hand_logps(reference, batch)[0]
    half = len(pi) // 2
    nll = -(pi[:half] / n[:half])  # the chosen answers' mean NLL per token (RPO's term)
    if loss_type == "ipo":
        d = (pi - ref)[:half] / n[:half] - (pi - ref)[half:] / n[half:]
        return ((d - 1 / (2 * beta)) ** 2 + sft_weight * nll).mean()
    if loss_type == "simpo":
        d = beta * (pi[:half] / n[:half] - pi[half:] / n[half:]) - gamma
    else:
        d = beta * ((pi - ref)[:half] - (pi - ref)[half:])
    return (-(1 - smoothing) * F.logsigmoid(d) - smoothing * F.logsigmoid(-d) + sft_weight * nll).mean()


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


def perturbed(model, seed: int = 1):
    """The policy moved away from its initial weights, so that it differs from the reference."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model


# ---------------------------------------------------------------- the chunked head's per-row log-probabilities

def test_chunked_log_probs_and_their_gradients_equal_the_full_logits():
    """Chunks of 3 rows, and a different incoming gradient per row (as a preference loss gives)."""
    from gpt4all_training.training.loss import ChunkedLinearLogProbs

    generator = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(10, 16, generator=generator), torch.nn.Linear(16, 50)
    targets, upstream = torch.randint(0, 50, (10,), generator=generator), torch.randn(10, generator=generator)
    inputs = [hidden.clone().requires_grad_(), head.weight.detach().clone().requires_grad_(),
              head.bias.detach().clone().requires_grad_()]
    chunked = ChunkedLinearLogProbs.apply(*inputs, targets, torch.float32, 3)
    (chunked * upstream).sum().backward()
    full_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    full = torch.log_softmax(F.linear(*full_inputs), -1).gather(1, targets[:, None]).squeeze(1)
    (full * upstream).sum().backward()
    assert torch.allclose(chunked, full, atol=1e-6)
    for ours, theirs in zip(inputs, full_inputs):
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-6)


# ---------------------------------------------------------------- the reference point

@pytest.mark.parametrize("reference", ["lora", "frozen_copy", "precomputed"])
def test_at_the_first_step_the_sigmoid_loss_is_ln2_and_the_rewards_are_zero(reference, tiny_model_dir, tokenizer,
                                                                            pairs_dir, shared_cache, tmp_path):
    """Any batch scores ln 2 per pair while the policy is the reference. LoRA (adapter disabled) and a frozen copy
    score the same micro-batch as the policy does, so bit for bit; the precomputed pass batches pairs differently
    (other padding), which may move the last bits."""
    lora = reference == "lora"
    config = dpo_config(tiny_model_dir, pairs_dir, tmp_path, cache_dir=str(shared_cache), lora=lora,
                        reference=None if lora else reference)
    run = prepared(config, tokenizer)
    exact = reference != "precomputed"
    for indices in ([0, 1, 2, 3], [5, 6], [7, 2, 4]):
        terms = run.objective.loss.terms(run.model, run.backend.to_device(run.batch(indices)))
        if exact:
            assert terms.losses.tolist() == [LN2] * len(indices)
            assert terms.chosen_rewards.tolist() == terms.rejected_rewards.tolist() == [0.0] * len(indices)
        else:
            assert terms.losses.sub(LN2).abs().max() < 1e-6
            assert terms.chosen_rewards.abs().max() < 1e-6 and terms.rejected_rewards.abs().max() < 1e-6
    result = train_step(run.model, [run.batch([0, 1]), run.batch([2, 3])], run.backend, run.optimizer, run.scheduler,
                        None, 0, run.objective.loss, count=run.objective.count)
    metrics = run.objective.window_metrics(run.backend)
    assert result["loss"] == LN2 if exact else abs(result["loss"] - LN2) < 1e-6
    assert metrics["rewards/accuracies"] == 0.0  # no pair's chosen reward is above its rejected one: they are equal
    assert abs(metrics["rewards/margins"]) < 1e-6 and abs(metrics["rewards/chosen"]) < 1e-6


# ---------------------------------------------------------------- against a hand computation and TRL

@pytest.mark.parametrize("loss_type, smoothing, sft_weight", [
    ("sigmoid", 0.0, 0.0), ("sigmoid", 0.2, 0.0), ("ipo", 0.0, 0.0), ("simpo", 0.1, 0.0), ("sigmoid", 0.0, 1.0),
    ("ipo", 0.0, 0.5)])
def test_loss_and_gradients_equal_a_hand_computation(loss_type, smoothing, sft_weight, tiny_model_dir, tokenizer,
                                                     pairs_dir, shared_cache, tmp_path):
    from transformers import AutoModelForCausalLM

    config = dpo_config(tiny_model_dir, pairs_dir, tmp_path, cache_dir=str(shared_cache), loss_type=loss_type,
                        label_smoothing=smoothing, beta=2.0 if loss_type == "simpo" else 0.1,
                        simpo_gamma=0.7 if loss_type == "simpo" else 0.5, sft_weight=sft_weight)
    run = prepared(config, tokenizer)
    model = perturbed(run.model)
    batch = run.batch([0, 1, 2, 3])
    ours = run.objective.loss(model, batch) / 4
    ours.backward()
    our_grads = gradients(model)
    model.zero_grad()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    theirs = hand_loss(model, reference, batch, loss_type, config.beta, smoothing, config.simpo_gamma, sft_weight)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6) and abs(ours.item() - LN2) > 1e-3
    largest = max(g.abs().max().item() for g in our_grads.values())
    assert max_gap(our_grads, gradients(model)) < 1e-6 * max(1.0, largest)


@pytest.fixture(scope="module")
def trl_dpo():
    """TRL's DPOTrainer and DPOConfig: the test-only oracle (requirements-dev.txt)."""
    trl = pytest.importorskip("trl")
    return trl.DPOTrainer, trl.DPOConfig


def trl_oracle(trl_dpo, model, model_dir, tokenizer, rows, tmp_path, **args):
    """TRL's DPOTrainer on a copy of `model` (its reference the weights in `model_dir`), beta 0.3, over `rows` as text
    pairs whose prompts are ours as the plain template writes them; `args`: more of DPOConfig."""
    import datasets
    from transformers import AutoModelForCausalLM

    DPOTrainer, DPOConfig = trl_dpo
    return DPOTrainer(
        model=copy.deepcopy(model), ref_model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.3, report_to=[], use_cpu=True, bf16=False,
                       max_length=None, save_strategy="no", **args),
        train_dataset=datasets.Dataset.from_dict({"prompt": [p + "\n" for p in rows["prompt"]],
                                                  "chosen": rows["chosen"], "rejected": rows["rejected"]}),
        processing_class=tokenizer)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_and_gradients_equal_trls_dpo_trainer(loss_type, trl_dpo, tiny_model_dir, tokenizer, pairs_dir,
                                                   shared_cache, tmp_path):
    """The same model, pairs and beta through TRL 1.16's own tokenization, collation and compute_loss. TRL's text
    pairs are prompt + completion with EOS, so its prompt is ours as the plain template writes it (prompt + newline):
    the token ids must then be the same, which the test checks first."""
    config = dpo_config(tiny_model_dir, pairs_dir, tmp_path, cache_dir=str(shared_cache), loss_type=loss_type,
                        beta=0.3, prompt_template="plain")
    run = prepared(config, tokenizer)
    model = perturbed(run.model)
    indices = [0, 1, 2, 3]
    oracle = trl_oracle(trl_dpo, model, tiny_model_dir, tokenizer, run.data.train.select(indices), tmp_path,
                        per_device_train_batch_size=4, loss_type=[loss_type])
    their_batch = oracle.data_collator([oracle.train_dataset[i] for i in range(4)])
    batch = run.batch(indices)
    assert torch.equal(their_batch["input_ids"], batch["input_ids"])
    assert torch.equal(their_batch["completion_mask"][:, 1:].bool(), batch["labels"][:, 1:] != IGNORE)

    ours = run.objective.loss(model, batch) / 4
    ours.backward()
    theirs = oracle.compute_loss(oracle.model.train(), their_batch)
    theirs.backward()
    loss_gap, grad_gap = abs(ours.item() - theirs.item()), max_gap(gradients(model), gradients(oracle.model))
    print(f"TRL parity ({loss_type}): loss {ours.item():.6f}, |loss - TRL| {loss_gap:.2e}, max |grad - TRL| "
          f"{grad_gap:.2e}")
    assert loss_gap < 1e-5 and grad_gap < 1e-5
    window = run.objective.window_metrics(run.backend)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert abs(window[name] - oracle._metrics["train"][name][-1]) < 1e-5, name


def test_the_sft_term_equals_trls_sft_loss_pair_by_pair(trl_dpo, tiny_model_dir, tokenizer, pairs_dir,
                                                       shared_cache, tmp_path):
    """sft_weight 1 is TRL's loss_type [sigmoid, sft] with loss_weights [1, 1] (RPO). TRL averages its sft term over
    a micro-batch's chosen tokens and this one over each pair's, so they agree pair by pair: TRL scores each pair as a
    batch of its own, and the mean of those is this objective's loss over the four pairs."""
    config = dpo_config(tiny_model_dir, pairs_dir, tmp_path, cache_dir=str(shared_cache), beta=0.3,
                        prompt_template="plain", sft_weight=1.0)
    run = prepared(config, tokenizer)
    model = perturbed(run.model)
    indices = [0, 1, 2, 3]
    oracle = trl_oracle(trl_dpo, model, tiny_model_dir, tokenizer, run.data.train.select(indices), tmp_path,
                        per_device_train_batch_size=1, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 1.0])
    batch = run.batch(indices)
    ours = run.objective.loss(model, batch) / 4
    ours.backward()
    theirs = sum(oracle.compute_loss(oracle.model.train(), oracle.data_collator([oracle.train_dataset[i]])) / 4
                 for i in range(4))
    theirs.backward()
    assert abs(ours.item() - theirs.item()) < 1e-5
    assert max_gap(gradients(model), gradients(oracle.model)) < 1e-5
    loss = run.objective.loss
    loss.settings = dataclasses.replace(loss.settings, sft_weight=0.0)
    with torch.no_grad():
        assert ours.item() - loss(model, batch).item() / 4 > 0.1  # the term is there, and a mean NLL is positive


# ---------------------------------------------------------------- the step: every pair weighs the same

def test_batch_4_by_accumulation_1_equals_batch_2_by_accumulation_2(tiny_model_dir, tokenizer, pairs_dir,
                                                                    shared_cache, tmp_path):
    """One SGD step of lr 1 moves each weight by minus its gradient: the two layouts must take the same step, and log
    the same loss and rewards (a mean over pairs, whatever their answers' lengths)."""
    def one_step(micro_batches: list[list[int]]):
        config = dpo_config(tiny_model_dir, pairs_dir, tmp_path / str(len(micro_batches)),
                            cache_dir=str(shared_cache), batch_size=len(micro_batches[0]),
                            gradient_accumulation_steps=len(micro_batches))
        run = prepared(config, tokenizer)
        model = perturbed(run.model)  # away from ln 2, where every pair's gradient is alike
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)
        constant = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0)
        result = train_step(model, [run.batch(m) for m in micro_batches], run.backend, sgd, constant, None, 0,
                            run.objective.loss, count=run.objective.count)
        moved = {n: p.detach() - before[n] for n, p in model.named_parameters()}
        return result, run.objective.window_metrics(run.backend), moved

    whole, whole_metrics, whole_moved = one_step([[0, 1, 2, 3]])
    split, split_metrics, split_moved = one_step([[0, 1], [2, 3]])
    assert abs(whole["loss"] - split["loss"]) < 1e-7 and whole["n_trained"] == split["n_trained"]
    assert max_gap(whole_moved, split_moved) < 1e-6 and max(v.abs().max() for v in whole_moved.values()) > 1e-3
    assert whole_metrics.keys() == split_metrics.keys()
    assert all(abs(whole_metrics[k] - split_metrics[k]) < 1e-5 for k in whole_metrics)


# ---------------------------------------------------------------- learning, saving, resuming

@pytest.mark.slow
def test_a_rule_is_learned_and_holds_on_held_out_pairs(tiny_model_dir, tokenizer, shared_cache, tmp_path):
    """Chosen answers say the word once, rejected ones three times. Validation pairs use words training never sees;
    their reward accuracy is measured by the loop, and again here from final/ as a user loads it."""
    from transformers import AutoModelForCausalLM

    from gpt4all_training.data.pairs import fetch_pairs

    data = write_jsonl(tmp_path / "data" / "rule_clean.jsonl", pair_rows(rule_pairs(WORDS))).parent
    config = dpo_config(tiny_model_dir, data, tmp_path / "run", cache_dir=str(shared_cache), val_fraction=0.25,
                        batch_size=9, lr=3e-3, min_lr=3e-4, max_steps=12, eval_every=12, beta=0.5)
    summary = train(config)
    assert summary["val_pairs"] == 9 and summary["val_rewards/accuracies"] > 0.9
    report = (tmp_path / "run" / "report.html").read_text(encoding="utf-8")
    assert "id='panel-rewards'" in report and "id='panel-reward-accuracy'" in report
    run = prepared(config, tokenizer)  # the same validation split and reference, from the shared cache
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").eval()
    with torch.no_grad():
        batch = fetch_pairs(run.data.val, list(range(len(run.data.val))), 0)
        logps = hand_logps(final, batch)[0] - batch["reference_logps"]
    half = len(logps) // 2
    assert (logps[:half] > logps[half:]).float().mean().item() > 0.9


@pytest.mark.slow
def test_a_resumed_run_is_bitwise_the_run_that_never_stopped(tiny_model_dir, tokenizer, shared_cache, tmp_path,
                                                             capsys):
    """Full fine-tuning with the precomputed reference: the resumed run reads the reference from the cache (the
    checkpoint's weights are not the reference) and repeats the losses, rewards and weights bit for bit."""
    data = write_jsonl(tmp_path / "data" / "rule_clean.jsonl", pair_rows(rule_pairs(WORDS[:24]))).parent
    common = dict(cache_dir=str(shared_cache), val_fraction=0.25, batch_size=3, max_steps=6, eval_every=3,
                  save_every=3, lr=3e-3, warmup_steps=2)
    train(dpo_config(tiny_model_dir, data, tmp_path / "whole", **common))
    capsys.readouterr()
    resumed = tmp_path / "resumed"
    train(dpo_config(tiny_model_dir, data, resumed, checkpoint=str(tmp_path / "whole" / "step_3"), **common))
    out = capsys.readouterr().out
    assert "reference log-probabilities: cache hit" in out and "resumed from" in out
    assert exact_rows(resumed) == [row for row in exact_rows(tmp_path / "whole") if row["step"] > 3]
    assert any("rewards/accuracies" in row for row in exact_rows(resumed))
    assert_bitwise_equal_weights(resumed / "final", tmp_path / "whole" / "final")


def test_plan_counts_pairs_and_states_the_reference_and_its_memory(tiny_model_dir, pairs_dir, shared_cache,
                                                                   tmp_path):
    from gpt4all_training.preflight.plan import make_plan

    config = dpo_config(tiny_model_dir, pairs_dir, tmp_path, cache_dir=str(shared_cache), max_steps=2)
    plan = make_plan(config)
    assert (plan.train_examples, plan.run.examples, plan.memory["full (DDP)"].reference) == (8, 8, 0)
    assert any(note.startswith("dpo reference: precomputed (the default): before step 1, one no-grad pass of the "
                               "initial weights over the 8 train and 0 validation pairs") for note in plan.notes)
    frozen = make_plan(dpo_config(tiny_model_dir, pairs_dir, tmp_path, cache_dir=str(shared_cache), max_steps=2,
                                  reference="frozen_copy"))
    assert frozen.memory["full (DDP)"].reference == 4 * frozen.shape.parameters
    assert frozen.memory["full (DDP)"].activations == plan.memory["full (DDP)"].activations
    assert "+ reference" in frozen.describe() and "ZeRO-3" not in [n for n, m in frozen.memory.items() if m.reference]


# ---------------------------------------------------------------- tokenization: the masks sft uses

def test_text_pairs_are_sft_examples_sharing_one_cut_prompt(tokenizer):
    """Each answer is the sft example of (prompt, answer); a prompt too long for both is cut once, for the longer
    answer, so the two keep the same prompt."""
    batch = {"prompt": ["What is two plus two?", "word " * 40], "chosen": ["Four.", "Short."],
             "rejected": ["Five, I believe.", "A much longer answer that needs more room than the other."]}
    pairs = tokenize_text_pairs(batch, tokenizer, 48, "plain")
    alone = {name: tokenize_batch({"prompt": batch["prompt"], "response": batch[name]}, tokenizer, 48, "plain")
             for name in ("chosen", "rejected")}
    for name in ("chosen", "rejected"):
        assert pairs[f"{name}_input_ids"][0] == alone[name]["input_ids"][0]
        assert pairs[f"{name}_labels"][0] == alone[name]["labels"][0]
    assert pairs["drop_reason"] == ["", ""] and pairs["truncated_prompt"] == [False, True]
    prompts = [[i for i, label in zip(pairs[f"{name}_input_ids"][1], pairs[f"{name}_labels"][1]) if label == IGNORE]
               for name in ("chosen", "rejected")]
    assert prompts[0] == prompts[1] and len(pairs["rejected_input_ids"][1]) == 48
    assert alone["chosen"]["input_ids"][1] != pairs["chosen_input_ids"][1]  # alone, it would have kept more prompt


def test_message_pairs_are_conversations_trained_on_the_answer_only(chat_tokenizer):
    """Prompt + answer is the conversation data/chat.py labels, with the prompt's own assistant turn as context."""
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}]
    chosen, rejected = [{"role": "assistant", "content": "Red."}], [{"role": "assistant", "content": "A dog."}]
    pairs = tokenize_message_pairs({"prompt": [prompt], "chosen": [chosen], "rejected": [rejected]}, chat_tokenizer,
                                   128, "all")
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        context = [*prompt[:2], {**prompt[2], "train": False}, prompt[3]]
        alone = tokenized_conversations({"messages": [[*context, *answer]]}, chat_tokenizer, 128, "all")
        assert pairs[f"{name}_input_ids"][0] == alone["input_ids"][0]
        assert pairs[f"{name}_labels"][0] == alone["labels"][0]
        trained = [i for i, label in zip(pairs[f"{name}_input_ids"][0], pairs[f"{name}_labels"][0]) if label != IGNORE]
        assert chat_tokenizer.decode(trained) == f"{answer[0]['content']}<|im_end|>"
    identical = tokenize_message_pairs({"prompt": [prompt], "chosen": [chosen], "rejected": [chosen]}, chat_tokenizer,
                                       128, "all")
    assert identical["drop_reason"] == ["identical_answers"]
    # Room for the chosen conversation whole, not for the rejected one: both lose the first round, not one alone.
    longer = [{"role": "assistant", "content": "A dog, which is an animal."}]
    cut = tokenize_message_pairs({"prompt": [prompt], "chosen": [chosen], "rejected": [longer]}, chat_tokenizer,
                                 len(pairs["chosen_input_ids"][0]), "all")
    assert cut["drop_reason"] == [""] and cut["truncated_prompt"] == [True]
    shared = [[i for i, label in zip(cut[f"{name}_input_ids"][0], cut[f"{name}_labels"][0]) if label == IGNORE]
              for name in ("chosen", "rejected")]
    assert shared[0] == shared[1] and "Hello." not in chat_tokenizer.decode(shared[0])


# ---------------------------------------------------------------- refusals and bad data

@pytest.mark.parametrize("overrides, message", [
    (dict(objective="sft", beta=0.2), "beta: only objectives dpo and grpo read it; remove it"),
    (dict(loss_type="ipo", label_smoothing=0.1), "label_smoothing: ipo defines no label smoothing; set 0"),
    (dict(simpo_gamma=1.0), "simpo_gamma: only loss_type simpo reads it; remove it"),
    (dict(objective="sft", sft_weight=1.0), "sft_weight: only objective dpo reads it; remove it or set objective: dpo"),
    (dict(sft_weight=-1.0), "sft_weight: must be >= 0 (0: off)"),
    (dict(lora=True, reference="frozen_copy"),
     "reference: with LoRA the reference is the base model with the adapter disabled; leave reference unset"),
    (dict(loss_type="simpo", reference="precomputed"), "reference: simpo is reference-free; leave reference unset"),
    (dict(packing=True), "packing: dpo scores each answer as a sequence of its own; set false"),
    (dict(z_loss=1e-4), "z_loss: dpo has no next-token loss to add it to; set 0"),
    (dict(beta=0.0), "beta: must be > 0"),
    (dict(label_smoothing=0.5), "label_smoothing: must be in [0, 0.5)"),
    (dict(loss_type="orpo"), "loss_type: must be for dpo 'sigmoid', 'ipo' or 'simpo'; for grpo"),
    (dict(loss_type="dapo"), "loss_type: objective dpo takes 'sigmoid', 'ipo' or 'simpo', got 'dapo'"),
])
def test_settings_without_effect_or_out_of_range_are_one_line(overrides, message, tmp_path):
    with pytest.raises(UserError) as refused:
        dpo_config("model", "data", tmp_path, **overrides)
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize("line, message", [
    ({"prompt": "Q?", "chosen": "A."}, "no 'rejected' field (fields: prompt, chosen); run clean.py on the raw "
                                       "preference data first"),
    ({"prompt": "Q?", "chosen": 4, "rejected": "A."}, "field 'chosen' is int, not text or a list of messages"),
    ({"prompt": "Q?", "chosen": [{"role": "assistant", "content": "A."}], "rejected": "B."},
     "prompt, chosen and rejected must all be text or all be lists of messages (prompt str, chosen list, "
     "rejected str)"),
])
def test_bad_preference_data_is_one_line_naming_file_and_line(line, message, tmp_path):
    path = write_jsonl(tmp_path / "bad_clean.jsonl", [*pair_rows(PAIRS[:2]), line])
    with pytest.raises(UserError) as refused:
        load_preference_records(str(tmp_path))
    assert str(refused.value) == f"{path}:3: {message}"


def test_text_and_message_pairs_mix_as_messages(tmp_path):
    messages = {"prompt": [{"role": "user", "content": "Q?"}], "chosen": [{"role": "assistant", "content": "A."}],
                "rejected": [{"role": "assistant", "content": "B."}]}
    write_jsonl(tmp_path / "mixed_clean.jsonl", [*pair_rows(PAIRS[:1]), messages])
    records = load_preference_records(str(tmp_path))
    assert records[0]["prompt"] == [{"role": "user", "content": PAIRS[0][0]}]
    assert records[0]["rejected"] == [{"role": "assistant", "content": PAIRS[0][2]}]
    assert records["index"] == [0, 1]
