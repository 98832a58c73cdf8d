"""Pretraining from scratch: rows cut from raw text, their seeded order in both loaders, exact resume of the stream,
the model built from a config, z-loss and last-position loss, and `plan`/`check` on a causal_lm config."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from support.files import write_jsonl
from support.launch import TORCHRUN, launch_env
from support.paths import REPO
from gpt4all_training.config.loader import load_config
from gpt4all_training.errors import UserError
from gpt4all_training.model.from_config import build_model_from_config, resolve_model_config
from gpt4all_training.data.batching import collate_rows
from gpt4all_training.data.sampling import row_sampler
from gpt4all_training.data.text import MaterializedRows, PretrainStats, buffer_shuffle, load_pretrain_data
from gpt4all_training.training.loss import CausalLMLoss
from gpt4all_training.data.bpe import train_bpe_tokenizer
from gpt4all_training.tracking.tracker import read_metrics

CONFIG = REPO / "configs" / "train" / "pretrain_tiny.yaml"
# Measured on the tiny GPT-J after the config's 60 steps (fp32, CPU): train loss 0.695, val loss 0.672.
FINAL_LOSS_BELOW = 0.75


def grammar_texts(n: int, seed: int = 0) -> list[str]:
    """Sentences of a six-by-six grammar: 'the cow sat on the box.' Learnable, but not memorisable as one string."""
    rng = random.Random(seed)
    animals, places = "cat dog cow hen fox owl".split(), "mat log hut den box bed".split()
    return [" ".join(f"the {rng.choice(animals)} sat on the {rng.choice(places)}." for _ in range(rng.randint(1, 4)))
            for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """text.jsonl (300 records) and a tokenizer trained on it (vocab_size 300; it finds 292 tokens), in one folder."""
    folder = tmp_path_factory.mktemp("pretrain")
    texts = grammar_texts(300)
    write_jsonl(folder / "text.jsonl", [{"text": t} for t in texts])
    train_bpe_tokenizer(texts, vocab_size=300).save_pretrained(folder / "tok")
    return folder


def config_for(corpus: Path, output: Path, *overrides: str):
    """The shipped configs/train/pretrain_tiny.yaml, pointed at the corpus."""
    return load_config(CONFIG, [f"dataset_path={corpus / 'text.jsonl'}", "text_field=text",
                                f"tokenizer_name={corpus / 'tok'}", f"output_dir={output}", *overrides])


@pytest.fixture(scope="module")
def text_tokenizer(corpus):
    from gpt4all_training.model.loading import load_tokenizer

    return load_tokenizer(str(corpus / "tok"))


@pytest.fixture(scope="module")
def from_scratch_run(corpus, tmp_path_factory):
    from gpt4all_training.training.loop import train

    output = tmp_path_factory.mktemp("run")
    config = config_for(corpus, output, "save_every=null")
    return config, train(config), output


@pytest.mark.integration
@pytest.mark.slow
def test_tiny_model_from_scratch_reaches_a_fixed_loss(from_scratch_run, text_tokenizer):
    from transformers import AutoModelForCausalLM

    config, summary, output = from_scratch_run
    rows = [r for r in read_metrics(output / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 60 and rows[0]["loss"] > 5.0  # untrained: about ln(300) = 5.70
    assert rows[-1]["loss"] < FINAL_LOSS_BELOW and summary["val_loss"] < FINAL_LOSS_BELOW
    assert all("train/last_loss" in r and r["train/z_loss"] > 0 for r in rows)
    assert rows[-1]["padding_fraction"] == 0.0 and rows[-1]["trained_tokens"] == 60 * 8 * 31
    model = AutoModelForCausalLM.from_pretrained(output / "final")
    # The tokenizer found 291 merges in this small corpus: 292 tokens, and the model's vocabulary follows it.
    assert (model.config.n_layer, model.config.n_embd, model.config.vocab_size) == (2, 64, len(text_tokenizer)) == (2, 64, 292)
    assert model.config.eos_token_id == text_tokenizer.eos_token_id


@pytest.mark.integration
@pytest.mark.slow
def test_plan_matches_the_pretraining_run(from_scratch_run):
    from gpt4all_training.preflight.plan import make_plan

    config, summary, output = from_scratch_run
    plan = make_plan(config)
    assert (plan.total_steps, plan.run.trained, plan.train_examples) == \
        (summary["steps"], summary["trained_tokens"], summary["train_examples"])
    assert plan.padding_fraction == 0.0 and plan.examples_per_step == 8
    assert plan.steps_per_epoch == summary["train_examples"] // 8


def test_streaming_and_in_memory_loaders_yield_the_same_rows(corpus, text_tokenizer):
    """Same seed: identical rows for every global id, over three passes; validation rows identical too."""
    loaded = {}
    for streaming in (False, True):
        config = config_for(corpus, corpus / "unused", f"streaming={str(streaming).lower()}", "shuffle_buffer=16",
                            "batch_size=4", "gradient_accumulation_steps=2")
        (store, val), (stats, _) = load_pretrain_data(config, text_tokenizer, log=lambda line: None, world_size=1)
        row_sampler(store, 4, 1, 0, 2, config.seed, config.max_steps)
        loaded[streaming] = store, val, stats
    memory, val_memory, stats = loaded[False]
    stream, val_stream, _ = loaded[True]
    ids = list(range(3 * stats.steps * 8))  # three passes
    assert np.array_equal(memory.rows(ids), np.asarray(stream.rows(ids)))
    assert stream.stats.rows == stats.rows and stream.stats.tail_tokens == stats.tail_tokens
    assert val_memory["input_ids"] == val_stream["input_ids"] and len(val_memory) > 0
    used = stats.steps * 8
    first, second = memory.rows(list(range(used))), memory.rows(list(range(used, 2 * used)))
    assert not np.array_equal(first, second)  # each pass is shuffled anew
    # ... as a permutation of all the rows; each pass drops the rows its order puts in the last partial step
    assert sorted(memory.epoch_order(0)) == sorted(memory.epoch_order(1)) == list(range(stats.rows))


def test_rows_joined_with_eos_and_dropped_tail_counted(tmp_path):
    """No merges, so one token per byte. Records 'abc', 'de', '', 'fghij' at max_length 4 and batch 2:
    a b c E | d e E f | g h i j | E  -> 3 rows, a tail of 1 token; 1 step of 2 rows, 1 row dropped per pass."""
    write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in ("abc", "de", "", "fghij")])
    tokenizer = train_bpe_tokenizer(["x"], vocab_size=257)
    config = load_config(None, [f"dataset_path={tmp_path / 't.jsonl'}", "objective=causal_lm", "model_name=m",
                                "max_length=4", "val_fraction=0", "batch_size=2", "shuffle_buffer=1",
                                f"output_dir={tmp_path}"])
    (store, val), (stats, _) = load_pretrain_data(config, tokenizer, log=lambda line: None, world_size=1)
    row_sampler(store, 2, 1, 0, 1, 0)
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "abcdefghij"}
    eos = tokenizer.eos_token_id
    assert store.rows([0, 1]).tolist() == [[ids["a"], ids["b"], ids["c"], eos], [ids["d"], ids["e"], eos, ids["f"]]]
    assert (stats.records, stats.empty, stats.tokens, stats.rows, stats.tail_tokens) == (4, 1, 13, 3, 1)
    assert (stats.steps, stats.dropped_rows, len(val)) == (1, 1, 0)
    batch = collate_rows(store.rows([0]))
    assert batch["labels"].tolist() == [[-100, ids["b"], ids["c"], eos]]  # every next token is trained


def test_buffer_shuffle_is_a_seeded_permutation():
    assert list(buffer_shuffle(range(10), 1, random.Random(0))) == list(range(10))  # size 1: stream order
    whole = list(range(10))
    random.Random(3).shuffle(whole)
    assert list(buffer_shuffle(range(10), 10, random.Random(3))) == whole  # a buffer as big as the data: a shuffle
    order = list(buffer_shuffle(range(100), 7, random.Random(5)))
    assert sorted(order) == list(range(100)) and order == list(buffer_shuffle(range(100), 7, random.Random(5)))
    assert order != list(buffer_shuffle(range(100), 7, random.Random(6)))


def test_a_global_step_holds_the_same_rows_on_one_or_two_ranks():
    store = MaterializedRows(np.arange(32 * 4, dtype=np.int32), 4, 0, 1, PretrainStats(), log=lambda line: None)
    one = row_sampler(store, 4, 1, 0, 2, 0)
    ranks = [row_sampler(store, 2, 2, r, 2, 0) for r in (0, 1)]
    for step in range(3):
        for j in range(2):
            assert one.step_indices(step)[j] == ranks[0].step_indices(step)[j] + ranks[1].step_indices(step)[j]


@pytest.mark.integration
@pytest.mark.slow
def test_streaming_resume_is_exact(corpus, tmp_path):
    """8 steps straight through, against 4 steps, a checkpoint, and a resume from the stream position it saved."""
    from safetensors.torch import load_file

    from gpt4all_training.training.loop import train

    settings = ["streaming=true", "max_steps=8", "warmup_steps=2", "anneal_steps=5", "save_every=4", "keep_last=null",
                "eval_every=null", "val_fraction=0"]
    straight = config_for(corpus, tmp_path / "straight", *settings)
    train(straight)
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "straight" / "step_4", resumed_dir / "step_4")
    assert torch.load(resumed_dir / "step_4" / "data_state.pt", weights_only=True)["next_id"] == 4 * 8
    summary = train(config_for(corpus, resumed_dir, *settings, "resume=auto"))
    assert summary["steps"] == 8
    a = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    b = load_file(str(resumed_dir / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [[r["loss"] for r in read_metrics(d / "metrics.jsonl") if "loss" in r and r["step"] > 4]
              for d in (tmp_path / "straight", resumed_dir)]
    assert losses[0] == losses[1] and len(losses[0]) == 4


def test_stream_resumes_from_its_saved_position_without_reading_what_came_before(corpus, text_tokenizer, tmp_path):
    """The state after 5 steps, restored into a fresh loader, gives the uninterrupted stream's next rows, over the
    end of a pass, even when every record read before the saved position has been overwritten with junk: a resume
    reads on from the next record (skipped lines are not parsed) instead of tokenising the stream again."""
    data = tmp_path / "text.jsonl"
    shutil.copy(corpus / "text.jsonl", data)
    overrides = [f"dataset_path={data}", "streaming=true", "shuffle_buffer=16", "batch_size=4",
                 "gradient_accumulation_steps=2", "max_steps=100", "val_fraction=0"]

    def fresh_store():
        (store, _), _ = load_pretrain_data(config_for(corpus, tmp_path / "unused", *overrides), text_tokenizer,
                                           log=lambda line: None, world_size=1)
        return row_sampler(store, 4, 1, 0, 2, 0, 100)

    straight = fresh_store()
    for step in range(5):
        for ids in straight.step_indices(step):
            straight.store.rows(ids)
    state = straight.data_state()
    torch.save(state, tmp_path / "data_state.pt")
    expected = straight.store.rows(list(range(5 * 8, 60 * 8)))  # on into the next passes
    records_read = state["pass"]["records"]
    assert 0 < records_read < 300 and state["next_id"] == 5 * 8
    lines = data.read_text().splitlines()
    data.write_text("".join(["not json\n"] * records_read) + "\n".join(lines[records_read:]) + "\n")
    resumed = fresh_store()
    resumed.load_data_state(torch.load(tmp_path / "data_state.pt", weights_only=True))
    assert resumed.store.rows(list(range(5 * 8, 5 * 8 + 8))) == expected[:8]
    data.write_text("\n".join(lines) + "\n")  # the next pass reads the file from the start again
    assert resumed.store.rows(list(range(5 * 8 + 8, 60 * 8))) == expected[8:]


def test_stream_replays_to_any_position(corpus, text_tokenizer):
    config = config_for(corpus, corpus / "unused", "streaming=true", "shuffle_buffer=16")
    rows = []
    for _ in range(2):
        (store, _), _ = load_pretrain_data(config, text_tokenizer, log=lambda line: None, world_size=1)
        row_sampler(store, 8, 1, 0, 1, 0, 60)
        rows.append(store)
    sequential = rows[0].rows(list(range(0, 48)))
    assert rows[1].rows(list(range(40, 48))) == sequential[40:]  # a fresh stream, asked for row 40 first


def test_causal_lm_loss_with_z_loss_and_last_position(corpus, text_tokenizer):
    from accelerate import Accelerator

    from gpt4all_training.training.loss import token_loss_sum

    torch.manual_seed(0)
    config = config_for(corpus, corpus / "unused")
    model = build_model_from_config(config, text_tokenizer)
    rows = [text_tokenizer.encode(t)[:12] for t in grammar_texts(3, seed=1)]
    batch = collate_rows([r + [text_tokenizer.eos_token_id] * (12 - len(r)) for r in rows])
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    lse = torch.logsumexp(logits[keep], -1)
    nll = lse - logits[keep].gather(1, targets[keep][:, None]).squeeze(1)
    plain = CausalLMLoss(0.0)
    assert plain(model, batch).item() == pytest.approx(token_loss_sum(model, batch).item(), rel=1e-5)
    assert plain(model, batch).item() == pytest.approx(nll.sum().item(), rel=1e-5)
    with_z = CausalLMLoss(1e-2)
    assert with_z(model, batch).item() == pytest.approx((nll.sum() + 1e-2 * (lse ** 2).sum()).item(), rel=1e-5)
    metrics = with_z.window_metrics(Accelerator(cpu=True))
    last = torch.nn.functional.cross_entropy(logits[:, -1], targets[:, -1]).item()
    assert metrics["train/last_loss"] == pytest.approx(last, rel=1e-5)
    assert metrics["train/z_loss"] == pytest.approx(1e-2 * (lse ** 2).mean().item(), rel=1e-5)


def test_model_config_sources_overrides_and_vocabulary(corpus, text_tokenizer, tiny_model_dir):
    base = config_for(corpus, corpus / "unused", "model_config_overrides={n_layer: 3, n_embd: 32, n_head: 2, "
                                                 "rotary_dim: 8}")
    built = resolve_model_config(base, text_tokenizer)
    assert (built.n_layer, built.n_embd, built.vocab_size, built.eos_token_id) == (3, 32, 292, text_tokenizer.eos_token_id)
    from_folder = resolve_model_config(config_for(corpus, corpus / "unused", f"model_config={tiny_model_dir}",
                                                  "model_config_overrides=null"), text_tokenizer)
    assert (from_folder.n_layer, from_folder.vocab_size) == (2, 292)  # the folder's 1000 follows the tokenizer
    with pytest.raises(UserError, match="^model_config_overrides: 'n_layers' is not a field of GPTJConfig$"):
        resolve_model_config(config_for(corpus, corpus / "unused", "model_config_overrides={n_layers: 3}"), text_tokenizer)
    with pytest.raises(UserError, match="^model_config nobody/no-such-model: cannot read it"):
        resolve_model_config(config_for(corpus, corpus / "unused", "model_config=nobody/no-such-model"), text_tokenizer)


@pytest.mark.parametrize("overrides, message", [
    (["streaming=true", "max_steps=null"], "max_steps: streaming causal_lm needs max_steps"),
    (["objective=sft"], "init: from_config needs objective: causal_lm"),
    (["packing=true"], "packing: causal_lm rows are already max_length long; set false"),
    (["lora=true"], "init: from_config trains every weight; set lora: false"),
    (["model_config_overrides=3"], "model_config_overrides: expected a mapping of name: value, got 3"),
    (["objective=mlm"], "objective: must be 'sft', 'causal_lm', 'dpo' or 'grpo', got 'mlm'"),
])
def test_pretraining_config_errors_name_the_key(corpus, overrides, message):
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(")):
        config_for(corpus, corpus / "unused", *overrides)


@pytest.mark.integration
def test_check_passes_on_the_pretraining_config(corpus, tmp_path):
    from gpt4all_training.preflight.check import run_checks

    lines = []
    outcomes = run_checks(str(CONFIG), [f"dataset_path={corpus / 'text.jsonl'}", "text_field=text",
                                        f"tokenizer_name={corpus / 'tok'}", f"output_dir={tmp_path / 'out'}"],
                          report=lines.append)
    assert all(o.ok for o in outcomes), lines
    assert [o.name for o in outcomes] == ["config", "dataset", "model_config", "tokenizer", "memory", "output_dir",
                                          "dry run"]
    assert lines[2] == "ok    model_config: gptj with 2 layers, width 64: 136,996 parameters, vocabulary 292 (the " \
                       "tokenizer's)"
    assert lines[-1].startswith("ok    dry run: 2 steps on ") and " rows passed (loss " in lines[-1]


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_train_the_same_steps_as_one(corpus, tmp_path):
    """A stream on 2 ranks (batch 4 each) against 1 process (batch 8): each global step holds the same rows, so the
    losses agree up to the order gradients are summed in (measured: 4.9e-7 at most)."""
    from gpt4all_training.training.loop import train

    settings = [f"dataset_path={corpus / 'text.jsonl'}", "text_field=text", f"tokenizer_name={corpus / 'tok'}",
                "streaming=true", "max_steps=6", "save_every=null", "eval_every=null", "val_fraction=0"]
    train(load_config(CONFIG, [*settings, "batch_size=8", f"output_dir={tmp_path / 'one'}"]))
    result = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", "train.py", "--config", str(CONFIG),
                             *settings, "batch_size=4", f"output_dir={tmp_path / 'two'}"], cwd=REPO,
                            env=launch_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    one, two = ([r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in r]
                for name in ("one", "two"))
    assert len(one) == len(two) == 6
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5
