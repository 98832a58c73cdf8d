"""Every config shipped under configs/ is valid as written, and what it names resolves offline: a packaged model's
short name to its file, a local path to a file of the repository or to what another shipped step writes (a training
config's output_dir/final, a tokenizer config's output_dir, the folder clean.py writes in the command its comment
shows). The tiny and SmolLM2 configs name nothing on the Hub, so they run offline as written; only the configs of
the original GPT-J and CodeParrot runs name Hub models and datasets. Cheap: no model is loaded, nothing trains."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml
from support.paths import DOLLY, OASST, REPO

from gpt4all_training.cli.offline import SOURCE_KEYS, named_sources, task_files, tasks_are_local
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import GenerateConfig, InferenceConfig, TokenizerConfig, TrainConfig
from gpt4all_training.model.names import PACKAGED_MODELS, packaged_model
from gpt4all_training.paths import looks_like_path

KINDS = {"train": TrainConfig, "generate": GenerateConfig, "inference": InferenceConfig, "tokenizer": TokenizerConfig}
CONFIGS = sorted(path.relative_to(REPO) for kind in KINDS for path in (REPO / "configs" / kind).glob("*.yaml"))
# The configs of the original runs: GPT-J-6B and its data, CodeParrot's data; they need the Hub by design.
HUB_CONFIGS = {"finetune_gptj.yaml", "finetune_gptj_lora.yaml", "gptj.yaml", "codeparrot.yaml"}
CLEAN_OUTPUT = re.compile(r"clean\.py .*--output-dir (\S+)")


def load(path: Path):
    return load_config(REPO / path, cls=KINDS[path.parts[1]])


def written_by_shipped_steps() -> dict[str, str]:
    """{local path: the shipped step that writes it}."""
    written = {}
    for path in CONFIGS:
        config = load(path)
        if isinstance(config, TrainConfig):
            written[os.path.normpath(f"{config.output_dir}/final")] = str(path)
            if config.merge_lora:
                written[os.path.normpath(f"{config.output_dir}/final/merged")] = str(path)
        if isinstance(config, TokenizerConfig):
            written[os.path.normpath(config.output_dir)] = str(path)
        for folder in CLEAN_OUTPUT.findall((REPO / path).read_text()):
            written[os.path.normpath(folder)] = f"clean.py in {path}'s comment"
    return written


def test_every_kind_of_config_is_shipped():
    assert {path.parts[1] for path in CONFIGS} == set(KINDS)
    assert {"finetune_tiny.yaml", "smollm2_lora.yaml", "chat_tiny.yaml", "dpo_tiny.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=str)
def test_a_shipped_config_is_valid_and_what_it_names_resolves(path):
    config = load(path)
    written = written_by_shipped_steps()
    for key in SOURCE_KEYS:
        name = getattr(config, key, None)
        if not name or (key == "model_config" and "/" not in name):  # a model type such as gptj
            continue
        if name in PACKAGED_MODELS:
            assert packaged_model(name).is_file(), (key, name)
        elif looks_like_path(name) or path.name not in HUB_CONFIGS:
            local = os.path.normpath(name)
            assert (REPO / local).exists() or local in written, f"{path}: {key} {name}: nothing ships or writes it"
            assert written.get(local) != str(path), f"{path}: {key} {name} is its own output"


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.name not in HUB_CONFIGS], ids=str)
def test_the_tiny_and_smollm2_configs_run_offline_as_written(path):
    """The CLI sets HF_HUB_OFFLINE for them (everything they name is local), so nothing waits on the Hub."""
    assert named_sources([path.parts[1], "--config", str(REPO / path)]) is not None


def test_the_readme_rows_that_failed_now_name_only_local_things():
    """`data.py --config configs/train/finetune_tiny.yaml --show 3` gave `model_name: missing`, and `generate.py
    --config configs/generate/tiny.yaml --prompt ...` looked for ckpts/tiny/final, which nothing had written."""
    assert named_sources(["data", "--config", str(REPO / "configs/train/finetune_tiny.yaml"), "--show", "3"]) == [
        "smollm2", "./data/clean"]
    assert named_sources(["generate", "--config", str(REPO / "configs/generate/tiny.yaml"), "--prompt", "Hi"]) == [
        "smollm2"]


# The fine-tuning configs as their comments show them: the data clean.py writes into the folder they name, from the
# shared samples (Dolly as the user's prompt/response file, OpenAssistant as conversations and as preference pairs).
MADE_FOR = {"./data/clean": (DOLLY, {}), "./data/oasst": (OASST, {}),
            "./data/oasst-pairs": (OASST, {"oasst_preferences": True})}
SAMPLE_LINES = {DOLLY: 240, OASST: 40}  # slices: seconds, not minutes, to tokenise; fractions like the whole files'
FINE_TUNING = [path for path in CONFIGS if path.parts[1] == "train" and path.name not in HUB_CONFIGS
               and load(path).objective != "causal_lm"]  # raw text is cut into rows, never truncated


@pytest.fixture(scope="module")
def shipped_data(tmp_path_factory) -> dict[str, Path]:
    from gpt4all_training.data.clean import clean

    root = tmp_path_factory.mktemp("shipped-data")
    folders = {}
    for name, (sample, options) in MADE_FOR.items():
        raw = root / "raw" / sample.name
        if not raw.exists():
            raw.parent.mkdir(parents=True, exist_ok=True)
            with open(sample, encoding="utf-8") as f:
                raw.write_text("".join(line for line, _ in zip(f, range(SAMPLE_LINES[sample]))), encoding="utf-8")
        clean([str(raw)], root / name, **options)
        folders[name] = root / name
    return folders


@pytest.mark.slow
@pytest.mark.parametrize("path", FINE_TUNING, ids=str)
def test_a_shipped_config_cuts_fewer_than_half_of_the_answers_it_trains(path, shipped_data, smollm2_tokenizer):
    """max_length fits the data each config is made for: dpo_tiny's 128 cut 83% of OpenAssistant's answers."""
    from gpt4all_training.data.pairs import load_pair_data, load_preference_records
    from gpt4all_training.data.sft import load_data

    config = load(path)
    assert config.model_name == "smollm2"  # smollm2_tokenizer is its tokenizer
    config = load_config(REPO / path, [f"dataset_path={shipped_data[config.dataset_path]}", "val_fraction=0"])
    if config.objective == "dpo":
        _, (stats, _) = load_pair_data(config, smollm2_tokenizer, load_preference_records(config.dataset_path))
    else:
        _, (stats, _) = load_data(config, smollm2_tokenizer)
    assert stats.count > 100 and stats.truncated_response < stats.count / 2, stats.describe(str(path))


def test_the_other_shipped_files_parse():
    """accelerate and DeepSpeed configs, and the offline evaluation tasks (whose data is built in Python)."""
    for path in sorted((REPO / "configs" / "accelerate").glob("*.yaml")):
        assert isinstance(yaml.safe_load(path.read_text()), dict), path
    for path in sorted((REPO / "configs" / "deepspeed").glob("*.json")):
        assert isinstance(json.loads(path.read_text()), dict), path
    tasks = task_files([str(REPO / "configs" / "eval")])
    assert len(tasks) == len(list((REPO / "configs" / "eval").glob("*.yaml"))) == 3
    assert all(task["task"].startswith("gpt4all_") and "custom_dataset" in task for task in tasks)
    assert tasks_are_local(["gpt4all_offline"], [str(REPO / "configs" / "eval")])
