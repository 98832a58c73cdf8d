"""Tool calls through the chat template.

What a template leaves out of its text (tool calls, tool definitions, roles) is refused by `data.py`, `check`,
`train` and `inference` in one line (how many conversations, and the first one's file and line) instead of training
a tool-call turn as an empty answer; found by rendering each conversation again with the part changed. A template
that renders them trains them: the tool call is part of the trained answer.

Tool definitions (`tools`) and tool-call arguments go through clean.py and data.py as OpenAI sends them and reach
the template as it reads them at inference (arguments as the object their JSON string decodes to); for the Llama 3.1,
Qwen2.5, Qwen3 and Mistral templates (tests/support/templates.py) the labels equal a construction from each prefix's
rendering, and the ids before every trained turn are what `serve` encodes for the same conversation.
"""

from __future__ import annotations

import json

import pytest
from support.files import write_jsonl
from support.models import build_tiny_gptj
from support.paths import REPO
from support.templates import (END_OF_TURN, TIME_TOOL, TOOL_FAMILIES, WEATHER_TOOL, expected_example,
                               family_tokenizer, tool_conversation)
from support.tool_calls import TOOL_CHAT_TEMPLATE, tool_conversations

from gpt4all_training.batch import IGNORE
from gpt4all_training.cli.main import main
from gpt4all_training.config.loader import load_config
from gpt4all_training.data.chat import encode_for_generation, tokenized_conversations
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


# ---------------------------------------------------------------- tools and arguments through clean.py and data.py

def test_clean_keeps_tools_in_their_order_and_arguments_as_json_objects(tmp_path):
    """kept + dropped == read; tools come out as they went in (key order included: a template writes them so),
    tools given as a JSON string are decoded once, arguments given as an object are written as the JSON string
    OpenAI sends and decode to it; arguments that are not a JSON object and malformed tools are counted."""
    record = tool_conversation()
    as_objects = json.loads(json.dumps(record))
    for message in as_objects["messages"]:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    sharegpt = {"tools": json.dumps([TIME_TOOL]), "conversations": [
        {"from": "human", "value": "Time in Lima?"},
        {"from": "gpt", "value": "", "tool_calls": [template_call("call00009", "get_time", {"zone": "America/Lima"})]},
        {"from": "tool", "value": "08:00", "tool_call_id": "call00009"}, {"from": "gpt", "value": "It is 08:00."}]}

    def with_arguments(arguments: str) -> dict:
        bad = json.loads(json.dumps(record))
        bad["messages"][2]["tool_calls"][0]["function"]["arguments"] = arguments
        return bad

    rows = [record, as_objects, sharegpt, with_arguments('{"city": "Paris"'), with_arguments('["Paris"]'),
            {**record, "tools": [{"type": "function", "function": {"description": "no name"}}]},
            {**record, "tools": "[{not json"}]
    write_jsonl(tmp_path / "raw" / "calls.jsonl", rows)
    report = clean([str(tmp_path / "raw")], tmp_path / "clean")
    entry = report["files"][str(tmp_path / "raw" / "calls.jsonl")]
    assert entry["dropped"] == {"duplicate": 1, "invalid_tool_arguments": 2, "invalid_tools_json": 1,
                                "malformed_tools": 1}
    assert (entry["read"], entry["kept"]) == (7, entry["read"] - entry["dropped_total"]) == (7, 2)
    lines = (tmp_path / "clean" / "calls_clean.jsonl").read_text().splitlines()
    written = [json.loads(line) for line in lines]
    assert json.dumps(written[0]["tools"]) == json.dumps(record["tools"])  # the same keys in the same order
    assert written[0]["messages"] == record["messages"]  # as_objects is the same conversation: a duplicate
    assert written[1]["tools"] == [TIME_TOOL] and json.dumps(written[1]["tools"]) == json.dumps([TIME_TOOL])
    assert json.loads(written[1]["messages"][1]["tool_calls"][0]["function"]["arguments"]) == {"zone": "America/Lima"}


def template_call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_data_refuses_arguments_that_are_not_a_json_object_naming_file_and_line(chat_tokenizer, tmp_path):
    good = {**tool_conversation(), "source": "t"}
    bad = json.loads(json.dumps(good))
    bad["messages"][6]["tool_calls"][0]["function"]["arguments"] = "{'zone': 'Asia/Tokyo'}"
    write_jsonl(tmp_path / "calls_clean.jsonl", [good, bad])
    config = load_config(CHAT_CONFIG, ["model_name=m", f"dataset_path={tmp_path}"])
    with pytest.raises(UserError) as error:
        load_data(config, chat_tokenizer)
    assert str(error.value) == (f"{tmp_path / 'calls_clean.jsonl'}:2: message 7: tool call 1: its arguments are not "
                                f"valid JSON (Expecting property name enclosed in double quotes at character 1); fix "
                                f"the record, or run clean.py on the raw data, which counts such records as dropped")


def test_tool_definitions_a_template_leaves_out_are_refused(chat_tokenizer, tmp_path):
    """CHAT_TEMPLATE writes every message's content, not the tools: a conversation that offers them would train
    answers to a model that never saw them."""
    rows = [{"messages": PLAIN[0]["messages"], "tools": [WEATHER_TOOL], "source": "t"}] * 2
    write_jsonl(tmp_path / "offers_clean.jsonl", rows)
    config = load_config(CHAT_CONFIG, ["model_name=m", f"dataset_path={tmp_path}", "val_fraction=0"])
    with pytest.raises(UserError) as error:
        load_data(config, chat_tokenizer)
    assert str(error.value) == (f"chat_template: it does not render the tool definitions of 2 conversations (first: "
                                f"{tmp_path / 'offers_clean.jsonl'}:1), so they would train without them; use a chat "
                                f"template that renders them (chat_template: path/to/template.jinja) or leave them out "
                                f"of the data")


# ---------------------------------------------------------------- each family's template: training = serving

# The assistant turns each template trains in tool_conversation(): the turns whose text, and the text before them,
# the whole conversation holds as the template writes them at the end of their own prefix. Qwen3 writes an empty
# <think> block in a last turn only, so only the final answer; Mistral moves the tools to the last user message,
# so only the second round.
TRAINED_TURNS = {"llama3.1": {2, 4, 6, 8}, "qwen2.5": {2, 4, 6, 8}, "qwen3": {8}, "mistral-v0.3": {6, 8}}


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_trained_tokens_are_what_the_serving_path_renders(tokenizer_dir, tmp_path, family):
    """An OpenAI-format conversation with tools and tool calls, through clean.py and data.py: its labels equal the
    construction from each prefix's rendering (arguments given to the template as objects, tools in their own key
    order); and for every trained turn, the ids before it are what `serve` encodes for the same conversation (its
    messages up to that turn, as an OpenAI client sends them), and what generation encodes."""
    from gpt4all_training.serving.chat import chat_encoder, render
    from gpt4all_training.serving.protocol import ChatRequest, parse

    tokenizer = family_tokenizer(tokenizer_dir, family)
    record = tool_conversation()
    if family == "mistral-v0.3":  # its template writes the system message only into a prompt that ends with it
        record["messages"] = record["messages"][1:]
    trained = TRAINED_TURNS[family] if family != "mistral-v0.3" else {k - 1 for k in TRAINED_TURNS[family]}
    write_jsonl(tmp_path / "raw" / "calls.jsonl", [record])
    clean([str(tmp_path / "raw")], tmp_path / "clean")
    config = load_config(CHAT_CONFIG, ["model_name=m", f"dataset_path={tmp_path / 'clean'}", "val_fraction=0",
                                       "max_length=4096"])
    (train, _), _ = load_data(config, tokenizer)
    row = train[0]
    assert (row["input_ids"], row["labels"]) == expected_example(tokenizer, record, trained, END_OF_TURN[family])
    encoder = chat_encoder(tokenizer)
    for k in sorted(trained):
        body = parse(ChatRequest, json.dumps({"model": "m", "messages": record["messages"][:k],
                                              "tools": record["tools"]}).encode())
        served = render(encoder, *body.conversation())
        assert row["input_ids"][:len(served)] == served and row["labels"][len(served)] != IGNORE
        assert row["labels"][len(served) - 1] == IGNORE
        assert encode_for_generation(tokenizer, [record["messages"][:k]], [record["tools"]]) == [served]


def test_arguments_as_a_string_would_be_written_twice_encoded(tokenizer_dir):
    """What the fix is for (Oumi #2599): Llama 3.1's template writes `arguments | tojson`; given the JSON string
    clean.py stores, it writes a quoted, escaped string, which inference never shows the model."""
    tokenizer = family_tokenizer(tokenizer_dir, "llama3.1")
    record = tool_conversation()
    as_stored = tokenizer.apply_chat_template(record["messages"][:3], tools=record["tools"], tokenize=False)
    assert '"parameters": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}"}' in as_stored
    out = tokenized_conversations({"messages": [record["messages"][:5]], "tools": [record["tools"]]}, tokenizer,
                                  4096, "all")
    trained = tokenizer.decode([t for t, label in zip(out["input_ids"][0], out["labels"][0]) if label != IGNORE])
    assert trained == ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>'
                       'It is 18 degrees in Paris.<|eot_id|>')
