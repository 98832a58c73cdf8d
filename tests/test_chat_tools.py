"""Tool calls and roles a chat template leaves out of its text: `data.py`, `check`, `train` and `inference` refuse
them in one line (how many conversations, and the first one's file and line) instead of training a tool-call turn
as an empty answer. Found by rendering each conversation again with the part changed: a template that ignores a part renders
the same text. A template that renders them trains them: the tool call is part of the trained answer."""

from __future__ import annotations

import pytest
from support.files import write_jsonl
from support.models import build_tiny_gptj
from support.paths import REPO
from support.tool_calls import TOOL_CHAT_TEMPLATE, tool_conversations

from gpt4all_training.batch import IGNORE
from gpt4all_training.cli.main import main
from gpt4all_training.config.loader import load_config
from gpt4all_training.data.chat import tokenized_conversations
from gpt4all_training.data.clean import clean
from gpt4all_training.data.sft import load_data
from gpt4all_training.errors import UserError

CHAT_CONFIG = REPO / "configs" / "train" / "chat_tiny.yaml"
INFERENCE_CONFIG = REPO / "configs" / "inference" / "tiny.yaml"
PLAIN = [{"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]}] * 2
# A template that writes user, assistant and system turns and skips any other role.
NO_TOOL_ROLE = ("{% for message in messages %}{% if message['role'] in ['system', 'user', 'assistant'] %}"
                "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tool_data(tmp_path_factory):
    """clean.py's folder: two plain conversations, then the four tool conversations (the first on line 3)."""
    folder = tmp_path_factory.mktemp("tool-data")
    write_jsonl(folder / "raw" / "tools.jsonl", [PLAIN[0], {"messages": [*PLAIN[0]["messages"],
                                                                         {"role": "user", "content": "More?"},
                                                                         {"role": "assistant", "content": "Blue."}]},
                                                 *tool_conversations()])
    clean([str(folder / "raw")], folder / "clean")
    return folder / "clean"


def model_folder(chat_tokenizer, template: str | None, folder):
    """A tiny GPT-J with the chat tokenizer, whose template is `template` (None: CHAT_TEMPLATE, like SmolLM2's, which
    writes each message's content only)."""
    from gpt4all_training.model.loading import load_tokenizer

    tokenizer = load_tokenizer(chat_tokenizer.name_or_path)
    if template:
        tokenizer.chat_template = template
    build_tiny_gptj(tokenizer, seed=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def one_error_line(capsys, args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def refusal(tool_data, part: str) -> str:
    return (f"chat_template: it does not render the {part} of 4 conversations (first: "
            f"{tool_data / 'tools_clean.jsonl'}:3), so they would train without them; use a chat template that "
            f"renders them (chat_template: path/to/template.jinja) or leave them out of the data")


@pytest.mark.integration
@pytest.mark.slow
def test_data_py_and_train_refuse_tool_calls_the_template_drops(chat_tokenizer, tool_data, tmp_path, capsys):
    model = model_folder(chat_tokenizer, None, tmp_path / "model")
    capsys.readouterr()
    overrides = [f"model_name={model}", f"dataset_path={tool_data}", f"output_dir={tmp_path / 'run'}"]
    expected = "error: " + refusal(tool_data, "tool calls")
    assert one_error_line(capsys, ["data", "--config", CHAT_CONFIG, *overrides]) == expected
    assert one_error_line(capsys, ["train", "--config", CHAT_CONFIG, *overrides]) == expected
    assert not (tmp_path / "run" / "final").exists()
    scoring = [f"model_name={model}", f"dataset_path={tool_data}", f"output_dir={tmp_path / 'scores'}"]
    assert one_error_line(capsys, ["inference", "--config", INFERENCE_CONFIG, *scoring]) == expected
    assert not (tmp_path / "scores" / "inference.parquet").exists()


def test_a_role_the_template_skips_is_refused(chat_tokenizer, tool_data):
    from gpt4all_training.model.loading import load_tokenizer

    tokenizer = load_tokenizer(chat_tokenizer.name_or_path)
    tokenizer.chat_template = NO_TOOL_ROLE.replace("{{ message['content'] }}", "{{ message['content'] }}"
                                                   "{{ message.get('tool_calls') or '' }}")
    config = load_config(CHAT_CONFIG, ["model_name=m", f"dataset_path={tool_data}"])
    with pytest.raises(UserError) as error:
        load_data(config, tokenizer)
    assert str(error.value) == refusal(tool_data, "'tool' messages")


def test_check_fails_in_one_line_before_the_dry_run(chat_tokenizer, tool_data, tmp_path):
    from gpt4all_training.preflight.check import run_checks

    model = model_folder(chat_tokenizer, None, tmp_path / "model")
    config = tmp_path / "c.yaml"
    config.write_text(f"model_name: {model}\ndataset_path: {tool_data}\noutput_dir: {tmp_path / 'out'}\n"
                      f"max_length: 128\nbatch_size: 2\nnum_proc: 1\n")
    lines = {o.name: o.line() for o in run_checks(str(config), [], report=lambda line: None)}
    assert lines["chat template"] == "FAIL  chat template: " + refusal(tool_data, "tool calls")
    assert "dry run" not in lines


@pytest.mark.integration
def test_a_template_that_renders_tool_calls_trains_them(chat_tokenizer, tool_data, tmp_path):
    from gpt4all_training.preflight.check import run_checks

    model = model_folder(chat_tokenizer, TOOL_CHAT_TEMPLATE, tmp_path / "model")
    config = tmp_path / "c.yaml"
    config.write_text(f"model_name: {model}\ndataset_path: {tool_data}\noutput_dir: {tmp_path / 'out'}\n"
                      f"max_length: 128\nbatch_size: 2\nnum_proc: 1\n")
    lines = {o.name: o.line() for o in run_checks(str(config), [], report=lambda line: None)}
    assert lines["chat template"] == "ok    chat template: renders every message and tool call of 6 conversations"
    assert all(line.startswith("ok") for line in lines.values()), lines

    from gpt4all_training.model.loading import load_tokenizer
    tokenizer = load_tokenizer(str(model))
    out = tokenized_conversations({"messages": [tool_conversations()[0]["messages"]]}, tokenizer, 256, "all")
    trained = [tokenizer.decode([t for t, label in zip(out["input_ids"][0], out["labels"][0]) if label != IGNORE])]
    assert trained == ['<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>'
                       'In Paris: 18 C, sunny.<|im_end|>']


@pytest.mark.slow
def test_smollm2_template_drops_tool_calls_and_they_are_refused(smollm2_tokenizer, tool_data):
    config = load_config(CHAT_CONFIG, ["model_name=m", f"dataset_path={tool_data}"])
    with pytest.raises(UserError) as error:
        load_data(config, smollm2_tokenizer)
    assert str(error.value) == refusal(tool_data, "tool calls")
