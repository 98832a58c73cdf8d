"""dtype auto: what it resolves to on the machine that runs the test (its CPU flags, or its GPU's capability), said
in one line, and kept by a run that resumes on a machine that would resolve it otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from support.files import write_jsonl
from gpt4all_training.backends.precision import native_dtype
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.training import precision
from gpt4all_training.training.loop import train

NATIVE_BF16_FLAGS = {"amx_bf16", "avx512_bf16"}


def cpu_flags() -> set[str]:
    """The CPU's flags as Linux lists them: an account of the hardware independent of torch's cpuinfo."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def expected_dtype() -> str:
    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.get_device_capability() >= (8, 0) else "float32"
    return "bfloat16" if cpu_flags() & NATIVE_BF16_FLAGS else "float32"


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file() and not torch.cuda.is_available(), reason="needs Linux")
def test_auto_resolves_to_this_machines_native_dtype_in_one_line():
    config = validate(TrainConfig(model_name="m", dataset_path="d"))
    lines: list[str] = []
    resolved = precision.resolve_dtype(config, lines.append)
    assert config.dtype == "auto" and resolved.dtype == native_dtype()[0] == expected_dtype()
    assert len(lines) == 1 and lines[0].startswith(f"dtype: auto is {expected_dtype()} (")
    explicit = validate(TrainConfig(model_name="m", dataset_path="d", dtype="float32"))
    assert precision.resolve_dtype(explicit, lines.append) is explicit and len(lines) == 1


def test_a_resumed_auto_run_keeps_the_dtype_it_resolved(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Two LoRA steps under auto (validated, checkpointed, merged: on a bf16 machine over a base stored in bf16),
    then the second step again from step_1 on a machine whose auto is the other dtype: the resumed run trains in
    the dtype its run resolved (a changed dtype would be refused as a config change), to the same adapter."""
    data = write_jsonl(tmp_path / "data" / "pairs_clean.jsonl",
                       [{"prompt": f"What is {i} plus {i}?", "response": f"{2 * i}.", "source": "t"}
                        for i in range(16)]).parent
    values = dict(model_name=str(tiny_model_dir), dataset_path=str(data), output_dir=str(tmp_path / "run"),
                  max_length=32, batch_size=4, val_fraction=0.25, max_steps=2, save_every=1, eval_every=1,
                  num_proc=1, seed=0, lora=True, lora_dropout=0.0, merge_lora=True)
    train(validate(TrainConfig(**values)))
    first = capsys.readouterr().out
    adapter = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    here = native_dtype()[0]
    assert f"dtype: auto is {here} (" in first
    saved = yaml.safe_load((tmp_path / "run" / "step_1" / "config.yaml").read_text())
    assert saved["dtype"] == here

    other = "float32" if here == "bfloat16" else "bfloat16"
    monkeypatch.setattr(precision, "native_dtype", lambda: (other, "another machine"))
    train(validate(TrainConfig(**values, checkpoint=str(tmp_path / "run" / "step_1"))))
    resumed = capsys.readouterr().out
    assert f"dtype: auto is {here} (what the run this one continues resolved)" in resumed
    assert yaml.safe_load((tmp_path / "run" / "final" / "config.yaml").read_text())["dtype"] == here
    again = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    assert again.keys() == adapter.keys() and all(torch.equal(again[k], adapter[k]) for k in adapter)
    # Starting over takes the machine's dtype (resolved only: one process keeps one accelerate precision).
    assert precision.resolve_dtype(validate(TrainConfig(**values, resume="never")), print).dtype == other


def test_one_process_builds_accelerators_of_two_precisions_in_turn():
    """check's dry run beside a run, the studio, a notebook: a process that trains in fp32 and then in bf16 gets each
    precision (accelerate alone refuses the second); an Accelerator that sets none keeps the one in force."""
    from gpt4all_training.backends.accelerate import build_accelerator

    for dtype, expected in (("float32", "no"), ("bfloat16", "bf16"), ("float32", "no")):
        config = validate(TrainConfig(model_name="m", dataset_path="d", dtype=dtype))
        assert build_accelerator(config).mixed_precision == expected
    assert build_accelerator(None).mixed_precision == "no"


def test_auto_is_fp32_under_a_torch_xla_launch(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert native_dtype()[0] == "float32"
