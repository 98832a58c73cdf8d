"""The README's loop on conversation data: clean.py -> inference -> curate -> data/train on the curated folder.
curate writes each kept record exactly as clean.py wrote it, so the curated dataset trains on the same tokens as the
records it kept (OpenAssistant threads with "train": false turns, tool calls with `name` and `tool_call_id`)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from support.files import read_jsonl, write_jsonl
from support.models import build_tiny_gptj
from support.paths import OASST, REPO
from support.tool_calls import TOOL_CHAT_TEMPLATE, tool_conversations

from gpt4all_training.analysis.curation.curate import REMOVED_FILE, CurateOptions, curate
from gpt4all_training.analysis.inference import run_inference
from gpt4all_training.cli.main import main
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import InferenceConfig
from gpt4all_training.data.clean import clean
from gpt4all_training.data.records import load_records
from gpt4all_training.data.sft import finish_split, load_data, tokenize_dataset

CHAT_CONFIG = REPO / "configs" / "train" / "chat_tiny.yaml"


@pytest.fixture(scope="module")
def tool_model_dir(chat_tokenizer, tmp_path_factory):
    """A tiny GPT-J over the chat tokenizer with a template that renders tool calls."""
    from gpt4all_training.model.loading import load_tokenizer

    tokenizer = load_tokenizer(chat_tokenizer.name_or_path)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    folder = tmp_path_factory.mktemp("tool-chat-gptj")
    build_tiny_gptj(tokenizer, seed=3).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.integration
def test_a_curated_conversation_dataset_trains_on_the_tokens_of_the_records_it_kept(tool_model_dir, tmp_path,
                                                                                    capsys):
    from gpt4all_training.model.loading import load_tokenizer

    oasst_trees = [json.loads(line) for line in OASST.read_text().splitlines()[:3]]
    write_jsonl(tmp_path / "raw.jsonl", oasst_trees + tool_conversations())
    clean([str(tmp_path / "raw.jsonl")], tmp_path / "clean")
    clean_lines = (tmp_path / "clean" / "raw_clean.jsonl").read_text().splitlines()
    assert any('"train": false' in line for line in clean_lines) and any("tool_call_id" in line for line in clean_lines)

    run = run_inference(validate(InferenceConfig(model_name=str(tool_model_dir), dataset_path=str(tmp_path / "clean"),
                                                 output_dir=str(tmp_path / "inference"), max_length=128,
                                                 val_fraction=0.25, seed=0, batch_size=8, num_proc=1)))
    report = curate(run.parent, tmp_path / "curated", CurateOptions(loss_above=0.75))
    assert report["dropped_total"] > 0 and report["kept"] + report["dropped_total"] == report["read"]
    dropped = {r["index"] for r in read_jsonl(tmp_path / "curated" / REMOVED_FILE)}
    scored = sorted(pq.read_table(run, columns=["index"]).column("index").to_pylist())
    kept = [i for i in scored if i not in dropped]

    # Each kept record, byte for byte as clean.py wrote it.
    assert (tmp_path / "curated" / "curated_clean.jsonl").read_text().splitlines() == [clean_lines[i] for i in kept]

    # The command a user runs next, on the curated folder.
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "--config", str(CHAT_CONFIG), f"model_name={tool_model_dir}",
              f"dataset_path={tmp_path / 'curated'}", "--show", "0"])
    assert exit_info.value.code == 0, capsys.readouterr()
    assert f"train: {len(kept)} examples" in capsys.readouterr().out

    # The same input ids and labels as the uncurated records it kept.
    tokenizer = load_tokenizer(str(tool_model_dir))
    config = load_config(CHAT_CONFIG, [f"model_name={tool_model_dir}", f"dataset_path={tmp_path / 'curated'}"])
    (curated, _), _ = load_data(config, tokenizer)
    original, _ = finish_split(tokenize_dataset(load_records(str(tmp_path / "clean")).select(kept), tokenizer,
                                                config.max_length, "chat", None))
    assert len(curated) == len(kept)
    assert curated["input_ids"] == original["input_ids"] and curated["labels"] == original["labels"]
