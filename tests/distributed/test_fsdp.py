"""FSDP2 on CPU (gloo): `accelerate launch --config_file configs/accelerate/fsdp2_2proc.yaml` starts two ranks and
backends/fsdp.py shards the model with torch's fully_shard (accelerate enables FSDP only with CUDA). Full
fine-tuning and LoRA reproduce one process with the same global batch, LoRA with activation checkpointing and CPU
offload on (one launch checked both ways: both wrap every layer whatever trains in it, and each launch costs seconds
of interpreter start-up per process), and final/ reloads with plain transformers (and PEFT).

Tolerances are runs.py's, and hold for the same reason: a correct run differs from one process only in the order
in which the ranks' gradients are summed. Measured here (8 steps, the tiny GPT-J): per-step losses within 5.7e-7,
gradient norms 5.1e-7 relative, full weights 1.8e-5 of training's change (worst tensor), LoRA adapters 4.5e-6;
the same launch with the x world-size factor removed (a reduce-scatter that summed instead of averaging would do
the same) gives 4.8e-3, 0.50 and 6.0e-2. Activation checkpointing and offload change none of the correct figures.
"""

from __future__ import annotations

import pytest
import torch
from support.launch import free_port
from support.models import weights

from .conftest import LORA
from .runs import (LOGITS_ATOL, VAL_LOSS_ATOL, accelerate, assert_same_training, final_logit_difference, launch,
                   load_final, merged_vs_adapter_difference, train_command, validation_loss)

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

FSDP2 = "fsdp2_2proc.yaml"
# accelerate launch flags over the file's fsdp_config: parameters live on the CPU between uses, every layer
# recomputes its activations in the backward.
CHECKPOINTED_OFFLOAD = ("--fsdp_offload_params=true", "--fsdp_activation_checkpointing=true")


def fsdp_launch(dist_config, out, *flags_then_overrides):
    flags = [f for f in flags_then_overrides if f.startswith("--")]
    overrides = [f for f in flags_then_overrides if not f.startswith("--")]
    launcher = accelerate(FSDP2, f"--main_process_port={free_port()}", *flags)
    return launch([train_command(launcher, dist_config, out, *overrides)], out)


@pytest.fixture(scope="module")
def fsdp_run(dist_config, runs_dir):
    return fsdp_launch(dist_config, runs_dir / "fsdp2")


@pytest.fixture(scope="module")
def fsdp_lora_run(dist_config, runs_dir):
    return fsdp_launch(dist_config, runs_dir / "fsdp2-lora-checkpointed-offload", *CHECKPOINTED_OFFLOAD, *LORA,
                       "merge_lora=true")


RUNS = ["fsdp_run", "fsdp_lora_run"]


def test_fsdp2_matches_one_process(fsdp_run, single_run, initial_weights):
    assert_same_training(fsdp_run, single_run, initial_weights)


def test_fsdp2_lora_matches_one_process(fsdp_lora_run, single_lora_run):
    assert_same_training(fsdp_lora_run, single_lora_run)


@pytest.mark.parametrize(("run_name", "line"), [
    ("fsdp_run", "FSDP2: 2 GPTJBlock units and the root, sharded over 2 processes\n"),
    ("fsdp_lora_run", "FSDP2: 2 GPTJBlock units and the root, sharded over 2 processes; parameters offloaded to the "
                      "CPU; activation checkpointing\n")])
def test_fsdp2_shards_as_the_accelerate_config_says(request, run_name, line):
    assert line in request.getfixturevalue(run_name).log


@pytest.mark.parametrize("run_name", RUNS)
def test_each_rank_checkpoints_its_own_shards(request, run_name, initial_weights):
    """step_4/fsdp/ holds one file per rank; together their rows are each trained tensor's rows (dimension 0 is
    split between the ranks), and a LoRA run stores only the adapter."""
    engine = request.getfixturevalue(run_name).output_dir / "step_4" / "fsdp"
    assert sorted(p.name for p in engine.iterdir()) == ["rank0.pt", "rank1.pt"]
    shards = [torch.load(engine / f"rank{r}.pt", weights_only=True)["model"] for r in (0, 1)]
    assert shards[0].keys() == shards[1].keys()
    if run_name == "fsdp_lora_run":
        # A and B of each of GPT-J's 6 linear layers but the head (LoRA's default), in 2 layers
        assert len(shards[0]) == 2 * 6 * 2 and all("lora_" in name for name in shards[0])
        return
    assert shards[0].keys() == initial_weights.keys()
    for name, tensor in initial_weights.items():
        assert [shard[name].shape[0] for shard in shards] == [(tensor.shape[0] + 1) // 2, tensor.shape[0] // 2]
        assert all(shard[name].shape[1:] == tensor.shape[1:] for shard in shards)


@pytest.mark.parametrize("run_name", RUNS)
def test_final_reloads_with_the_weights_the_ranks_trained(request, run_name, validation, tiny_model_dir):
    """final/ through plain transformers (+ PEFT for the adapter) gives the validation loss the sharded model
    measured across both ranks, below the untrained model's; its config names the model's own class."""
    from transformers import AutoConfig, AutoModelForCausalLM

    run = request.getfixturevalue(run_name)
    val_ds, pad_id = validation
    reloaded = validation_loss(load_final(run.final), val_ds, pad_id)
    assert abs(reloaded - run.last("val_loss")) < VAL_LOSS_ATOL
    untrained = validation_loss(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), val_ds, pad_id)
    assert reloaded < untrained - 0.01
    saved = run.final / "merged" if run_name == "fsdp_lora_run" else run.final
    assert AutoConfig.from_pretrained(saved).architectures == ["GPTJForCausalLM"]


@pytest.mark.parametrize(("run_name", "reference_name"), [("fsdp_run", "single_run"),
                                                         ("fsdp_lora_run", "single_lora_run")])
def test_final_gives_the_logits_of_the_one_process_model(request, run_name, reference_name, validation):
    run, reference = request.getfixturevalue(run_name), request.getfixturevalue(reference_name)
    assert final_logit_difference(run.final, reference.final, validation) < LOGITS_ATOL


def test_merged_under_fsdp2_equals_base_plus_adapter(fsdp_lora_run, validation):
    """merge_lora merges a whole copy built from the gathered weights, not a rank's shards."""
    assert merged_vs_adapter_difference(fsdp_lora_run.final, validation) < 1e-5
    assert weights(fsdp_lora_run.final).keys() == weights(fsdp_lora_run.output_dir / "step_4" / "model").keys()
