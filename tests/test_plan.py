"""`plan`: its steps, examples, trained tokens and padding are what train.py then does; its formulas by hand."""

from __future__ import annotations

import argparse
import math
import shutil
import time

import numpy as np
import pytest

from support.files import write_jsonl
from support.launch import free_port
from gpt4all_training.cli.plan import run
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import UserError
from gpt4all_training.preflight.plan import (GIB, ConfigOnlyPlan, ModelShape, activation_bytes, checkpoint_steps,
                                             make_plan, memory_per_gpu, most_kept, size)
from gpt4all_training.data.sampling import StepSampler
from gpt4all_training.training.counts import run_layout
from gpt4all_training.training.schedule import learning_rate
from gpt4all_training.tracking.tracker import read_metrics

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def varied_pairs(tmp_path_factory):
    """37 prompt/response pairs of varied lengths (so padding and packing differ), an odd count (so steps drop)."""
    rows = []
    for i in range(37):
        prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 5))
        response = " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(1 + (7 * i) % 11))
        rows.append({"prompt": f"Q{i}: {prompt}?", "response": response, "source": "t"})
    folder = tmp_path_factory.mktemp("varied")
    write_jsonl(folder / "varied_clean.jsonl", rows)
    return folder


def config_for(model_dir, data_dir, output_dir, **overrides) -> TrainConfig:
    values = dict(model_name=str(model_dir), dataset_path=str(data_dir), output_dir=str(output_dir), max_length=32,
                  batch_size=4, lr=1e-3, min_lr=1e-4, warmup_steps=1, val_fraction=0.1, num_epochs=1,
                  eval_every=None, eval_steps=1, save_every=None, num_proc=1, seed=3, report_to=["jsonl"],
                  dtype="float32")
    values.update(overrides)
    return validate(TrainConfig(**values))


SETTINGS = {
    "batch4": dict(batch_size=4),  # 33 train examples: 8 steps, 1 example dropped
    "accum-epochs-max_steps": dict(batch_size=2, gradient_accumulation_steps=2, num_epochs=3, max_steps=19,
                                   lr_schedule="gpt3", anneal_steps=10, end_lr=2e-4, warmup_steps=3),
    "packing-group-by-length": dict(batch_size=5, num_epochs=2, packing=True, group_by_length=True, save_every=4,
                                    keep_last=1),
}


@pytest.mark.integration
@pytest.mark.parametrize("name", SETTINGS)
def test_planned_steps_tokens_and_padding_are_what_training_does(name, tiny_model_dir, varied_pairs, tmp_path):
    from gpt4all_training.training.loop import train

    config = config_for(tiny_model_dir, varied_pairs, tmp_path / name, **SETTINGS[name])
    plan = make_plan(config)
    summary = train(config)
    rows = [row for row in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in row]
    assert plan.train_examples == summary["train_examples"] == 33
    assert plan.total_steps == summary["steps"] == len(rows)
    assert rows[-1]["epoch"] == pytest.approx(plan.total_steps / plan.steps_per_epoch)
    assert plan.run.trained == summary["trained_tokens"] == rows[-1]["trained_tokens"]
    # Packed on a CPU, a micro-batch is one row with nothing padded (plan's packed figure is the rows of a GPU).
    expected_padding = 0.0 if config.packing else plan.padding_fraction
    assert round(expected_padding, 4) == summary["padding_fraction"]
    assert [row["lr"] for row in rows] == pytest.approx([learning_rate(s, config, plan.total_steps)
                                                         for s in range(plan.total_steps)], rel=1e-9)
    saved = sorted(p.name for p in (tmp_path / name).glob("step_*"))
    assert plan.kept_at_most == len(saved)


def test_hand_computed_steps_for_each_setting(tiny_model_dir, varied_pairs, tmp_path):
    """33 training examples. batch 4: 33 // 4 = 8 steps. batch 2 x accumulation 2: 8 per epoch, 3 epochs = 24,
    capped at max_steps 19. batch 5, 2 epochs: 6 per epoch, 12."""
    expected = {"batch4": (8, 8, 1), "accum-epochs-max_steps": (8, 19, 1), "packing-group-by-length": (6, 12, 3)}
    for name, (per_epoch, total, dropped) in expected.items():
        plan = make_plan(config_for(tiny_model_dir, varied_pairs, tmp_path, **SETTINGS[name]))
        assert (plan.steps_per_epoch, plan.total_steps, plan.dropped_per_epoch) == (per_epoch, total, dropped)
        assert plan.suggested_warmup == (math.ceil(0.05 * total), math.ceil(0.1 * total))


def test_two_gpus_share_the_global_batch(tiny_model_dir, varied_pairs, tmp_path):
    """--gpus 2 with batch 2 x accumulation 2 is a global batch of 8: 33 // 8 = 4 steps per epoch, the same steps
    and trained tokens as one process with batch 4 x accumulation 2, and each rank's micro-batches are exactly
    what StepSampler.step_indices gives that rank."""
    two = make_plan(config_for(tiny_model_dir, varied_pairs, tmp_path, batch_size=2, gradient_accumulation_steps=2,
                               num_epochs=2), gpus=2)
    one = make_plan(config_for(tiny_model_dir, varied_pairs, tmp_path, batch_size=4, gradient_accumulation_steps=2,
                               num_epochs=2), gpus=1)
    assert (two.examples_per_step, two.steps_per_epoch, two.total_steps, two.dropped_per_epoch) == (8, 4, 8, 1)
    assert (one.total_steps, one.run.trained, one.run.tokens, one.run.examples) == \
        (two.total_steps, two.run.trained, two.run.tokens, two.run.examples) == (8, one.run.trained, one.run.tokens,
                                                                                  64)
    assert two.run.padded <= one.run.padded  # smaller micro-batches pad to a nearer longest example
    layout = run_layout(StepSampler(33, 2, 2, 0, 2, 3), 8)
    for rank in (0, 1):
        sampler = StepSampler(33, 2, 2, rank, 2, 3)
        for step in range(8):
            assert layout[step, :, rank].tolist() == sampler.step_indices(step)


def test_memory_formulas_by_hand():
    shape = ModelShape(parameters=1000, lora_trainable=10, layers=2, hidden=8, heads=2, vocab=50)
    full = memory_per_gpu(shape, 1, 4, "float32", 4, False)
    assert (full["full (DDP)"].weights, full["full (DDP)"].gradients, full["full (DDP)"].optimizer) == (4000, 4000, 8000)
    assert (full["LoRA"].weights, full["LoRA"].gradients, full["LoRA"].optimizer) == (4000, 40, 80)
    assert (full["ZeRO-2"].weights, full["ZeRO-2"].gradients, full["ZeRO-2"].optimizer) == (4000, 1000, 2000)
    assert (full["ZeRO-3"].weights, full["ZeRO-3"].gradients, full["ZeRO-3"].optimizer) == (1000, 1000, 2000)
    mixed = memory_per_gpu(shape, 1, 4, "bfloat16", 4, False)
    assert (mixed["ZeRO-2"].weights, mixed["ZeRO-2"].gradients, mixed["ZeRO-2"].optimizer) == (2000, 500, 3000)
    assert (mixed["ZeRO-3"].weights, mixed["ZeRO-3"].gradients, mixed["ZeRO-3"].optimizer) == (500, 500, 3000)
    # FSDP2 shards fp32 master weights, their gradients and Adam's moments, whatever the autocast dtype.
    for estimates in (full, mixed):
        fsdp2 = estimates["FSDP2"]
        assert (fsdp2.weights, fsdp2.gradients, fsdp2.optimizer, fsdp2.total) == (1000, 1000, 2000,
                                                                                  estimates["ZeRO-3"].total)
    assert list(full) == ["full (DDP)", "LoRA", "ZeRO-2", "ZeRO-3", "FSDP2"]
    # A frozen copy adds 4P where a process holds a whole model, and ZeRO-3 (refusing it) is not offered.
    referenced = memory_per_gpu(shape, 1, 4, "float32", 4, False, reference_copies=1)
    assert [(name, m.reference) for name, m in referenced.items()] == [("full (DDP)", 4000), ("LoRA", 0),
                                                                       ("ZeRO-2", 4000)]
    # s=4, b=1, h=8, a=2: one layer 4*1*8*(34 + 5*2*4/8) = 32*39 = 1248 values-units; fp32 doubles it (B/2 = 2).
    # Head: 2 * 4 bytes * min(s*b*vocab = 200, chunk) = 1600.
    assert activation_bytes(shape, 1, 4, "float32", False) == 2 * 1248 * 2 + 1600
    assert activation_bytes(shape, 1, 4, "bfloat16", False) == 2 * 1248 + 1600
    # Checkpointing: each layer keeps its input (s*b*h*B = 128 bytes) plus one layer's full activations.
    assert activation_bytes(shape, 1, 4, "float32", True) == 2 * 128 + 1248 * 2 + 1600


def test_checkpoint_counts_follow_rotation():
    assert checkpoint_steps(10, 2) == [2, 4, 6, 8]  # never the last step: final/ is written then
    assert checkpoint_steps(9, 3) == [3, 6]
    assert checkpoint_steps(10, None) == []
    assert most_kept([2, 4, 6, 8], 2, None) == 2
    assert most_kept([2, 4, 6, 8], None, None) == 4
    assert most_kept([2, 4, 6, 8, 10, 12], 1, 4) == 3  # 4 and 8 stay forever, plus the newest (12)


def test_command_prints_plan_and_time(tiny_model_dir, varied_pairs, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(f"model_name: {tiny_model_dir}\ndataset_path: {varied_pairs}\noutput_dir: {tmp_path / 'o'}\n"
                      f"max_length: 32\nbatch_size: 2\ngradient_accumulation_steps: 2\nval_fraction: 0.1\n"
                      f"seed: 3\nnum_proc: 1\nwarmup_steps: 0\nlora: true\nsave_every: 2\nkeep_last: 1\n")
    assert run(argparse.Namespace(config=str(config), gpus=2, tokens_per_second=1000.0, gpu_memory=None,
                                  config_only=False, overrides=[])) == 0
    out = capsys.readouterr().out
    plan = make_plan(config_for(tiny_model_dir, varied_pairs, tmp_path / "o", batch_size=2,
                                gradient_accumulation_steps=2, warmup_steps=0, lora=True, save_every=2,
                                keep_last=1), gpus=2, tokens_per_second=1000.0)
    assert "micro-batch 2 x 2 GPU(s) x accumulation 2 = global batch 8 examples" in out
    assert "4 optimiser steps per epoch (1 examples dropped per epoch: the last partial step); 4 optimiser steps" in out
    assert f"{plan.seconds / 3600:.2f} h for {plan.run.tokens:,} tokens at 1,000 tokens/s (given)" in out
    assert "1 written, at most 1 kept at once" in out  # saves at step 2 only (4 is the last step)
    assert "LoRA trains " in out and "L*s*b*h*(34 + 5*a*s/h)*B/2" in out
    assert plan.checkpoint_bytes == 12 * plan.shape.lora_trainable  # adapter weights + two Adam moments
    lora = plan.memory["LoRA"]
    assert lora.weights == 4 * plan.shape.parameters and lora.optimizer == 8 * plan.shape.lora_trainable


def test_throughput_measured_by_an_earlier_run(tiny_model_dir, varied_pairs, tmp_path):
    output = tmp_path / "measured"
    write_jsonl(output / "metrics.jsonl", [{"step": s, "loss": 1.0, "tokens_per_s": v}
                                           for s, v in enumerate([100.0, 300.0, 200.0], start=1)])
    plan = make_plan(config_for(tiny_model_dir, varied_pairs, output))
    assert plan.tokens_per_second == 200.0 and plan.seconds == pytest.approx(plan.run.tokens / 200.0)
    assert "median measured in" in plan.throughput_source
    assert np.isclose(plan.disk_bytes / GIB, plan.final_bytes / GIB)  # no step checkpoints: final/ only


def test_a_streaming_raw_text_config_plans_the_pass_the_in_memory_loader_finds(tmp_path):
    """objective causal_lm with streaming: true reads the stream through once to count a pass: its rows, steps and
    dropped rows are those of streaming: false, and the run is max_steps long."""
    from gpt4all_training.config.loader import load_config
    from gpt4all_training.data.bpe import train_bpe_tokenizer

    texts = [" ".join(WORDS[(i * k) % len(WORDS)] for k in range(1 + i % 9)) + "." for i in range(120)]
    write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in texts])
    train_bpe_tokenizer(texts, vocab_size=300).save_pretrained(tmp_path / "tok")
    plans = {}
    for streaming in ("false", "true"):
        config = load_config("configs/train/pretrain_tiny.yaml",
                             [f"dataset_path={tmp_path / 'text.jsonl'}", "text_field=text",
                              f"tokenizer_name={tmp_path / 'tok'}",
                              f"output_dir={tmp_path / 'out'}", f"streaming={streaming}", "max_steps=5",
                              "batch_size=2", "max_length=16"])
        plans[streaming] = make_plan(config)
    memory, stream = plans["false"], plans["true"]
    assert stream.train_examples == memory.train_examples > 0
    assert (stream.steps_per_epoch, stream.dropped_per_epoch) == (memory.steps_per_epoch, memory.dropped_per_epoch)
    assert stream.total_steps == memory.total_steps == 5
    assert stream.run == memory.run
    assert "optimiser steps in total" in stream.describe()


def test_a_warmup_that_leaves_no_step_to_decay_is_a_note_train_prints_too(tiny_model_dir, varied_pairs, tmp_path):
    """warmup_steps 10 over 8 steps (the quick start's warmup_steps 10 and max_steps=10 alike): the rate only rises
    and never comes down to min_lr. plan's note is the line train prints at its start (tests/test_progress.py)."""
    plan = make_plan(config_for(tiny_model_dir, varied_pairs, tmp_path, warmup_steps=10))
    line = ("warmup_steps 10 leaves none of the run's 8 optimiser steps to decay in: the learning rate rises to "
            "0.0008 (lr is 0.001) and never comes down to min_lr 0.0001; set warmup_steps=1 (5-10% of the steps)")
    assert plan.total_steps == 8 and line in plan.notes and f"note: {line}" in plan.describe().splitlines()
    # 7 warmup steps of 8: the last step is at lr, and it decays no more than a warmup of 8 does.
    assert any(n.startswith("warmup_steps 7 leaves none") for n in make_plan(
        config_for(tiny_model_dir, varied_pairs, tmp_path, warmup_steps=7)).notes)
    assert not [n for n in make_plan(config_for(tiny_model_dir, varied_pairs, tmp_path, warmup_steps=6)).notes
                if n.startswith("warmup_steps")]


def test_config_only_plans_the_memory_from_the_models_config_alone(tiny_model_dir, varied_pairs, tmp_path, capsys):
    """--config-only reads neither tokenizer nor data (the dataset here does not exist), and a model folder that holds
    only a config.json plans the same way by itself: both give the full plan's memory and checkpoint sizes."""
    full = make_plan(config_for(tiny_model_dir, varied_pairs, tmp_path, lora=True))
    config = tmp_path / "c.yaml"
    config.write_text(f"model_name: {tiny_model_dir}\ndataset_path: {tmp_path / 'no-such-data'}\n"
                      f"output_dir: {tmp_path / 'o'}\nmax_length: 32\nbatch_size: 4\nlora: true\ndtype: float32\n")
    assert run(argparse.Namespace(config=str(config), gpus=1, tokens_per_second=None, gpu_memory=8.0,
                                  config_only=True, overrides=[])) == 0
    out = capsys.readouterr().out
    assert out.startswith("from the model's config alone: micro-batch 4 of up to 32 tokens x 1 GPU(s); the data is "
                          "not read (no steps, tokens or time)\n")
    assert f"  LoRA        {size(full.memory['LoRA'].total):>11} = weights" in out and "fits in 8.00 GiB" in out
    assert "optimiser steps" not in out and "time" not in out.splitlines()

    alone = tmp_path / "config-alone"
    alone.mkdir()
    shutil.copy(tiny_model_dir / "config.json", alone / "config.json")
    plan = make_plan(config_for(alone, varied_pairs, tmp_path, lora=True))
    assert isinstance(plan, ConfigOnlyPlan)
    assert (plan.memory, plan.checkpoint_bytes, plan.final_bytes, plan.shape) == \
        (full.memory, full.checkpoint_bytes, full.final_bytes, full.shape)
    assert plan.notes == [f"model_name {alone} holds a config and no tokenizer, so the data is not read; set "
                          f"tokenizer_name to a tokenizer on this machine to plan the steps, tokens and time too"]
    # With a tokenizer named, the folder plans the data too.
    assert make_plan(config_for(alone, varied_pairs, tmp_path, lora=True, tokenizer_name=str(tiny_model_dir))) \
        .total_steps == full.total_steps


HOW_TO = ("plan needs only the model's config.json: save it in a folder and set model_name to that folder (its "
          "memory is planned from the config alone, as --config-only does; with tokenizer_name set to a tokenizer "
          "here the data too)")


def test_a_hub_model_that_is_not_here_is_refused_at_once_with_how_to_plan_without_it(varied_pairs, tmp_path):
    """Offline (HF_HUB_OFFLINE, as the tests run) and not in the cache: one line, before any tokenizer or data."""
    config = config_for("no-such-org/no-such-model", tmp_path / "no-such-data", tmp_path)
    with pytest.raises(UserError) as refused:
        make_plan(config)
    assert str(refused.value) == (f"model_name no-such-org/no-such-model: not on this machine (not in the Hugging "
                                  f"Face cache) and the Hub cannot be reached (HF_HUB_OFFLINE is set); {HOW_TO}")
    with pytest.raises(UserError, match=r"^model_name no-such-org/no-such-model: not on this machine"):
        make_plan(config, config_only=True)


def test_an_unreachable_hub_is_one_line_without_the_libraries_retries(varied_pairs, tmp_path, monkeypatch):
    """Online mode, but the Hub does not answer (here: a local port nobody listens on, so nothing leaves this
    machine): one request, no retries, the same line with the connection's error."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(UserError) as refused:
        make_plan(config_for("no-such-org/no-such-model", tmp_path / "no-such-data", tmp_path))
    assert time.monotonic() - started < 10  # the libraries' 5 retries with backoff take 23 s or more per file
    message = str(refused.value)
    assert message.startswith("model_name no-such-org/no-such-model: not on this machine (not in the Hugging Face "
                              "cache) and the Hub cannot be reached (") and message.endswith(f"); {HOW_TO}")
