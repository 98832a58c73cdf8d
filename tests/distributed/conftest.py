"""One real launch per configuration, shared by every test that reads it (each launch costs seconds of interpreter
start-up, so it runs once however many tests, files and test workers look at it: support/shared.py).

Every run trains the same 8 optimiser steps of global batch 4 on the tiny GPT-J in fp32: the 1-process references
as batch 4, the 2-process runs as batch 1 x gradient accumulation 2 x 2 ranks. Global step s is the same 4 examples
in all of them (data/sampling.py), so they must agree within floating-point summation order. Every run checkpoints at
step 4, so DeepSpeed runs also write their engine state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from support.files import write_config
from support.launch import free_port
from support.models import weights
from support.paths import PYTHON
from support.shared import shared_fixture_folder

from .runs import LAUNCH_SECONDS, Run, accelerate, finished_run, launch, train_command

STEPS = 8
ZERO3 = "--deepspeed_config_file=configs/deepspeed/ds_config_zero3.json"
OFFLOAD = "--deepspeed_config_file=configs/deepspeed/ds_config_gptj_lora.json"  # ZeRO-2, optimiser on the CPU
SINGLE = ("batch_size=4", "gradient_accumulation_steps=1")
# LoRA on q/v of 2 layers learns slowly; 10x the full fine-tuning lr (as is usual for LoRA) makes its loss fall
# measurably in 8 steps.
LORA = ("lora=true", "lr=3.0e-2")


def pytest_terminal_summary(terminalreporter):
    if LAUNCH_SECONDS:
        terminalreporter.section("distributed launches: wall seconds")
        for name, seconds in LAUNCH_SECONDS.items():
            terminalreporter.write_line(f"{seconds:7.1f}  {name}")


@pytest.fixture(scope="session")
def dist_config(tiny_model_dir, clean_dolly, tmp_path_factory) -> Path:
    """Weight decay 1.0 moves the weights by up to ~1e-3 in 8 steps, 20x the parity tolerance: an optimiser that
    lost it (gpt4all's DeepSpeed runs did) fails the parity tests. Clipping at 1.0 is active (norms ~1.2-1.8),
    so DeepSpeed's gradient_clipping must come from max_grad_norm. No LoRA dropout: ranks draw different masks
    than one process does."""
    return write_config(tmp_path_factory.mktemp("dist-config"), {
        "model_name": str(tiny_model_dir), "dataset_path": str(clean_dolly), "max_length": 128, "batch_size": 1,
        "gradient_accumulation_steps": 2, "lr": 3.0e-3, "min_lr": 1.0e-4, "warmup_steps": 2, "weight_decay": 1.0,
        "max_grad_norm": 1.0, "max_steps": STEPS, "eval_every": None, "eval_steps": None, "save_every": 4,
        "keep_last": 2, "val_fraction": 0.05, "seed": 7, "num_proc": 1, "lora_r": 8, "lora_alpha": 16,
        "lora_dropout": 0.0, "report_to": ["jsonl"]})


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist-runs")


def launched_once(tmp_path_factory, name: str, commands: Callable[[Path], list[list[str]]]) -> Run:
    """`launch(commands(output_dir), output_dir)` in the first test worker that asks; every worker gets its Run."""
    folder = shared_fixture_folder(tmp_path_factory, f"dist-{name}", lambda f: launch(commands(f / name), f / name))
    return finished_run(folder / name)


@pytest.fixture(scope="session")
def single_run(dist_config, tmp_path_factory):
    """The reference: one process through configs/accelerate/single_gpu.yaml."""
    return launched_once(tmp_path_factory, "single",
                         lambda out: [train_command(accelerate("single_gpu.yaml"), dist_config, out, *SINGLE)])


@pytest.fixture(scope="session")
def single_lora_run(dist_config, tmp_path_factory):
    """The LoRA reference: plain `python train.py`."""
    return launched_once(tmp_path_factory, "single-lora",
                         lambda out: [train_command([PYTHON], dist_config, out, *SINGLE, *LORA)])


@pytest.fixture(scope="session")
def ddp_run(dist_config, tmp_path_factory):
    def commands(out: Path) -> list[list[str]]:
        launcher = accelerate("multi_gpu_8.yaml", "--num_processes=2", f"--main_process_port={free_port()}")
        return [train_command(launcher, dist_config, out)]

    return launched_once(tmp_path_factory, "ddp", commands)


@pytest.fixture(scope="session")
def zero2_run(dist_config, tmp_path_factory):
    """ZeRO-2 as the documented 2-node launch: two `accelerate launch` commands, machine ranks 0 and 1, one process
    each, meeting at main_process_ip (localhost here), exactly as on two machines."""
    def commands(out: Path) -> list[list[str]]:
        port = free_port()
        return [train_command(accelerate("deepspeed_2node.yaml", "--num_processes=2", f"--machine_rank={rank}",
                                         "--main_process_ip=127.0.0.1", f"--main_process_port={port}"),
                              dist_config, out)
                for rank in (0, 1)]

    return launched_once(tmp_path_factory, "zero2-2node", commands)


@pytest.fixture(scope="session")
def zero3_run(dist_config, tmp_path_factory):
    def commands(out: Path) -> list[list[str]]:
        launcher = accelerate("deepspeed_8gpu.yaml", "--num_processes=2", f"--main_process_port={free_port()}", ZERO3)
        return [train_command(launcher, dist_config, out)]

    return launched_once(tmp_path_factory, "zero3", commands)


@pytest.fixture(scope="session")
def offload_lora_run(dist_config, tmp_path_factory):
    """LoRA on ZeRO-2 with the optimiser offloaded to the CPU (DeepSpeedCPUAdam; compiled once, ~40 s, into
    TORCH_EXTENSIONS_DIR)."""
    def commands(out: Path) -> list[list[str]]:
        launcher = accelerate("deepspeed_8gpu.yaml", "--num_processes=2", f"--main_process_port={free_port()}",
                              OFFLOAD)
        return [train_command(launcher, dist_config, out, *LORA)]

    return launched_once(tmp_path_factory, "zero2-offload-lora", commands)


@pytest.fixture(scope="session")
def zero3_lora_run(dist_config, tmp_path_factory):
    def commands(out: Path) -> list[list[str]]:
        launcher = accelerate("deepspeed_8gpu.yaml", "--num_processes=2", f"--main_process_port={free_port()}", ZERO3)
        return [train_command(launcher, dist_config, out, *LORA, "merge_lora=true")]

    return launched_once(tmp_path_factory, "zero3-lora", commands)


@pytest.fixture(scope="session")
def zero3_lora_resumed_run(dist_config, zero3_lora_run, tmp_path_factory):
    """The ZeRO-3 LoRA run again, resumed from its step-4 checkpoint into a new output_dir."""
    def commands(out: Path) -> list[list[str]]:
        launcher = accelerate("deepspeed_8gpu.yaml", "--num_processes=2", f"--main_process_port={free_port()}", ZERO3)
        checkpoint = f"checkpoint={zero3_lora_run.output_dir / 'step_4'}"
        return [train_command(launcher, dist_config, out, *LORA, "merge_lora=true", checkpoint)]

    return launched_once(tmp_path_factory, "zero3-lora-resumed", commands)


@pytest.fixture(scope="session")
def initial_weights(tiny_model_dir):
    return weights(tiny_model_dir)


@pytest.fixture(scope="session")
def validation(dist_config):
    """The validation split every run evaluated at its last step, rebuilt here from the same config."""
    from gpt4all_training.config.loader import load_config
    from gpt4all_training.data.sft import load_data
    from gpt4all_training.model.loading import load_tokenizer

    config = load_config(dist_config)
    tokenizer = load_tokenizer(config.model_name)
    (_, val_ds), _ = load_data(config, tokenizer)
    return val_ds, tokenizer.pad_token_id
