"""Training on an XLA device through torch_xla, with PJRT_DEVICE=CPU standing in for a TPU.

These run in .venv-xla only (scripts/make_xla_venv.sh: torch 2.9.0 + torch_xla 2.9.0); in the main venv the
module is skipped. The launch is the documented TPU v3-8 command with one device instead of eight:
`accelerate launch --config_file configs/accelerate/tpu_v3_8.yaml --num_processes 1 -m gpt4all_training.cli train`.
Batch size 1 makes the batch width vary from step to step (16 to 128 tokens), so without fixed width buckets
every new width would compile new graphs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")

import shutil  # noqa: E402

from distributed.runs import (VAL_LOSS_ATOL, accelerate, launch, load_final, max_difference,  # noqa: E402
                              validation_loss)
from support.files import write_config  # noqa: E402
from support.models import weights  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 16
# Graphs compiled by the end of each of the 16 steps, measured: 6 on the first step (the count reduction, forward
# and backward up to the loss, clipping, the optimiser's first step), 7 once the optimiser has state, and 10 from
# step 7 on, when both width buckets (64 and 128) have been met. Padding to the exact batch width instead reaches 19
# and keeps growing; a loss with data-dependent shapes (boolean-mask selection of the trained tokens) reaches 21.
MAX_COMPILATIONS = 12
SETTLED_AFTER = 8  # from this step on, no step compiles anything
SAVE_AT = 8  # a checkpoint at step 8 (and 16), which the resumed run starts from


@pytest.fixture(scope="module")
def xla_config(tiny_model_dir, clean_dolly, tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("xla-config"), {
        "model_name": str(tiny_model_dir), "dataset_path": str(clean_dolly), "max_length": 128, "batch_size": 1,
        "gradient_accumulation_steps": 1, "lr": 3.0e-3, "min_lr": 1.0e-4, "warmup_steps": 2, "weight_decay": 0.1,
        "max_grad_norm": 1.0, "max_steps": STEPS, "eval_every": None, "eval_steps": None, "save_every": SAVE_AT,
        "keep_last": None, "val_fraction": 0.05, "seed": 7, "num_proc": 1, "report_to": ["jsonl"]})


@pytest.fixture(scope="module")
def xla_run(xla_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("xla-run") / "run"
    command = [*accelerate("tpu_v3_8.yaml", "--num_processes=1"), "-m", "gpt4all_training.cli", "train",
               "--config", str(xla_config), f"output_dir={out}"]
    return launch([command], out, env={"PJRT_DEVICE": "CPU"})


@pytest.fixture(scope="module")
def xla_resumed_run(xla_config, xla_run, tmp_path_factory):
    """The same launch, resumed from the first run's step-8 checkpoint in a new output_dir."""
    out = tmp_path_factory.mktemp("xla-resumed") / "run"
    shutil.copytree(xla_run.output_dir / f"step_{SAVE_AT}", out / f"step_{SAVE_AT}")
    command = [*accelerate("tpu_v3_8.yaml", "--num_processes=1"), "-m", "gpt4all_training.cli", "train",
               "--config", str(xla_config), f"output_dir={out}", "resume=auto"]
    return launch([command], out, env={"PJRT_DEVICE": "CPU"})


@pytest.fixture(scope="module")
def validation(xla_config):
    from gpt4all_training.config.loader import load_config
    from gpt4all_training.data.sft import load_data
    from gpt4all_training.model.loading import load_tokenizer

    config = load_config(xla_config)
    tokenizer = load_tokenizer(config.model_name)
    (train_ds, val_ds), _ = load_data(config, tokenizer)
    return config, train_ds, val_ds, tokenizer.pad_token_id


def test_training_ran_on_the_xla_device_and_the_loss_fell(xla_run, validation, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    _, _, val_ds, pad_id = validation
    rows = xla_run.train_rows()
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(row["xla_compilations"] > 0 for row in rows)  # logged only when the device is an XLA device
    untrained = validation_loss(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), val_ds, pad_id)
    assert xla_run.last("val_loss") < untrained - 0.05


def test_first_step_loss_equals_the_cpu_loss(xla_run, validation, tiny_model_dir):
    """Step 1 trains the untrained model's loss on the sampler's first batch: computed here on plain CPU torch."""
    from transformers import AutoModelForCausalLM

    from gpt4all_training.data.sampling import StepSampler

    config, train_ds, _, pad_id = validation
    (indices,) = StepSampler(len(train_ds), config.batch_size, seed=config.seed).step_indices(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    expected = validation_loss(model, train_ds.select(indices), pad_id)
    assert abs(xla_run.train_rows()[0]["loss"] - expected) < 1e-5


def test_compilations_stay_bounded(xla_run):
    """Fixed width buckets keep the shapes static: after the first steps no step compiles a new graph."""
    counts = xla_run.series("xla_compilations")
    assert counts[-1] <= MAX_COMPILATIONS, counts
    assert counts[SETTLED_AFTER - 1] == counts[-1], counts


def test_final_reloads_on_plain_cpu_torch_with_the_in_memory_loss(xla_run, validation):
    """final/ (written from a state dict moved off the XLA device) reloads with plain transformers on the CPU and
    gives the validation loss that the model on the XLA device measured at the last step."""
    _, _, val_ds, pad_id = validation
    model = load_final(xla_run.final)
    assert next(model.parameters()).device.type == "cpu"
    assert abs(validation_loss(model, val_ds, pad_id) - xla_run.last("val_loss")) < VAL_LOSS_ATOL


def test_checkpoints_save_off_the_device_and_resume_exactly(xla_run, xla_resumed_run):
    """step_8/ (model, and optimiser state moved off the XLA device) resumes into the same last 8 steps: the same
    losses and the same final weights as the run that went straight through."""
    assert (xla_run.output_dir / f"step_{SAVE_AT}" / "optimizer.pt").is_file()
    straight = [row["loss"] for row in xla_run.train_rows() if row["step"] > SAVE_AT]
    resumed = [row["loss"] for row in xla_resumed_run.train_rows() if row["step"] > SAVE_AT]
    assert len(resumed) == STEPS - SAVE_AT and resumed == pytest.approx(straight, abs=1e-6)
    assert max_difference(weights(xla_resumed_run.final), weights(xla_run.final)) <= 1e-6
