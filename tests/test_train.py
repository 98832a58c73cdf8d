"""The training loop on the tiny GPT-J: overfitting, saving and reloading, LoRA merge, accumulation, metrics, CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from support.files import write_jsonl
from support.models import build_tiny_gptj
from support.paths import PYTHON, REPO
from gpt4all_training.backends.accelerate import backend_for
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.batch import IGNORE
from gpt4all_training.data.batching import fetch_batch
from gpt4all_training.data.sft import load_data
from gpt4all_training.tracking.tracker import read_metrics

THRESHOLD_LORA = 0.1  # measured 0.061 after 40 steps (fp32, CPU)
PAIRS = [("What is the capital of France?", "Paris."), ("Name a primary colour.", "Red."),
         ("What is two plus two?", "Four."), ("Say hello.", "Hello!"), ("Which animal barks?", "A dog."),
         ("What do bees make?", "Honey."), ("Opposite of hot?", "Cold."), ("Largest planet?", "Jupiter.")]


@pytest.fixture(scope="module")
def eight_examples(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("eight")
    write_jsonl(folder / "pairs_clean.jsonl", [{"prompt": p, "response": r, "source": "t"} for p, r in PAIRS])
    return folder


def tiny_config(model_dir, data_dir, output_dir, **overrides) -> TrainConfig:
    values = dict(model_name=str(model_dir), dataset_path=str(data_dir), output_dir=str(output_dir), max_length=64,
                  batch_size=8, lr=3e-3, min_lr=3e-3, warmup_steps=0, val_fraction=0.0, num_epochs=100, max_steps=40,
                  eval_every=None, save_every=None, num_proc=1, seed=0, dtype="float32")
    values.update(overrides)
    return validate(TrainConfig(**values))


def run_train(config: TrainConfig) -> dict:
    from gpt4all_training.training.loop import train

    return train(config)


@pytest.fixture(scope="module")
def full_run(tiny_model_dir, eight_examples, tmp_path_factory):
    output = tmp_path_factory.mktemp("full")
    return run_train(tiny_config(tiny_model_dir, eight_examples, output)), output


@pytest.fixture(scope="module")
def rotated_examples(tmp_path_factory) -> Path:
    """The same prompts with each answer moved to the next prompt: knowledge the full run's model must unlearn."""
    folder = tmp_path_factory.mktemp("rotated")
    answers = [r for _, r in PAIRS]
    write_jsonl(folder / "pairs_clean.jsonl", [{"prompt": p, "response": answers[(i + 1) % 8], "source": "t"}
                                               for i, (p, _) in enumerate(PAIRS)])
    return folder


@pytest.fixture(scope="module")
def lora_run(full_run, rotated_examples, tmp_path_factory):
    """LoRA on a trained base (the full run's final/): a random tiny model's frozen lm_head is too weak to overfit."""
    output = tmp_path_factory.mktemp("lora")
    config = tiny_config(full_run[1] / "final", rotated_examples, output, lora=True, lora_r=8, lora_alpha=16,
                         lora_dropout=0.0, lora_target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "fc_in",
                                                                "fc_out"],
                         lr=1e-2, min_lr=1e-2, max_steps=40, merge_lora=True)
    return run_train(config), output


def training_batch(tokenizer, model_dir, data_dir, indices):
    (train_ds, _), _ = load_data(tiny_config(model_dir, data_dir, "unused"), tokenizer)
    return train_ds, fetch_batch(train_ds, indices, tokenizer.pad_token_id)


@pytest.mark.integration
def test_full_finetune_overfits_eight_examples(full_run):
    summary, output = full_run
    losses = [row["loss"] for row in read_metrics(output / "metrics.jsonl") if "loss" in row]
    assert len(losses) == 40
    assert losses[0] > 6.0  # untrained: about ln(1000) = 6.9
    assert losses[-1] < 0.1, losses[-5:]  # measured 0.068 at step 40 (fp32, CPU, seed 0)


@pytest.mark.integration
def test_lora_overfits_eight_examples(lora_run):
    summary, output = lora_run
    losses = [row["loss"] for row in read_metrics(output / "metrics.jsonl") if "loss" in row]
    assert losses[0] > 1.0  # measured 1.16: the base answers with the old mapping (the "." and EOS still fit)
    assert losses[-1] < THRESHOLD_LORA, losses[-5:]
    adapter = json.loads((output / "final" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["fc_in", "fc_out", "k_proj", "out_proj", "q_proj", "v_proj"]


def test_lora_defaults_to_every_linear_layer_but_the_output_head(tiny_model_dir):
    import torch

    from gpt4all_training.model.loading import load_model
    from gpt4all_training.model.lora import apply_lora

    base = load_model(str(tiny_model_dir))
    linear = {name for name, module in base.named_modules() if isinstance(module, torch.nn.Linear)}
    model = apply_lora(base, 8, 16, 0.0, None, False)
    adapted = {name for name, module in model.get_base_model().named_modules() if hasattr(module, "lora_A")}
    assert adapted == linear - {"lm_head"} and len(adapted) == 12  # GPT-J: q, k, v, out, fc_in, fc_out in 2 layers


@pytest.mark.integration
def test_eos_is_learned_when_pad_is_eos(full_run, tokenizer, tiny_model_dir, eight_examples):
    """gpt4all's first LoRA never stopped: masking pad also masked EOS. Ours predicts EOS after every answer."""
    from transformers import AutoModelForCausalLM

    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    _, output = full_run
    model = AutoModelForCausalLM.from_pretrained(output / "final").eval()
    train_ds, batch = training_batch(tokenizer, tiny_model_dir, eight_examples, list(range(8)))
    with torch.no_grad():
        predicted = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    for row in range(8):
        n = int(batch["attention_mask"][row].sum())
        assert batch["labels"][row, n - 1] == tokenizer.eos_token_id
        assert predicted[row, n - 2] == tokenizer.eos_token_id


@pytest.mark.integration
def test_final_folder_reloads_with_plain_transformers(full_run, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _, output = full_run
    final = output / "final"
    assert (final / "model.safetensors").is_file() and not list(final.glob("*.bin"))
    model = AutoModelForCausalLM.from_pretrained(final)
    assert AutoTokenizer.from_pretrained(final)("Paris")["input_ids"] == tokenizer("Paris")["input_ids"]
    generation = GenerationConfig.from_pretrained(final)
    assert generation.eos_token_id == tokenizer.eos_token_id
    assert generation.pad_token_id == tokenizer.pad_token_id
    assert model.config.n_layer == 2


def test_saved_final_gives_the_in_memory_logits(tiny_model_dir, tokenizer, eight_examples, tmp_path):
    """save_final, then reload: logits bitwise equal for a full model and equal for base + adapter."""
    from accelerate import Accelerator
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gpt4all_training.model.loading import load_model
    from gpt4all_training.model.lora import apply_lora
    from gpt4all_training.training.final import save_final

    _, batch = training_batch(tokenizer, tiny_model_dir, eight_examples, [0, 1, 2])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    backend = backend_for(Accelerator())
    model = load_model(str(tiny_model_dir))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)  # anything but the fixture's weights
    save_final(backend, model, tokenizer, tmp_path / "full", merge_lora=False, config_yaml="seed: 3\n")
    assert (tmp_path / "full" / "config.yaml").read_text() == "seed: 3\n"  # the run's config, for inference
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    with torch.no_grad():
        assert torch.equal(model.eval()(**inputs).logits, reloaded.eval()(**inputs).logits)

    peft_model = apply_lora(load_model(str(tiny_model_dir)), 4, 8, 0.0, None, False)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)  # B starts at zero; make the adapter matter
        expected = peft_model.eval()(**inputs).logits
    save_final(backend, peft_model, tokenizer, tmp_path / "adapter", merge_lora=True, config_yaml="seed: 3\n")
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter" / "merged")
    with torch.no_grad():
        adapter_logits = adapter.eval()(**inputs).logits
        merged_logits = merged.eval()(**inputs).logits
    assert torch.allclose(adapter_logits, expected, atol=1e-6, rtol=0)
    assert (merged_logits - expected).abs().max() < 1e-5
    assert (expected - AutoModelForCausalLM.from_pretrained(tiny_model_dir)(**inputs).logits).abs().max() > 1e-3


@pytest.mark.integration
def test_merged_lora_from_training_matches_adapter(lora_run, full_run, tiny_model_dir, tokenizer, eight_examples):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, output = lora_run
    _, batch = training_batch(tokenizer, tiny_model_dir, eight_examples, list(range(8)))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(full_run[1] / "final"),
                                        output / "final")
    merged = AutoModelForCausalLM.from_pretrained(output / "final" / "merged")
    with torch.no_grad():
        difference = (adapter.eval()(**inputs).logits - merged.eval()(**inputs).logits).abs().max()
    assert difference < 1e-5


def one_sgd_step(model_dir, tokenizer, train_ds, batch_size, accumulation, naive=False):
    """The weight change of one real train_step with SGD(lr=1): minus the step's gradient."""
    from accelerate import Accelerator

    from gpt4all_training.model.loading import load_model
    from gpt4all_training.data.sampling import StepSampler
    from gpt4all_training.training.step import train_step

    backend = backend_for(Accelerator())
    model = load_model(str(model_dir))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    sampler = StepSampler(len(train_ds), batch_size, 1, 0, accumulation, seed=0)
    batches = [fetch_batch(train_ds, indices, tokenizer.pad_token_id) for indices in sampler.step_indices(0)]
    if naive:  # what gpt4all did: mean of per-micro-batch means
        from gpt4all_training.batch import trained_token_count
        from gpt4all_training.training.loss import token_loss_sum

        for batch in batches:
            (token_loss_sum(model, batch) / trained_token_count(batch) / accumulation).backward()
        optimizer.step()
    else:
        train_step(model, batches, backend, optimizer, scheduler, None, 0)
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


def test_accumulation_gives_the_same_gradient_as_a_big_batch(tiny_model_dir, tokenizer, clean_dolly):
    (train_ds, _), _ = load_data(tiny_config(tiny_model_dir, clean_dolly, "unused"), tokenizer)
    big = one_sgd_step(tiny_model_dir, tokenizer, train_ds, batch_size=4, accumulation=1)
    accumulated = one_sgd_step(tiny_model_dir, tokenizer, train_ds, batch_size=1, accumulation=4)
    naive = one_sgd_step(tiny_model_dir, tokenizer, train_ds, batch_size=1, accumulation=4, naive=True)
    worst = max((big[n] - accumulated[n]).abs().max().item() for n in big)
    naive_worst = max((big[n] - naive[n]).abs().max().item() for n in big)
    assert worst < 1e-5
    assert naive_worst > 1e-4  # examples differ in length, so the mean of means is a different gradient
    assert max(g.abs().max().item() for g in big.values()) > 1e-3


@pytest.mark.integration
def test_metrics_has_one_row_per_logged_step(full_run):
    _, output = full_run
    rows = read_metrics(output / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 41))
    for row in train_rows:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "trained_tokens", "step"} <= row.keys()
    assert train_rows[-1]["trained_tokens"] == sum(r["trained_tokens"] - p["trained_tokens"] for p, r in
                                                   zip([{"trained_tokens": 0}] + train_rows, train_rows))
    assert 'id="train-loss"' in (output / "report.html").read_text()


def test_validation_loss_is_token_weighted(tiny_model_dir, tokenizer, clean_dolly):
    """val_loss = sum of token losses / trained tokens over the whole split, whatever the batch size."""
    from accelerate import Accelerator

    from gpt4all_training.training.evaluate import evaluate_loss
    from gpt4all_training.training.loss import token_loss_sum
    from gpt4all_training.model.loading import load_model

    (_, val_ds), _ = load_data(tiny_config(tiny_model_dir, clean_dolly, "unused", val_fraction=0.02), tokenizer)
    model = load_model(str(tiny_model_dir)).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(val_ds)):
            batch = fetch_batch(val_ds, [i], tokenizer.pad_token_id)
            total += token_loss_sum(model, batch).item()
            count += int((batch["labels"][:, 1:] != IGNORE).sum())
    backend = backend_for(Accelerator())
    by_three = evaluate_loss(model, val_ds, backend, 3, tokenizer.pad_token_id)
    by_five = evaluate_loss(model, val_ds, backend, 5, tokenizer.pad_token_id)
    assert by_three["val_tokens"] == count
    assert by_three["val_loss"] == pytest.approx(total / count, rel=1e-5)
    assert by_five["val_loss"] == pytest.approx(total / count, rel=1e-5)


def run_cli(*args, cwd=REPO):
    return subprocess.run([PYTHON, "train.py", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.integration
def test_command_line_overrides_take_effect(tiny_model_dir, eight_examples, tmp_path):
    result = run_cli("--config", "configs/train/finetune_tiny.yaml", f"model_name={tiny_model_dir}",
                     f"dataset_path={eight_examples}", f"output_dir={tmp_path}", "max_steps=3", "lr=5e-3",
                     "warmup_steps=0", "min_lr=5e-3", "val_fraction=0", "save_every=", "batch_size=2")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["lr"] for r in rows] == [5e-3] * 3
    assert not list(tmp_path.glob("step_*"))


@pytest.mark.integration
def test_nan_loss_stops_with_the_step_named(tiny_model_dir, tokenizer, eight_examples, tmp_path):
    model = build_tiny_gptj(tokenizer)
    with torch.no_grad():
        model.transformer.wte.weight.fill_(float("nan"))
    model.save_pretrained(tmp_path / "nan-model")
    tokenizer.save_pretrained(tmp_path / "nan-model")
    result = run_cli("--config", "configs/train/finetune_tiny.yaml", f"model_name={tmp_path / 'nan-model'}",
                     f"dataset_path={eight_examples}", f"output_dir={tmp_path / 'out'}", "val_fraction=0")
    assert result.returncode == 1
    errors = [line for line in result.stderr.replace("\r", "\n").splitlines() if line.startswith("error:")]
    assert errors == ["error: step 1: the loss is nan; lower lr, check the data, or use float32"]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "final").exists()


@pytest.mark.integration
def test_missing_model_path_is_one_line(eight_examples, tmp_path):
    result = run_cli("--config", "configs/train/finetune_tiny.yaml", f"model_name={tmp_path / 'nope'}",
                     f"dataset_path={eight_examples}", f"output_dir={tmp_path / 'out'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: model_name: {tmp_path / 'nope'} does not exist; give a "
                                                  f"local folder or a Hub id like org/name"]


def test_a_training_error_leaves_signals_gc_tracker_and_progress_bar_as_they_were(
        tiny_model_dir, tokenizer, eight_examples, tmp_path, monkeypatch):
    """A NaN loss raises a TrainingError out of train(): the loop's signal handlers are gone again, the garbage
    collector is not frozen, the trackers are closed and the progress bar is closed."""
    import gc
    import signal

    from tqdm.auto import tqdm

    import gpt4all_training.training.objectives.sft as sft_objective
    from gpt4all_training.errors import TrainingError
    from gpt4all_training.tracking.tracker import Tracker
    from gpt4all_training.training.loop import train

    real_loss = sft_objective.token_loss_sum
    monkeypatch.setattr(sft_objective, "token_loss_sum", lambda model, batch: real_loss(model, batch) * float("nan"))
    closed = []
    close = Tracker.close
    monkeypatch.setattr(Tracker, "close", lambda self: (closed.append(self.tensorboard is not None), close(self)))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    frozen = gc.get_freeze_count()
    config = tiny_config(tiny_model_dir, eight_examples, tmp_path, max_steps=3, report_to=["jsonl", "tensorboard"])
    with pytest.raises(TrainingError, match=r"^step 1: the loss is nan"):
        train(config)
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert gc.get_freeze_count() == frozen
    assert closed[:1] == [True]  # the TensorBoard writer was open, and close() ran
    assert not [bar for bar in getattr(tqdm, "_instances", ()) if bar.desc == "training"]


@pytest.mark.integration
def test_log_grads_every_logs_gradient_norms_per_parameter_group(tiny_model_dir, eight_examples, tmp_path):
    """Every log_grads_every steps: metrics.jsonl holds each parameter group's gradient norm as a number, and
    TensorBoard a histogram of its parameters' norms. Group norms combine to the step's (unclipped) grad_norm."""
    import math

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gpt4all_training.training.loop import train

    train(tiny_config(tiny_model_dir, eight_examples, tmp_path, max_steps=4, log_grads_every=2,
                      report_to=["jsonl", "tensorboard"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    grads = [r for r in rows if "grad_norm/decay" in r]
    assert [r["step"] for r in grads] == [2, 4]
    losses = {r["step"]: r for r in rows if "loss" in r}
    for row in grads:
        assert set(row) == {"step", "grad_norm/decay", "grad_norm/no_decay"}
        combined = math.hypot(row["grad_norm/decay"], row["grad_norm/no_decay"])
        assert combined == pytest.approx(losses[row["step"]]["grad_norm"], rel=1e-4)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0})
    events.Reload()
    assert {"grad_norms/decay", "grad_norms/no_decay"} <= set(events.Tags()["histograms"])
    assert [e.step for e in events.Histograms("grad_norms/decay")] == [2, 4]


def test_max_length_past_the_models_positions_is_refused_before_the_data_is_tokenised(tiny_model_dir, eight_examples,
                                                                                       tmp_path, capsys):
    """The tiny GPT-J has 512 positions: train and inference refuse max_length 600 before tokenising (nothing is
    cached, no split is reported), not after the whole dataset was tokenised."""
    from gpt4all_training.cli.main import main

    expected = "error: max_length: 600 exceeds the model's 512 positions; set max_length to at most 512"
    inference = tmp_path / "inference.yaml"
    inference.write_text(f"model_name: {tiny_model_dir}\ndataset_path: {eight_examples}\nmax_length: 600\n"
                         f"output_dir: {tmp_path / 'scores'}\nnum_proc: 1\n")
    for argv in (["train", "--config", "configs/train/finetune_tiny.yaml", f"model_name={tiny_model_dir}",
                  f"dataset_path={eight_examples}", f"output_dir={tmp_path / 'run'}", "max_length=600"],
                 ["inference", "--config", str(inference)]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        assert captured.err.strip().splitlines()[-1] == expected
        assert "examples" not in captured.out  # neither split was built
    assert not (tmp_path / "run" / "tokenized").exists()
