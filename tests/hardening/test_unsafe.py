"""Unsafe artefacts: model code shipped in a folder, pickles that run code, and YAML tags that construct objects.

Every payload here would create a marker file or folder if it ran. Each test first shows the payload is refused and
the marker absent, then (the positive control) runs the payload the unsafe way and sees the marker appear: a test
whose payload could never run would prove nothing.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from support.launch import explain
from support.paths import REPO

from gpt4all_training import cli
from gpt4all_training.training.checkpoint import MARKER, load_checkpoint, verify, write_marker
from gpt4all_training.errors import UserError
from gpt4all_training.model.loading import load_model
from gpt4all_training.model.parameters import param_groups

from .harness import error_lines, run_train


class WritesMarker:
    """Unpickling this calls open(marker, "w"): any pickle global could as well be os.system."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


# ---------------------------------------------------------------- model code in the model folder

def folder_with_code(tiny_model_dir: Path, folder: Path, marker: Path, model_type: str) -> Path:
    """The tiny model, plus evil_model.py named by auto_map: importing it writes `marker`."""
    shutil.copytree(tiny_model_dir, folder)
    (folder / "evil_model.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('model code ran')\n"
        "from transformers import GPTJConfig, GPTJForCausalLM\n\n\n"
        f"class EvilConfig(GPTJConfig):\n    model_type = {model_type!r}\n\n\n"
        "class EvilModel(GPTJForCausalLM):\n    config_class = EvilConfig\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type=model_type, architectures=["EvilModel"],
                  auto_map={"AutoConfig": "evil_model.EvilConfig", "AutoModelForCausalLM": "evil_model.EvilModel"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_model_code_is_refused_unless_trust_remote_code_is_set(tiny_model_dir, hard_config, tmp_path, capsys):
    marker = tmp_path / "marker"
    folder = folder_with_code(tiny_model_dir, tmp_path / "custom", marker, "evil_gptj")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", str(hard_config), f"model_name={folder}", f"output_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: model_name {folder}: ships its own Python code (auto_map in its config); set trust_remote_code: "
        f"true only if you have read that code and trust it"]
    assert not marker.exists()
    # The positive control: with trust_remote_code the folder's code runs, and the marker shows it.
    model = load_model(str(folder), trust_remote_code=True)
    assert type(model).__name__ == "EvilModel" and marker.read_text() == "model code ran"


def test_code_next_to_a_known_architecture_is_ignored_without_trust(tiny_model_dir, tmp_path):
    """model_type gptj is built into transformers: without trust_remote_code it loads that class and never imports
    the folder's code (the same weights, the stock modelling)."""
    marker = tmp_path / "marker"
    folder = folder_with_code(tiny_model_dir, tmp_path / "custom", marker, "gptj")
    model = load_model(str(folder))
    assert type(model).__name__ == "GPTJForCausalLM" and not marker.exists()


def test_every_config_leaves_trust_remote_code_off_by_default():
    from gpt4all_training.config.loader import config_fields
    from gpt4all_training.config.schemas import GenerateConfig, InferenceConfig, TrainConfig

    assert {cls.__name__: config_fields(cls)["trust_remote_code"].default
            for cls in (TrainConfig, GenerateConfig, InferenceConfig)} == \
        {"TrainConfig": False, "GenerateConfig": False, "InferenceConfig": False}


# ---------------------------------------------------------------- pickles

def test_pickled_weights_that_run_code_are_refused(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    marker = tmp_path / "marker"
    folder = tmp_path / "bin-model"
    shutil.copytree(tiny_model_dir, folder)
    state_dict = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save({**state_dict, "extra": WritesMarker(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(UserError) as error:
        load_model(str(folder))
    assert str(error.value) == (f"model_name {folder}: a .bin/pickle weights file holds objects other than tensors, "
                                f"and loading them could run code; refused. Use safetensors weights, or a file from "
                                f"a source you trust")
    assert not marker.exists()
    torch.load(folder / "pytorch_model.bin", weights_only=False)  # the positive control
    assert marker.exists()


def tampered_checkpoint(source: Path, folder: Path, name: str, marker: Path) -> Path:
    """A copy of a real checkpoint whose `name` is a pickle that writes `marker`, with checksums recomputed: what
    someone who can write the folder can do, so the checksum cannot be what stops it."""
    shutil.copytree(source, folder)
    torch.save({"state": {}, "payload": WritesMarker(marker)}, folder / name)
    (folder / MARKER).unlink()
    write_marker(folder)
    assert verify(folder) is None
    return folder


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng/rank0.pt"])
def test_checkpoint_pickles_that_run_code_are_refused(nan_stopped, name, tmp_path):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from gpt4all_training.backends.accelerate import backend_for

    _, run = nan_stopped
    marker = tmp_path / "marker"
    folder = tampered_checkpoint(run / "step_2", tmp_path / "step_2", name, marker)
    model = AutoModelForCausalLM.from_pretrained(folder / "model")
    optimizer = torch.optim.AdamW(param_groups(model, 0.0), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(UserError) as error:
        load_checkpoint(folder, backend_for(Accelerator(cpu=True)), model, optimizer, scheduler)
    assert str(error.value) == (f"checkpoint file {folder / name}: holds objects other than tensors, and loading "
                                f"them could run code; refused. Use only checkpoints this program wrote")
    assert not marker.exists()
    torch.load(folder / name, weights_only=False)
    assert marker.exists()


@pytest.mark.integration
@pytest.mark.slow
def test_resuming_from_a_checkpoint_with_a_code_pickle_is_one_line(nan_stopped, hard_config, tmp_path):
    """The same refusal end to end: `train.py checkpoint=PATH` in a real process."""
    _, run = nan_stopped
    marker = tmp_path / "marker"
    folder = tampered_checkpoint(run / "step_2", tmp_path / "ckpt" / "step_2", "optimizer.pt", marker)
    result = run_train(hard_config, tmp_path / "run", f"checkpoint={folder}")
    assert result.returncode == 2, explain(result)
    assert error_lines(result.stderr) == [
        f"error: checkpoint file {folder / 'optimizer.pt'}: holds objects other than tensors, and loading them "
        f"could run code; refused. Use only checkpoints this program wrote"]
    assert "Traceback" not in result.stderr and not marker.exists()


# ---------------------------------------------------------------- YAML

PAYLOADS = {
    "apply": "lr: !!python/object/apply:os.mkdir [{marker}]\n",
    "new": "lr: !!python/object/new:pathlib.Path [{marker}]\n",
    "name": "lr: !!python/name:os.mkdir\n",
    "document tag": "!!python/object/apply:os.mkdir [{marker}]\n",
}


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_yaml_python_tags_in_a_config_are_refused_without_running(payload, tmp_path, capsys):
    marker = tmp_path / "marker"
    text = payload.format(marker=marker)
    path = tmp_path / "c.yaml"
    path.write_text("model_name: m\ndataset_path: d\n" + text if text.startswith("lr") else text)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", str(path)])
    assert exit_info.value.code == 2
    line = 3 if text.startswith("lr") else 1
    assert capsys.readouterr().err == f"error: config {path}: not valid YAML (line {line}); check the syntax\n"
    assert not marker.exists()
    if "apply" in payload:
        yaml.unsafe_load(text)  # the positive control
        assert marker.is_dir()


def test_yaml_python_tag_in_an_override_is_only_text(tmp_path, capsys):
    marker = tmp_path / "marker"
    path = tmp_path / "c.yaml"
    path.write_text("model_name: m\ndataset_path: d\n")
    override = f"lr=!!python/object/apply:os.mkdir [{marker}]"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", str(path), override])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: lr: expected a number, got '{override[3:]}'\n"
    assert not marker.exists()


# ---------------------------------------------------------------- the package's own loading calls

def calls(tree: ast.AST, module: str, function: str) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == function and isinstance(node.func.value, ast.Name) and node.func.value.id == module]


def test_the_package_loads_only_safe_formats():
    """A guard for new code: every torch.load passes weights_only=True; no yaml.load/unsafe_load/full_load, no
    pickle.load(s); nothing hard-codes trust_remote_code=True. (DeepSpeed's own reader, called for ZeRO checkpoints,
    is outside this package; files.check_tensor_files checks its files first.) The one torch.load is
    files.load_tensors."""
    problems = []
    for path in sorted((REPO / "gpt4all_training").rglob("*.py")):
        name = path.relative_to(REPO).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for call in calls(tree, "torch", "load"):
            if not any(k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in call.keywords):
                problems.append(f"{name}:{call.lineno} torch.load without weights_only=True")
        for function in ("load", "unsafe_load", "full_load", "load_all", "unsafe_load_all"):
            problems += [f"{name}:{c.lineno} yaml.{function}" for c in calls(tree, "yaml", function)]
        for function in ("load", "loads"):
            problems += [f"{name}:{c.lineno} pickle.{function}" for c in calls(tree, "pickle", function)]
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code" and \
                    getattr(node.value, "value", None) is True:
                problems.append(f"{name}:{node.value.lineno} trust_remote_code=True")
    assert problems == []
    # One reader of torch files, files.load_tensors: every other module loads tensors through it.
    loaders = [path.relative_to(REPO).as_posix() for path in sorted((REPO / "gpt4all_training").rglob("*.py"))
               for _ in calls(ast.parse(path.read_text(encoding="utf-8")), "torch", "load")]
    assert loaders == ["gpt4all_training/files.py"]
