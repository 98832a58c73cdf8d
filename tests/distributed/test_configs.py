"""The shipped DeepSpeed and accelerate configs, filling a DeepSpeed config from the training config, and reading
the FSDP settings of a launch (no launches: these are the pure parts)."""

from __future__ import annotations

import json

import pytest
import yaml

from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.backends.deepspeed import fill_deepspeed_config
from gpt4all_training.backends.fsdp import FsdpSettings, fsdp_settings
from gpt4all_training.errors import UserError

from .runs import ACCELERATE_CONFIGS, DEEPSPEED_CONFIGS

DS_FILES = {"ds_config.json": (2, None, None), "ds_config_gptj.json": (2, None, None),
            "ds_config_gptj_lora.json": (2, "cpu", None), "ds_config_zero3.json": (3, None, None),
            "ds_config_zero3_offload.json": (3, "cpu", "cpu")}
DECIDED_BY_TRAINING_CONFIG = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                              "gradient_clipping")


def training(**values) -> TrainConfig:
    return TrainConfig(model_name="m", dataset_path="d", **values)


def test_fill_takes_every_value_from_the_training_config():
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}
    fill_deepspeed_config(ds, training(batch_size=3, gradient_accumulation_steps=5, max_grad_norm=0.5,
                                       dtype="bfloat16"), world_size=8, source="x.json")
    assert ds == {"train_batch_size": 3 * 5 * 8, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5,
                  "gradient_clipping": 0.5, "bf16": {"enabled": True}, "fp16": {"enabled": False},
                  "zero_optimization": {"stage": 2}}


def test_fill_turns_clipping_off_when_max_grad_norm_is_unset():
    """DeepSpeed reads 0 as no clipping; "auto" left to accelerate would become 1.0."""
    ds = fill_deepspeed_config({"gradient_clipping": "auto"}, training(max_grad_norm=None), 1, "x.json")
    assert ds["gradient_clipping"] == 0.0


def test_fill_accepts_explicit_values_that_agree():
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 16}
    fill_deepspeed_config(ds, training(batch_size=4, gradient_accumulation_steps=2), 2, "x.json")
    assert ds["train_batch_size"] == 16


@pytest.mark.parametrize(("key", "value", "node"), [
    ("train_micro_batch_size_per_gpu", 16, None), ("gradient_accumulation_steps", 4, None),
    ("train_batch_size", 64, None), ("gradient_clipping", 1.0, None), ("enabled", True, "fp16")])
def test_fill_refuses_a_value_that_contradicts_the_training_config(key, value, node):
    ds = {node: {key: value}} if node else {key: value}
    with pytest.raises(UserError) as error:
        fill_deepspeed_config(ds, training(batch_size=8, max_grad_norm=0.3), 2, "configs/deepspeed/mine.json")
    message = str(error.value)
    assert message.startswith("configs/deepspeed/mine.json: ") and key in message and '"auto"' in message
    assert "\n" not in message


@pytest.mark.parametrize("block", ["optimizer", "scheduler"])
def test_fill_refuses_optimizer_and_scheduler_blocks(block):
    """gpt4all's WarmupLR held the lr constant after warmup and its optimizer block dropped weight decay."""
    with pytest.raises(UserError, match=f'mine.json: remove the "{block}" block'):
        fill_deepspeed_config({block: {"type": "AdamW"}}, training(), 1, "mine.json")


def test_fill_makes_zero3_save_gathered_weights():
    ds = fill_deepspeed_config({"zero_optimization": {"stage": 3}}, training(), 2, "x.json")
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    with pytest.raises(UserError, match="stage3_gather_16bit_weights_on_model_save must be true"):
        fill_deepspeed_config({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}},
                              training(), 2, "x.json")


@pytest.mark.parametrize("name", sorted(DS_FILES))
def test_shipped_deepspeed_configs_leave_the_training_config_in_charge(name):
    stage, offload_optimizer, offload_param = DS_FILES[name]
    ds = json.loads((DEEPSPEED_CONFIGS / name).read_text())
    assert all(ds[key] == "auto" for key in DECIDED_BY_TRAINING_CONFIG)
    assert ds["bf16"]["enabled"] == ds["fp16"]["enabled"] == "auto"
    assert "optimizer" not in ds and "scheduler" not in ds
    zero = ds["zero_optimization"]
    assert zero["stage"] == stage
    assert zero.get("offload_optimizer", {}).get("device") == offload_optimizer
    assert zero.get("offload_param", {}).get("device") == offload_param
    if stage == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    filled = fill_deepspeed_config(ds, training(batch_size=2, gradient_accumulation_steps=3), 8, name)
    assert filled["train_batch_size"] == 48


def test_shipped_deepspeed_configs_are_all_tested():
    assert sorted(p.name for p in DEEPSPEED_CONFIGS.glob("*.json")) == sorted(DS_FILES)


def test_accelerate_configs_describe_the_documented_launches():
    configs = {p.name: yaml.safe_load(p.read_text()) for p in ACCELERATE_CONFIGS.glob("*.yaml")}
    assert sorted(configs) == ["deepspeed_2node.yaml", "deepspeed_8gpu.yaml", "fsdp2_2node.yaml", "fsdp2_2proc.yaml",
                               "fsdp2_8gpu.yaml", "multi_gpu_8.yaml", "single_gpu.yaml", "tpu_v3_8.yaml"]
    assert (configs["single_gpu.yaml"]["distributed_type"], configs["single_gpu.yaml"]["num_processes"]) == ("NO", 1)
    assert (configs["multi_gpu_8.yaml"]["distributed_type"], configs["multi_gpu_8.yaml"]["num_processes"]) == \
        ("MULTI_GPU", 8)
    one_node, two_nodes = configs["deepspeed_8gpu.yaml"], configs["deepspeed_2node.yaml"]
    assert (one_node["distributed_type"], one_node["num_processes"], one_node["num_machines"]) == ("DEEPSPEED", 8, 1)
    assert (two_nodes["distributed_type"], two_nodes["num_processes"], two_nodes["num_machines"]) == \
        ("DEEPSPEED", 16, 2)
    assert two_nodes["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    assert {"machine_rank", "main_process_ip", "main_process_port"} <= two_nodes.keys()
    for config in (one_node, two_nodes):
        assert (DEEPSPEED_CONFIGS.parent.parent / config["deepspeed_config"]["deepspeed_config_file"]).is_file()
    tpu = configs["tpu_v3_8.yaml"]
    assert (tpu["distributed_type"], tpu["num_processes"], tpu["main_training_function"]) == ("XLA", 8, "main")
    fsdp = {name: configs[f"fsdp2_{name}.yaml"] for name in ("2proc", "8gpu", "2node")}
    assert {name: (c["distributed_type"], c["num_processes"], c["num_machines"]) for name, c in fsdp.items()} == \
        {"2proc": ("FSDP", 2, 1), "8gpu": ("FSDP", 8, 1), "2node": ("FSDP", 16, 2)}
    for config in fsdp.values():
        assert config["fsdp_config"]["fsdp_version"] == 2
        assert config["fsdp_config"]["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert {"machine_rank", "main_process_ip", "main_process_port"} <= fsdp["2node"].keys()


FSDP_LAUNCH = {"FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
               "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_OFFLOAD_PARAMS": "true",
               "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer, GPTJBlock"}


def test_fsdp_settings_read_what_accelerate_launch_sets(monkeypatch):
    for key, value in FSDP_LAUNCH.items():
        monkeypatch.setenv(key, value)
    assert fsdp_settings(training()) == FsdpSettings(layer_classes=("LlamaDecoderLayer", "GPTJBlock"),
                                                     reshard_after_forward=False, offload_params=True,
                                                     activation_checkpointing=True)


@pytest.mark.parametrize(("key", "value", "dtype", "named"), [
    ("FSDP_VERSION", "1", "float32", "fsdp_version: 1"),
    ("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP", "float32", "fsdp_auto_wrap_policy: SIZE_BASED_WRAP"),
    ("FSDP_VERSION", "2", "float16", "dtype: float16")])
def test_fsdp_settings_refuse_what_the_backend_cannot_honour(monkeypatch, key, value, dtype, named):
    for name, setting in {**FSDP_LAUNCH, key: value}.items():
        monkeypatch.setenv(name, setting)
    with pytest.raises(UserError) as error:
        fsdp_settings(training(dtype=dtype))
    assert str(error.value).startswith(named) and "\n" not in str(error.value)
