"""DeepSpeed through accelerate on CPU (gloo): ZeRO-2 (as a 2-node launch), ZeRO-3, ZeRO-2 with the optimiser
offloaded to the CPU, full fine-tuning and LoRA. Each reproduces one process, saves a final/ that plain
transformers (and PEFT) reload with the weights the ranks held, and fills its DeepSpeed config from the training
config. Tolerances are justified in runs.py."""

from __future__ import annotations

import re

import pytest
import torch
from support.models import weights

from .runs import (LOGITS_ATOL, VAL_LOSS_ATOL, assert_same_training, final_logit_difference, load_final,
                   max_difference, merged_vs_adapter_difference, validation_loss)

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

FULL_RUNS = ["ddp_run", "zero2_run", "zero3_run"]
LORA_RUNS = ["offload_lora_run", "zero3_lora_run"]


def engine_config(run) -> dict:
    """The DeepSpeed config the engine ran with, as it saved it into the step-4 checkpoint."""
    states = sorted((run.output_dir / "step_4" / "deepspeed" / "engine").glob("*model_states.pt"))
    assert states, f"no DeepSpeed engine state in {run.output_dir / 'step_4'}"
    return torch.load(states[0], weights_only=True, map_location="cpu")["ds_config"]


def test_zero2_over_two_nodes_matches_one_process(single_run, zero2_run, initial_weights):
    assert_same_training(zero2_run, single_run, initial_weights)


def test_zero2_accumulation_matches_ddp_accumulation(ddp_run, zero2_run, initial_weights):
    """Both run batch 1 x 2 accumulation steps per rank: the engine's own division by its accumulation steps and its
    step inside backward must not change the maths."""
    assert_same_training(zero2_run, ddp_run, initial_weights)


def test_zero2_ranks_end_with_bitwise_identical_weights(zero2_run):
    assert zero2_run.last("replica_mismatches") == 0


def test_zero3_matches_one_process(single_run, zero3_run, initial_weights):
    assert_same_training(zero3_run, single_run, initial_weights)


@pytest.mark.parametrize(("run_name", "lora"), [("zero3_run", False), ("zero3_lora_run", True)])
def test_zero3_builds_the_model_partitioned_so_no_rank_holds_a_whole_copy(request, run_name, lora):
    """Built under transformers' zero.Init, each of the 2 ranks holds half of every base parameter (rounded up) from
    the start, not a whole fp32 copy until prepare(). LoRA's adapter, added by PEFT afterwards, is small and whole
    until prepare() partitions it too."""
    run = request.getfixturevalue(run_name)
    found = re.search(r"parameters: ([\d,]+) trainable of ([\d,]+) .*this rank holds ([\d,]+)", run.log)
    assert found, run.log[-2000:]
    trainable, total, held = (int(group.replace(",", "")) for group in found.groups())
    whole = trainable if lora else 0
    assert (total + whole) / 2 <= held < (total + whole) / 2 + 64  # padding: at most one element per tensor


@pytest.mark.parametrize(("run_name", "stage", "offload"), [("zero2_run", 2, False), ("zero3_run", 3, False),
                                                             ("offload_lora_run", 2, True)])
def test_deepspeed_config_is_filled_from_the_training_config(request, run_name, stage, offload):
    config = engine_config(request.getfixturevalue(run_name))
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (1, 2, 4)
    assert config["gradient_clipping"] == 1.0  # max_grad_norm
    assert config["bf16"]["enabled"] is False and config["fp16"]["enabled"] is False  # dtype float32
    assert "scheduler" not in config and "optimizer" not in config
    assert config["zero_optimization"]["stage"] == stage
    assert (config["zero_optimization"].get("offload_optimizer", {}).get("device") == "cpu") == offload
    if stage == 3:
        assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


@pytest.mark.parametrize("run_name", FULL_RUNS + LORA_RUNS)
def test_final_reloads_with_the_weights_the_ranks_trained(request, run_name, validation, tiny_model_dir):
    """final/ through plain transformers (+ PEFT for an adapter) gives the validation loss that the in-memory,
    sharded model measured across both ranks at the last step, and that loss is below the untrained model's."""
    from transformers import AutoModelForCausalLM

    run = request.getfixturevalue(run_name)
    val_ds, pad_id = validation
    reloaded = validation_loss(load_final(run.final), val_ds, pad_id)
    assert run.last("val_tokens") == sum(sum(1 for t in row["labels"][1:] if t != -100) for row in val_ds)
    assert abs(reloaded - run.last("val_loss")) < VAL_LOSS_ATOL
    untrained = validation_loss(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), val_ds, pad_id)
    assert reloaded < untrained - 0.01


@pytest.mark.parametrize(("run_name", "reference_name"), [(name, "single_run") for name in FULL_RUNS]
                         + [(name, "single_lora_run") for name in LORA_RUNS])
def test_final_gives_the_logits_of_the_one_process_model(request, run_name, reference_name, validation):
    run, reference = request.getfixturevalue(run_name), request.getfixturevalue(reference_name)
    assert final_logit_difference(run.final, reference.final, validation) < LOGITS_ATOL


@pytest.mark.parametrize("run_name", LORA_RUNS)
def test_lora_matches_one_process(request, run_name, single_lora_run):
    """Offload: DeepSpeedCPUAdam, built over our parameter groups, steps like torch's AdamW (weight decay included).
    ZeRO-3: the adapter is gathered before saving."""
    assert_same_training(request.getfixturevalue(run_name), single_lora_run)


def test_lora_adapter_saved_under_zero3_is_complete(zero3_lora_run, single_lora_run):
    """peft#2500: adapters saved under ZeRO-3 by peers come out as empty tensors. Ours: every tensor of the
    1-process adapter, full shape (rank 8), trained (lora_B starts at zero)."""
    adapter, reference = weights(zero3_lora_run.final), weights(single_lora_run.final)
    assert adapter.keys() == reference.keys() and len(adapter) == 2 * 6 * 2  # A and B of 6 linear layers in 2 layers
    for name, tensor in adapter.items():
        assert tensor.shape == reference[name].shape and 8 in tensor.shape
        if "lora_B" in name:
            assert tensor.abs().max() > 1e-4


def test_merged_under_zero3_equals_base_plus_adapter(zero3_lora_run, validation):
    """merge_lora under ZeRO-3 merges a whole copy built from the gathered weights, not the rank's partition."""
    assert merged_vs_adapter_difference(zero3_lora_run.final, validation) < 1e-5


def test_zero3_lora_resumes_exactly(zero3_lora_run, zero3_lora_resumed_run):
    """Resumed from step_4 (each rank reloads its own optimiser partition from deepspeed/), steps 5-8 repeat the
    uninterrupted run bit for bit. The engine state leaves out the frozen base: only adapter weights are stored."""
    resumed = {row["step"]: row for row in zero3_lora_resumed_run.train_rows()}
    assert sorted(resumed) == [5, 6, 7, 8]
    for row in zero3_lora_run.train_rows()[4:]:
        assert {k: resumed[row["step"]][k] for k in ("loss", "lr", "grad_norm")} == \
            {k: row[k] for k in ("loss", "lr", "grad_norm")}
    assert max_difference(weights(zero3_lora_resumed_run.final), weights(zero3_lora_run.final)) == 0.0
    engine = zero3_lora_run.output_dir / "step_4" / "deepspeed" / "engine"
    saved = torch.load(sorted(engine.glob("*model_states.pt"))[0], weights_only=True, map_location="cpu")
    assert saved["module"] is None or all("lora_" in name for name in saved["module"])
