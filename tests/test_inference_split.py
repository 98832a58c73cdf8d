"""`inference` takes the train/validation split settings (seed, val_fraction) from the training run that wrote the
model when neither its config file nor the command line gives them, and refuses only a value the user wrote that
contradicts the run: the shipped configs/inference/tiny.yaml scores a run of any val_fraction, such as the quick
start's (0.05, where finetune_tiny.yaml holds out 0.1)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import yaml
from support.files import write_jsonl
from support.paths import REPO

from gpt4all_training.analysis.inference import check_training_split
from gpt4all_training.cli.inference import with_training_split
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.loader import load_config, save_config
from gpt4all_training.config.schemas import InferenceConfig, TrainConfig
from gpt4all_training.errors import UserError

SHIPPED = sorted((REPO / "configs" / "inference").glob("*.yaml"))


def training_run(folder, **values):
    """folder/final/config.yaml as a training run writes it; returns final/."""
    final = folder / "final"
    final.mkdir(parents=True)
    save_config(validate(TrainConfig(model_name="m", dataset_path="d", **values)), final / "config.yaml")
    return final


def test_split_settings_nobody_wrote_are_the_runs(tmp_path):
    final = training_run(tmp_path, seed=7, val_fraction=0.25)
    config = load_config(None, [f"model_name={final}", "dataset_path=d"], cls=InferenceConfig)
    resolved = with_training_split(config, {"model_name", "dataset_path"})
    assert (resolved.seed, resolved.val_fraction) == (7, 0.25)
    check_training_split(resolved)  # what run_inference checks first: nothing to refuse


def test_a_split_setting_the_user_wrote_stays_and_a_contradiction_is_refused(tmp_path):
    final = training_run(tmp_path, seed=7, val_fraction=0.25)
    config = load_config(None, [f"model_name={final}", "dataset_path=d", "val_fraction=0.1"], cls=InferenceConfig)
    resolved = with_training_split(config, {"model_name", "dataset_path", "val_fraction"})
    assert (resolved.seed, resolved.val_fraction) == (7, 0.1)
    with pytest.raises(UserError, match=r"^model_name .*: its training run split the data with val_fraction=0\.25 "
                                        r".*but this config has val_fraction=0\.1, .*; set val_fraction=0\.25$"):
        check_training_split(resolved)
    agreeing = load_config(None, [f"model_name={final}", "dataset_path=d", "seed=7"], cls=InferenceConfig)
    assert with_training_split(agreeing, {"model_name", "dataset_path", "seed"}).val_fraction == 0.25


def test_a_model_no_training_run_wrote_keeps_the_configs_values(tmp_path):
    config = load_config(None, [f"model_name={tmp_path}", "dataset_path=d"], cls=InferenceConfig)
    assert with_training_split(config, {"model_name", "dataset_path"}) == config


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_the_shipped_inference_configs_leave_the_split_to_the_run(path):
    assert not {"seed", "val_fraction"} & set(yaml.safe_load(path.read_text()))


@pytest.mark.integration
def test_the_shipped_tiny_config_scores_a_run_that_held_out_another_fraction(tiny_model_dir, tmp_path, capsys):
    """The quick start's situation: a run with val_fraction 0.05 scored with configs/inference/tiny.yaml as shipped,
    the model and data named on the command line; the split column is the run's."""
    from gpt4all_training.cli.main import main
    from gpt4all_training.data.sft import load_data
    from gpt4all_training.model.loading import load_tokenizer
    from gpt4all_training.training.loop import train

    rows = [{"source": "t", "prompt": f"Question {i}: what is {i} plus {i}?", "response": f"It is {2 * i}."}
            for i in range(40)]
    data = write_jsonl(tmp_path / "data" / "sums_clean.jsonl", rows).parent
    run = validate(TrainConfig(model_name=str(tiny_model_dir), dataset_path=str(data), output_dir=str(tmp_path / "run"),
                               max_length=64, batch_size=4, seed=3, val_fraction=0.05, max_steps=1, eval_every=None,
                               save_every=None, num_proc=1, dtype="float32"))
    train(run)
    with pytest.raises(SystemExit) as exit_info:
        main(["inference", "--config", str(REPO / "configs" / "inference" / "tiny.yaml"),
              f"model_name={tmp_path / 'run' / 'final'}", f"dataset_path={data}", f"output_dir={tmp_path / 'scores'}",
              "max_length=64"])
    assert exit_info.value.code == 0, capsys.readouterr().err
    scored = pq.read_table(tmp_path / "scores" / "inference.parquet", columns=["split", "index"]).to_pydict()
    (_, val), _ = load_data(run, load_tokenizer(str(tiny_model_dir)))
    held_out = [i for s, i in zip(scored["split"], scored["index"]) if s == "val"]
    assert held_out == sorted(val["index"]) and len(held_out) == 2  # round(40 * 0.05); the file's 0.1 would hold 4
