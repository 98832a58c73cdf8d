"""Packing and length grouping: layout, isolation of packed examples, and parity with unpacked training."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from support.models import build_tiny_gptj
from gpt4all_training.batch import IGNORE, model_inputs
from gpt4all_training.data.batching import balanced_bins, collate, collate_packed, first_fit_decreasing, pack_rows
from gpt4all_training.data.records import load_records
from gpt4all_training.data.sft import tokenize_dataset
from gpt4all_training.errors import UserError
from gpt4all_training.model.attention import attend_per_example, attends_per_example
from gpt4all_training.model.isolation import check_isolation
from gpt4all_training.training.loss import token_loss_sum
from gpt4all_training.data.sampling import StepSampler


# ---------------------------------------------------------------- fixtures

def build_tiny_llama(vocab_size: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=512, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def dolly_rows(clean_dolly, tokenizer) -> list[dict]:
    """Twelve real tokenised Dolly examples (max_length 96) of varied length."""
    records = load_records(str(clean_dolly)).select(range(12))
    tokenized = tokenize_dataset(records, tokenizer, 96, "plain", None)
    return [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in tokenized]


@pytest.fixture(params=["gptj-sdpa", "gptj-eager", "llama-sdpa"])
def tiny_model(request, tokenizer):
    family, implementation = request.param.split("-")
    model = build_tiny_gptj(tokenizer) if family == "gptj" else build_tiny_llama(len(tokenizer))
    model.set_attn_implementation(implementation)
    return model.eval()


def example_mean_losses_packed(model, batch) -> list[float]:
    """Mean NLL of each packed example, computed inside its packed row (other examples' labels masked)."""
    losses = []
    for row in range(batch["input_ids"].size(0)):
        for number in range(1, int(batch["sequence_ids"][row].max()) + 1):
            keep = torch.zeros_like(batch["labels"], dtype=torch.bool)
            keep[row] = batch["sequence_ids"][row] == number
            labels = torch.where(keep, batch["labels"], IGNORE)
            count = int((labels[:, 1:] != IGNORE).sum())
            losses.append(float(token_loss_sum(model, {**batch, "labels": labels})) / count)
    return losses


def example_order(batch) -> list[tuple[int, int]]:
    return [(r, n) for r in range(batch["input_ids"].size(0)) for n in range(1, int(batch["sequence_ids"][r].max()) + 1)]


# ---------------------------------------------------------------- the bin packer (pure)

def test_first_fit_decreasing_by_hand():
    # Longest first, each into the first bin with room: 5+3 | 3+2+2+1 (indices into the input).
    assert first_fit_decreasing([5, 3, 3, 2, 2, 1], 8) == [[0, 1], [2, 3, 4, 5]]


def test_balanced_rows_pad_less_than_plain_first_fit():
    # First-fit decreasing gives rows of 8 and 4 tokens (width 8); the balanced deal gives 6 and 6 (width 6).
    assert first_fit_decreasing([6, 2, 2, 2], 8) == [[0, 1], [2, 3]]
    assert pack_rows([6, 2, 2, 2], 8) == [[0], [1, 2, 3]]
    assert balanced_bins([4, 3, 3, 2], 2, 8) == [[0, 3], [1, 2]]
    assert balanced_bins([5, 5, 5], 2, 8) is None  # the balanced deal would need a bin of 10


def test_an_example_longer_than_a_row_is_a_bug_not_a_split():
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([9], 8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=40), st.integers(64, 200))
def test_every_example_lands_in_exactly_one_row_that_fits(lengths, capacity):
    rows = pack_rows(lengths, capacity)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= capacity for row in rows)
    assert len(rows) == len(first_fit_decreasing(lengths, capacity))
    assert all(row == sorted(row) for row in rows)


# ---------------------------------------------------------------- the packed batch

def test_packed_layout_labels_positions_by_hand():
    rows = [{"input_ids": [10, 11, 12], "labels": [IGNORE, IGNORE, 12]},
            {"input_ids": [20, 21], "labels": [20, 21]},  # a first label that is not IGNORE is masked anyway
            {"input_ids": [30, 31, 32, 33], "labels": [IGNORE, 31, 32, 33]}]
    batch = collate_packed(rows, pad_id=0, max_length=6)
    assert batch["input_ids"].tolist() == [[30, 31, 32, 33, 0], [10, 11, 12, 20, 21]]
    assert batch["labels"].tolist() == [[IGNORE, 31, 32, 33, IGNORE], [IGNORE, IGNORE, 12, IGNORE, 21]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert batch["sequence_ids"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 2, 2]]
    assert "attention_mask" not in model_inputs(batch)  # a 2-D mask would switch the block-diagonal mask off


def test_positions_restart_and_labels_match_unpacked(dolly_rows):
    batch = collate_packed(dolly_rows, pad_id=0, max_length=256)
    assert batch["input_ids"].size(0) < len(dolly_rows)
    seen = []
    for r in range(batch["input_ids"].size(0)):
        for n in range(1, int(batch["sequence_ids"][r].max()) + 1):
            where = (batch["sequence_ids"][r] == n).nonzero().flatten()
            assert batch["position_ids"][r, where].tolist() == list(range(len(where)))
            seen.append((batch["input_ids"][r, where].tolist(), batch["labels"][r, where].tolist()))
        padding = (batch["sequence_ids"][r] == 0).nonzero().flatten()
        assert batch["position_ids"][r, padding].tolist() == list(range(len(padding)))
        assert (batch["labels"][r, padding] == IGNORE).all()
    assert sorted(seen) == sorted((row["input_ids"], row["labels"]) for row in dolly_rows)


# ---------------------------------------------------------------- isolation in the model

def test_each_example_loss_inside_a_packed_row_equals_its_loss_alone(tiny_model, dolly_rows):
    batch = collate_packed(dolly_rows, pad_id=0, max_length=256)
    with torch.no_grad():
        packed = example_mean_losses_packed(tiny_model, batch)
        by_content = {}
        for row in dolly_rows:
            alone = collate([row], pad_id=0)
            by_content[tuple(row["input_ids"])] = float(token_loss_sum(tiny_model, alone)) / \
                int((alone["labels"][:, 1:] != IGNORE).sum())
    order = example_order(batch)
    assert len(order) == len(dolly_rows)
    for (r, n), loss in zip(order, packed):
        ids = tuple(batch["input_ids"][r][batch["sequence_ids"][r] == n].tolist())
        assert loss == pytest.approx(by_content[ids], abs=1e-5)


def test_attention_probabilities_never_cross_example_boundaries(tokenizer, dolly_rows):
    model = build_tiny_gptj(tokenizer).eval()
    model.set_attn_implementation("eager")
    batch = collate_packed(dolly_rows[:6], pad_id=0, max_length=256)
    with torch.no_grad():
        out = model(**model_inputs(batch), output_attentions=True)
    seq = batch["sequence_ids"]
    same = seq[:, :, None] == seq[:, None, :]  # (rows, query, key)
    causal = torch.ones(seq.size(1), seq.size(1), dtype=torch.bool).tril()
    allowed = (same & causal)[:, None]  # broadcast over heads
    real_queries = (seq > 0)[:, None, :, None]
    assert (seq.max(dim=1).values >= 2).any()  # some row really holds several examples
    for probabilities in out.attentions:
        assert probabilities.shape[-1] == seq.size(1)
        assert (probabilities.masked_select(~allowed & real_queries) == 0).all()
        assert torch.allclose(probabilities.sum(-1), torch.ones(()), atol=1e-6)


def test_isolation_check_passes_real_models_and_refuses_naive_concatenation(tokenizer):
    from transformers import GPTJForCausalLM

    assert check_isolation(build_tiny_gptj(tokenizer)) < 1e-5
    assert check_isolation(build_tiny_llama(len(tokenizer))) < 1e-5

    class IgnoresPositions(GPTJForCausalLM):
        """A model that, like naive packing, attends over the whole row."""

        def forward(self, input_ids=None, position_ids=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)

    naive = IgnoresPositions(build_tiny_gptj(tokenizer).config)
    with pytest.raises(UserError, match="packing: IgnoresPositions .* attend to each other"):
        check_isolation(naive)


# ---------------------------------------------------------------- one row, attended example by example

def test_one_row_holds_every_example_back_to_back_with_their_starts(dolly_rows):
    rows = dolly_rows[:5]
    lengths = [len(r["input_ids"]) for r in rows]
    batch = collate_packed(rows, pad_id=0, max_length=None)
    assert batch["input_ids"].shape == (1, sum(lengths))
    assert batch["cu_seq_lens_q"].tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["input_ids"][0].tolist() == [t for r in rows for t in r["input_ids"]]
    assert batch["sequence_ids"][0].tolist() == [n for n, k in enumerate(lengths, start=1) for _ in range(k)]
    assert batch["position_ids"][0].tolist() == [p for k in lengths for p in range(k)]
    starts = batch["cu_seq_lens_q"][:-1].tolist()
    assert (batch["labels"][0, starts] == IGNORE).all()


def test_per_example_attention_gives_each_example_its_own_logits(tiny_model, dolly_rows):
    """Inside one row, with the example starts, every example's logits equal the example run alone; a batch without
    the starts (padded, or positions only) takes SDPA with its mask, as before."""
    rows = dolly_rows[:4]
    batch = collate_packed(rows, pad_id=0, max_length=None)
    masked = tiny_model(**model_inputs({k: v for k, v in batch.items() if k != "cu_seq_lens_q"})).logits
    padded = collate(rows, 0)
    before = tiny_model(**model_inputs(padded)).logits
    on_sdpa = tiny_model.config._attn_implementation == "sdpa"
    attend_per_example(tiny_model)
    assert attends_per_example(tiny_model) == on_sdpa  # eager attention is kept, and keeps the examples apart too
    inside = tiny_model(**model_inputs(batch)).logits
    bounds = batch["cu_seq_lens_q"].tolist()
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        alone = tiny_model(input_ids=torch.tensor([rows[i]["input_ids"]]), use_cache=False).logits
        assert (inside[0, start:end] - alone[0]).abs().max() <= 1e-5
    assert (tiny_model(**model_inputs(padded)).logits - before).abs().max() <= 1e-6
    assert (inside - masked).abs().max() <= 1e-5


def test_a_sliding_window_shorter_than_an_example_takes_the_mask(dolly_rows):
    """Mistral-style sliding-window layers: where the window cuts into an example, attending to the example's whole
    causal past would be wrong, so the masked path runs and gives the model's own logits."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=8)).eval()
    rows = [{"input_ids": [t % 512 for t in r["input_ids"]], "labels": r["labels"]} for r in dolly_rows[:3]]
    batch = collate_packed(rows, pad_id=0, max_length=None)
    masked = model(**model_inputs({k: v for k, v in batch.items() if k != "cu_seq_lens_q"})).logits
    attend_per_example(model)
    inside = model(**model_inputs(batch)).logits
    assert (inside - masked).abs().max() <= 1e-5
    first = len(rows[0]["input_ids"])
    alone = model(input_ids=torch.tensor([rows[0]["input_ids"]]), use_cache=False).logits
    assert (inside[0, :first] - alone[0]).abs().max() <= 1e-5


# ---------------------------------------------------------------- one optimiser step, packed or not

def one_step(tokenizer, micro_batches, max_grad_norm=1.0, per_example=False) -> dict[str, torch.Tensor]:
    from accelerate import Accelerator

    from gpt4all_training.backends.accelerate import backend_for
    from gpt4all_training.training.step import train_step

    model = build_tiny_gptj(tokenizer, seed=3)
    if per_example:
        attend_per_example(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    result = train_step(model, micro_batches, backend_for(Accelerator(cpu=True)), optimizer, scheduler, max_grad_norm, 0)
    return {"result": result, **{k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("one_row", [False, True], ids=["rows-masked", "one-row-per-example"])
def test_one_optimizer_step_with_packing_equals_one_without(tokenizer, dolly_rows, one_row):
    micro = [dolly_rows[:6], dolly_rows[6:]]  # two micro-batches: gradient accumulation too
    padded = one_step(tokenizer, [collate(rows, 0) for rows in micro])
    packed = one_step(tokenizer, [collate_packed(rows, 0, None if one_row else 256) for rows in micro],
                      per_example=one_row)
    if one_row:
        assert packed["result"]["n_padded"] == packed["result"]["n_real"]  # nothing padded
    assert packed["result"]["n_trained"] == padded["result"]["n_trained"]
    assert packed["result"]["n_real"] == padded["result"]["n_real"] == sum(len(r["input_ids"]) for r in dolly_rows)
    assert packed["result"]["n_padded"] < padded["result"]["n_padded"]
    assert packed["result"]["loss"] == pytest.approx(padded["result"]["loss"], abs=1e-5)
    for name, weight in padded.items():
        if name != "result":
            assert (packed[name] - weight).abs().max() <= 1e-5, name


@pytest.mark.integration
def test_packed_training_run_equals_unpacked_run(tiny_model_dir, clean_dolly, tmp_path):
    """packing: true and group_by_length: true train the same steps as the plain run (end to end, through train())."""
    from safetensors.torch import load_file

    from gpt4all_training.config.loader import load_config
    from gpt4all_training.training.loop import train

    def run(name: str, *extra: str):
        overrides = [f"model_name={tiny_model_dir}", f"dataset_path={clean_dolly}", "max_length=128",
                     "batch_size=4", "gradient_accumulation_steps=2", "max_steps=3", "lr=1e-3", "warmup_steps=0",
                     "eval_every=null", "save_every=null", "seed=7", "dtype=float32", f"output_dir={tmp_path / name}",
                     *extra]
        summary = train(load_config(None, overrides))
        weights = load_file(tmp_path / name / "final" / "model.safetensors")
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return summary, weights, [r for r in rows if "loss" in r]

    plain, plain_weights, plain_rows = run("plain")
    packed, packed_weights, packed_rows = run("packed", "packing=true")
    assert packed["trained_tokens"] == plain["trained_tokens"]
    assert packed["padding_fraction"] == 0  # on a CPU: each micro-batch one row, attended example by example
    assert packed["val_loss"] == pytest.approx(plain["val_loss"], abs=1e-5)
    for a, b in zip(plain_rows, packed_rows):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert b["trained_tokens_per_s"] > 0 and b["peak_rss_mb"] > 0 and 0 <= b["padding_fraction"] < 1
    for name, weight in plain_weights.items():
        assert (packed_weights[name] - weight).abs().max() <= 1e-5, name
    grouped, _, grouped_rows = run("grouped", "group_by_length=true")
    assert grouped["padding_fraction"] < plain["padding_fraction"]
    assert len(grouped_rows) == 3


# ---------------------------------------------------------------- length-grouped order

def test_group_by_length_yields_every_example_once_per_epoch_and_reshuffles():
    lengths = torch.randint(5, 500, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    sampler = StepSampler(96, batch_size=4, grad_accum=2, seed=1, lengths=lengths)
    epochs = []
    for epoch in range(3):
        steps = [sampler.step_indices(epoch * sampler.steps_per_epoch + s) for s in range(sampler.steps_per_epoch)]
        flat = [i for step in steps for micro in step for i in micro]
        assert sorted(flat) == list(range(96))
        epochs.append(flat)
    assert epochs[0] != epochs[1] != epochs[2]

    def mean_spread(s: StepSampler) -> float:
        spreads = []
        for step in range(s.steps_per_epoch):
            for micro in s.step_indices(step):
                spreads.append(max(lengths[i] for i in micro) - min(lengths[i] for i in micro))
        return sum(spreads) / len(spreads)

    assert mean_spread(sampler) < mean_spread(StepSampler(96, batch_size=4, grad_accum=2, seed=1)) / 4


def test_group_by_length_keeps_step_contents_across_world_sizes_and_drops_only_the_tail():
    lengths = [(i * 37) % 301 + 1 for i in range(70)]
    single = StepSampler(70, batch_size=4, grad_accum=2, seed=5, lengths=lengths)
    ranks = [StepSampler(70, batch_size=2, world_size=2, rank=r, grad_accum=2, seed=5, lengths=lengths)
             for r in range(2)]
    assert single.steps_per_epoch == 8  # 70 // 8; the last 6 of the epoch's permutation are dropped
    seen = Counter()
    for step in range(single.steps_per_epoch):
        together = sorted(i for micro in single.step_indices(step) for i in micro)
        split = sorted(i for s in ranks for micro in s.step_indices(step) for i in micro)
        assert together == split
        seen.update(together)
    assert len(seen) == 64 and set(seen.values()) == {1}


def test_plain_order_is_unchanged_without_lengths():
    sampler = StepSampler(50, batch_size=5, seed=3)
    expected = torch.randperm(50, generator=torch.Generator().manual_seed(3 * 1_000_003 + 2))
    assert torch.equal(sampler.epoch_order(2), expected)
