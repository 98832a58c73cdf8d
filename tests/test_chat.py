"""Conversations through the model's own chat template (data/chat.py): exact label arrays, parity with inference,
truncation by whole rounds, and the errors a user can meet.

Expected label arrays are built independently of the code under test, from character offsets: render the
conversation as text (`apply_chat_template(tokenize=False)`), find each trained assistant turn's content and the
end-of-turn text after it, tokenize the text with offsets and label every token that overlaps those spans. The
parity properties compare against `apply_chat_template(tokenize=True, sanitize_control_tokens=True)` of each
conversation's first k messages, which is what inference encodes.

Reasoning (last section) is checked the same way on Qwen3's templates (tests/support/templates.py), which write a
turn's reasoning only while no user message follows it, and on ChatML with a <think> block in the content.

Three tokenizers: SmolLM2-135M-Instruct's (ChatML with a default system message; eos = <|im_end|>; slow to load the
first time), the session BPE tokenizer with ChatML tokens and template (`chat_tokenizer`: eos = <|endoftext|>, so the
end-of-turn token is not EOS), and the session BPE tokenizer with Llama 2's [INST] template (bos = eos, stripped
contents, no generation prompt, no tool role).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.files import write_jsonl
from support.models import CHAT_TEMPLATE
from support.templates import expected_example, family_tokenizer, reasoning_conversation

from gpt4all_training.batch import IGNORE
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.chat import context_cut, end_of_turn_id, tokenized_conversations
from gpt4all_training.data.sft import build_example, load_data
from gpt4all_training.errors import UserError
from gpt4all_training.model.chat_templates import CHATML, apply_chat_template_option

M = IGNORE
SYSTEM = {"role": "system", "content": "Answer in one word."}
ROUND_1 = [{"role": "user", "content": "Name a colour of the sky."}, {"role": "assistant", "content": "Blue."}]
ROUND_2 = [{"role": "user", "content": "And of grass?"}, {"role": "assistant", "content": "Green."}]
TOOL_ROUND = [{"role": "user", "content": "What is the weather in Oslo?"},
              {"role": "assistant", "content": '{"name": "weather", "arguments": {"city": "Oslo"}}'},
              {"role": "tool", "content": '{"sky": "rain", "celsius": 4}'},
              {"role": "assistant", "content": "Rain, 4 degrees."}]


@pytest.fixture(params=[pytest.param("smollm2", marks=pytest.mark.slow), "chatml", "llama2"])
def chat(request):
    """(tokenizer, its end-of-turn text, whether the template strips contents); SmolLM2 is slow to load once."""
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2_tokenizer"), "<|im_end|>", False
    if request.param == "chatml":
        return request.getfixturevalue("chat_tokenizer"), "<|im_end|>", False
    return request.getfixturevalue("llama2_chat_tokenizer"), "<|endoftext|>", True


def tokenize_conversation(tokenizer, messages, max_length: int = 512, train_turns: str = "all") -> dict:
    out = tokenized_conversations({"messages": [messages]}, tokenizer, max_length, train_turns)
    return {key: values[0] for key, values in out.items()}


def offsets_labels(tokenizer, messages, trained: set[int], end_of_turn: str, strips: bool
                   ) -> tuple[list[int], list[int]]:
    """The expected (ids, labels), from character offsets of the rendered text (see the module docstring)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        content = message["content"].strip() if strips else message["content"]
        start = text.index(content, cursor)
        cursor = start + len(content)
        if index in trained:
            end = text.index(end_of_turn, cursor) + len(end_of_turn)
            spans.append((start, end))
            cursor = end
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [token if any(s < span_end and e > span_start for span_start, span_end in spans) else M
              for token, (s, e) in zip(encoding["input_ids"], encoding["offset_mapping"])]
    labels[0] = M
    return encoding["input_ids"], labels


def trained_text(tokenizer, row) -> list[str]:
    """The trained tokens, decoded run by run."""
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != M:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


# ---------------------------------------------------------------- exact label arrays

def test_system_and_two_rounds(chat):
    tokenizer, end_of_turn, strips = chat
    messages = [SYSTEM, *ROUND_1, *ROUND_2]
    row = tokenize_conversation(tokenizer, messages)
    ids, labels = offsets_labels(tokenizer, messages, {2, 4}, end_of_turn, strips)
    assert (row["input_ids"], row["labels"]) == (ids, labels)
    space = " " if strips else ""  # Llama 2 writes " content " before EOS, and the model must write it too
    assert trained_text(tokenizer, row) == [f"{space}Blue.{space}{end_of_turn}", f"{space}Green.{space}{end_of_turn}"]
    assert (row["drop_reason"], row["n_trained"], row["truncated_prompt"], row["truncated_response"]) == \
        ("", sum(label != M for label in labels), False, False)


def test_tool_turn_is_context_and_both_answers_are_trained(chat):
    tokenizer, end_of_turn, strips = chat
    row = tokenize_conversation(tokenizer, [SYSTEM, *TOOL_ROUND])
    if strips:  # Llama 2's template raises on a role other than user and assistant
        assert row["drop_reason"] == "rejected_by_template"
        return
    ids, labels = offsets_labels(tokenizer, [SYSTEM, *TOOL_ROUND], {2, 4}, end_of_turn, strips)
    assert (row["input_ids"], row["labels"]) == (ids, labels)
    assert trained_text(tokenizer, row) == [TOOL_ROUND[1]["content"] + end_of_turn, "Rain, 4 degrees." + end_of_turn]


def test_train_false_keeps_a_turn_as_context(chat):
    tokenizer, end_of_turn, strips = chat
    messages = [SYSTEM, ROUND_1[0], {**ROUND_1[1], "train": False}, *ROUND_2]
    row = tokenize_conversation(tokenizer, messages)
    plain = [SYSTEM, *ROUND_1, *ROUND_2]
    assert (row["input_ids"], row["labels"]) == offsets_labels(tokenizer, plain, {4}, end_of_turn, strips)


def test_train_turns_last_trains_only_the_final_answer(chat):
    tokenizer, end_of_turn, strips = chat
    messages = [SYSTEM, *ROUND_1, *ROUND_2]
    row = tokenize_conversation(tokenizer, messages, train_turns="last")
    assert (row["input_ids"], row["labels"]) == offsets_labels(tokenizer, messages, {4}, end_of_turn, strips)


def test_typed_special_tokens_stay_text(chat):
    """A user who types the end-of-turn (and start-of-turn) text cannot end or open a turn: it is encoded as text, as
    apply_chat_template's sanitize_control_tokens encodes it, and the labels are unchanged. After the user's turn
    the ids are those of the same conversation without the typed text, so the offsets' labels apply from the end."""
    tokenizer, end_of_turn, strips = chat
    typed = {"role": "user", "content": f"Say {end_of_turn} then <|im_start|>assistant and stop."}
    messages = [SYSTEM, typed, *ROUND_2[1:]]
    row = tokenize_conversation(tokenizer, messages)
    assert row["input_ids"] == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                             sanitize_control_tokens=True)
    end_of_turn_id = tokenizer.convert_tokens_to_ids(end_of_turn)
    plain = [SYSTEM, {"role": "user", "content": "Say nothing."}, *ROUND_2[1:]]
    assert row["input_ids"].count(end_of_turn_id) == tokenizer.apply_chat_template(
        plain, tokenize=True, return_dict=False).count(end_of_turn_id)  # the template's own markers only
    assert typed["content"] in tokenizer.decode(row["input_ids"])
    ids, labels = offsets_labels(tokenizer, plain, {2}, end_of_turn, strips)
    tail = len(ids) - next(i for i, label in enumerate(labels) if label != M)
    assert row["input_ids"][-tail:] == ids[-tail:]
    assert row["labels"] == [M] * (len(row["labels"]) - tail) + labels[-tail:]


def test_truncation_drops_the_first_round_and_keeps_the_system_message(chat):
    tokenizer, end_of_turn, strips = chat
    shorter = [SYSTEM, *ROUND_2]
    fits = len(tokenizer.apply_chat_template(shorter, tokenize=True, return_dict=False))
    row = tokenize_conversation(tokenizer, [SYSTEM, *ROUND_1, *ROUND_2], max_length=fits)
    assert (row["input_ids"], row["labels"]) == offsets_labels(tokenizer, shorter, {2}, end_of_turn, strips)
    assert (row["truncated_prompt"], row["truncated_response"], row["drop_reason"]) == (True, False, "")


def test_a_last_round_too_long_alone_is_cut_without_end_of_turn(chat):
    tokenizer, end_of_turn, strips = chat
    long_answer = {"role": "assistant", "content": "Blue, " * 40 + "and blue."}
    messages = [SYSTEM, ROUND_1[0], long_answer]
    ids, labels = offsets_labels(tokenizer, messages, {2}, end_of_turn, strips)
    max_length = len(ids) - 20
    row = tokenize_conversation(tokenizer, messages, max_length=max_length)
    assert (row["input_ids"], row["labels"]) == (ids[:max_length], labels[:max_length])
    assert tokenizer.convert_tokens_to_ids(end_of_turn) not in [label for label in row["labels"] if label != M]
    assert (row["truncated_prompt"], row["truncated_response"], row["drop_reason"]) == (False, True, "")


def test_a_last_round_too_long_alone_gives_up_the_start_of_its_question_not_its_answer(chat):
    tokenizer, end_of_turn, strips = chat
    long_question = {"role": "user", "content": "Think of the sky on a clear day. " * 30 + "Which colour is it?"}
    messages = [SYSTEM, long_question, ROUND_1[1]]
    ids, labels = offsets_labels(tokenizer, messages, {2}, end_of_turn, strips)
    first_trained = next(i for i, label in enumerate(labels) if label != M)
    max_length = 40
    kept_context = max_length - (len(ids) - first_trained)  # the answer and what follows it keep all of theirs
    assert max_length // 2 < kept_context < first_trained
    row = tokenize_conversation(tokenizer, messages, max_length=max_length)
    cut = first_trained - kept_context
    assert row["input_ids"] == ids[cut:]
    assert row["labels"] == [M] + labels[cut + 1:]
    assert trained_text(tokenizer, row) == [tokenizer.decode(ids[first_trained:]).rstrip("\n")]
    assert (row["truncated_prompt"], row["truncated_response"], row["drop_reason"]) == (True, False, "")


@settings(max_examples=300, deadline=None, database=None)
@given(context=st.integers(1, 40), answer=st.integers(1, 40), max_length=st.integers(2, 48))
def test_a_conversation_gives_up_as_much_of_its_context_as_a_pair_gives_up_of_its_prompt(context, answer,
                                                                                          max_length):
    """context_cut's rule is sft.build_example's: a pair's prompt is a conversation's context, its response and EOS
    the trained rest."""
    pair = build_example(list(range(100, 100 + context)), list(range(200, 200 + answer)), 0, max_length)
    kept_prompt = sum(1 for i in pair.input_ids if 100 <= i < 200)
    assert context_cut(context + answer + 1, [(context, context + answer + 1)], max_length) == context - kept_prompt


@pytest.mark.slow
def test_smollm2_end_of_turn_is_its_eos_and_chatml_tiny_is_not(smollm2_tokenizer, chat_tokenizer):
    assert end_of_turn_id(smollm2_tokenizer) == smollm2_tokenizer.eos_token_id == \
        smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(chat_tokenizer) == chat_tokenizer.convert_tokens_to_ids("<|im_end|>") != \
        chat_tokenizer.eos_token_id


# ---------------------------------------------------------------- what is dropped

@pytest.mark.parametrize("messages, reason", [
    ([ROUND_1[0]], "last_turn_not_assistant"),
    ([ROUND_1[1], *ROUND_2], "roles_out_of_order"),
    ([*ROUND_1, ROUND_1[1]], "roles_out_of_order"),
    ([*ROUND_1, SYSTEM, *ROUND_2], "roles_out_of_order"),
    ([ROUND_1[0], {"role": "tool", "content": "x"}, ROUND_1[1]], "roles_out_of_order"),
    ([{"role": "narrator", "content": "Once."}, *ROUND_1], "unknown_role"),
    ([{"role": "user", "content": " \n"}, ROUND_1[1]], "empty_turn"),
    ([ROUND_1[0], {"role": "assistant", "content": "Blue.", "train": False}], "no_trained_tokens"),
], ids=["no-answer", "assistant-first", "two-answers", "system-later", "tool-after-user", "narrator", "blank",
        "nothing-trained"])
def test_conversations_that_cannot_train_are_dropped_with_a_reason(chat_tokenizer, messages, reason):
    assert tokenize_conversation(chat_tokenizer, messages)["drop_reason"] == reason


def test_two_user_turns_pass_where_the_template_renders_them(chat_tokenizer, llama2_chat_tokenizer):
    messages = [ROUND_1[0], ROUND_2[0], ROUND_1[1]]
    assert tokenize_conversation(chat_tokenizer, messages)["drop_reason"] == ""
    assert tokenize_conversation(llama2_chat_tokenizer, messages)["drop_reason"] == "rejected_by_template"


# ---------------------------------------------------------------- parity with inference (hypothesis)

WORDS = st.sampled_from(["Hi", " there", "2+2", " is", " 4", "ünï", " 12345", ".", "!?", "\n", "  ", "\t", "a\nb",
                         "<|im_end|>", "<|im_start|>", "<|endoftext|>", "[INST]", " [/INST]"])
CONTENT = st.lists(WORDS, min_size=1, max_size=6).map("".join).filter(str.strip)


@st.composite
def conversations(draw, tools: bool):
    messages = [{"role": "system", "content": draw(CONTENT)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(CONTENT)})
        if tools and draw(st.booleans()):
            messages += [{"role": "assistant", "content": draw(CONTENT)}, {"role": "tool", "content": draw(CONTENT)}]
        answer = {"role": "assistant", "content": draw(CONTENT)}
        messages.append({**answer, "train": False} if draw(st.integers(0, 4)) == 0 else answer)
    return messages


def encoded(tokenizer, messages, generation_prompt: bool) -> list[int]:
    plain = [{k: v for k, v in m.items() if k != "train"} for m in messages]
    return tokenizer.apply_chat_template(plain, add_generation_prompt=generation_prompt, tokenize=True,
                                         return_dict=False, sanitize_control_tokens=True)


def check_parity(tokenizer, messages) -> None:
    """Each trained assistant turn k starts right after the ids of messages[:k] with the generation prompt (so those
    ids are what inference feeds the model), and runs through its last special token; nothing else is trained."""
    row = tokenize_conversation(tokenizer, messages, max_length=100_000)
    full = encoded(tokenizer, messages, False)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant" and m.get("train") is not False]
    if row["drop_reason"] == "prefix_mismatch":  # only where inference's ids truly differ
        assert any(full[:len(encoded(tokenizer, messages[:k], True))] != encoded(tokenizer, messages[:k], True)
                   for k in turns)
        return
    assert row["drop_reason"] == ("" if turns else "no_trained_tokens")
    assert row["input_ids"] == full
    expected = [M] * len(full)
    specials = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    for k in turns:
        before = encoded(tokenizer, messages[:k], True)
        assert full[:len(before)] == before
        if not any(s in m["content"] for m in messages[:k] for s in tokenizer.added_tokens_encoder):
            assert before == tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
        through = encoded(tokenizer, messages[:k + 1], False)
        end = max(i for i in range(len(before), len(through)) if full[i] in specials) + 1
        expected[len(before):end] = full[len(before):end]
    expected[0] = M
    assert row["labels"] == expected


PARITY = settings(max_examples=150, derandomize=True, database=None, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])


@PARITY
@given(messages=conversations(tools=True))
def test_parity_chatml(chat_tokenizer, messages):
    check_parity(chat_tokenizer, messages)


@PARITY
@given(messages=conversations(tools=False))
def test_parity_llama2(llama2_chat_tokenizer, messages):
    check_parity(llama2_chat_tokenizer, messages)


@pytest.mark.slow
@settings(PARITY, max_examples=60)
@given(messages=conversations(tools=True))
def test_parity_smollm2(smollm2_tokenizer, messages):
    check_parity(smollm2_tokenizer, messages)


# ---------------------------------------------------------------- the template, the config and the data

def test_a_tokenizer_without_a_template_is_one_user_error(tokenizer, tmp_path):
    write_jsonl(tmp_path / "chat_clean.jsonl", [{"messages": [*ROUND_1], "source": "t"}] * 4)
    config = validate(TrainConfig(model_name="m", dataset_path=str(tmp_path), val_fraction=0.0, num_proc=1))
    with pytest.raises(UserError, match=r"^chat_template: the tokenizer has no chat template .* set chat_template "
                                        r"to a Jinja file or to 'chatml'$"):
        load_data(config, tokenizer)


def test_chatml_built_in_needs_its_tokens(tokenizer, chat_tokenizer):
    with pytest.raises(UserError, match=r"^chat_template: 'chatml' needs <\|im_start\|> and <\|im_end\|> as special "
                                        r"tokens"):
        apply_chat_template_option(tokenizer, "chatml")
    copy = apply_chat_template_option(type(chat_tokenizer).from_pretrained(chat_tokenizer.name_or_path), "chatml")
    assert copy.chat_template == CHATML
    assert copy.apply_chat_template(ROUND_1, tokenize=False) == chat_tokenizer.apply_chat_template(ROUND_1,
                                                                                                   tokenize=False)


def test_chat_template_from_a_file_and_a_missing_one(chat_tokenizer, tmp_path):
    copy = type(chat_tokenizer).from_pretrained(chat_tokenizer.name_or_path)
    (tmp_path / "t.jinja").write_text(CHAT_TEMPLATE + "{# from a file #}")
    assert apply_chat_template_option(copy, str(tmp_path / "t.jinja")).chat_template == \
        CHAT_TEMPLATE + "{# from a file #}"
    with pytest.raises(UserError, match=r"^chat_template: nope.jinja is neither a file nor a built-in template"):
        apply_chat_template_option(copy, "nope.jinja")


def test_plain_prompt_template_refuses_conversations(chat_tokenizer, tmp_path):
    write_jsonl(tmp_path / "chat_clean.jsonl", [{"messages": [*ROUND_1], "source": "t"}] * 4)
    config = validate(TrainConfig(model_name="m", dataset_path=str(tmp_path), val_fraction=0.0, num_proc=1,
                                  prompt_template="plain"))
    with pytest.raises(UserError, match=r"^prompt_template: 'plain' cannot write conversations"):
        load_data(config, chat_tokenizer)


def pair_example(tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """The expected (ids, labels) of a prompt/response record under the chat prompt template, from the rendered
    generation prompt: the prompt untrained, the response and EOS trained."""
    prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                add_generation_prompt=True)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + response_ids, [M] * len(prompt_ids) + response_ids


def test_a_dataset_mixing_conversations_and_pairs_tokenises_each_row_by_its_own_shape(chat_tokenizer, tmp_path):
    rows = [{"messages": [SYSTEM, *ROUND_1, *ROUND_2], "source": "chat"},
            {"messages": [SYSTEM, *TOOL_ROUND], "source": "tool"},
            {"source": "pair", "prompt": ROUND_1[0]["content"], "response": ROUND_1[1]["content"]},
            {"messages": [ROUND_1[0]], "source": "unanswered"}]
    write_jsonl(tmp_path / "mixed_clean.jsonl", rows)
    config = validate(TrainConfig(model_name="m", dataset_path=str(tmp_path), val_fraction=0.0, num_proc=1,
                                  max_length=256))
    (train, _), (stats, _) = load_data(config, chat_tokenizer)
    assert stats.dropped == {"last_turn_not_assistant": 1}
    by_index = {row["index"]: row for row in train}
    assert sorted(by_index) == [0, 1, 2]
    expected_pair = pair_example(chat_tokenizer, ROUND_1[0]["content"], ROUND_1[1]["content"])
    assert (by_index[2]["input_ids"], by_index[2]["labels"]) == expected_pair
    assert (by_index[0]["input_ids"], by_index[0]["labels"]) == offsets_labels(
        chat_tokenizer, [SYSTEM, *ROUND_1, *ROUND_2], {2, 4}, "<|im_end|>", False)
    assert trained_text(chat_tokenizer, by_index[1]) == [TOOL_ROUND[1]["content"] + "<|im_end|>",
                                                         TOOL_ROUND[3]["content"] + "<|im_end|>"]


def test_a_folder_of_clean_files_of_different_shapes_trains_as_one_dataset(chat_tokenizer, tmp_path):
    """clean.py's folder from prompt/response and conversation inputs side by side: the same examples as the same
    records in one file, a pair trained as a prompt/response pair (tests/test_data_shapes.py compares each record
    with its file alone)."""
    from gpt4all_training.data.clean import clean

    pairs = [{"instruction": "Name a colour.", "context": "", "response": "Red.", "category": "open_qa"}]
    chats = [{"messages": [SYSTEM, *ROUND_1, *ROUND_2]}, {"messages": [ROUND_1[0], {**ROUND_1[1], "train": False},
                                                                      *ROUND_2]}]
    write_jsonl(tmp_path / "raw" / "a_dolly.jsonl", pairs)
    write_jsonl(tmp_path / "raw" / "b_chat.jsonl", chats)
    clean([str(tmp_path / "raw")], tmp_path / "folder")
    one_file = [line for name in ("a_dolly_clean.jsonl", "b_chat_clean.jsonl")
                for line in (tmp_path / "folder" / name).read_text().splitlines()]
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "all_clean.jsonl").write_text("\n".join(one_file) + "\n")
    examples = {}
    for name in ("folder", "one"):
        config = validate(TrainConfig(model_name="m", dataset_path=str(tmp_path / name), val_fraction=0.0,
                                      num_proc=1, max_length=256))
        (train, _), (stats, _) = load_data(config, chat_tokenizer)
        examples[name] = [(row["index"], row["input_ids"], row["labels"]) for row in train]
    assert len(examples["folder"]) == 3 and examples["folder"] == examples["one"]
    assert examples["folder"][0][1:] == pair_example(chat_tokenizer, "Name a colour.", "Red.")


@pytest.mark.slow
def test_messages_that_gain_a_key_past_the_first_10_mb_still_load(tmp_path):
    """datasets reads the types of a JSONL file's fields from its first 10 MB; a tool call further on is read."""
    from gpt4all_training.data.records import load_records

    padding = "x" * 2000
    rows = [{"messages": [{"role": "user", "content": f"{i} {padding}"}, {"role": "assistant", "content": "ok"}],
             "source": "s"} for i in range(5500)]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    rows.append({"messages": [ROUND_1[0], {"role": "assistant", "content": "", "tool_calls": [call]},
                              {"role": "tool", "content": "done", "name": "f"}, ROUND_1[1]], "source": "s"})
    write_jsonl(tmp_path / "late_clean.jsonl", rows)
    records = load_records(str(tmp_path))
    assert len(records) == 5501 and records[-1]["messages"] == rows[-1]["messages"]
    assert records[0]["messages"] == rows[0]["messages"]


# ---------------------------------------------------------------- reasoning

CALL_ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>'
# The trained text of reasoning_conversation() per family and train_reasoning.
REASONING_TRAINED = {
    ("qwen3", True): [f"<think>\nI should look up the weather.\n</think>\n\n{CALL_ROME}",
                      "<think>\n25 degrees is warm.\n</think>\n\nYes, 25 degrees.<|im_end|>"],
    ("qwen3", False): ["<think>\n", f"\n</think>\n\n{CALL_ROME}", "<think>\n", "\n</think>\n\nYes, 25 degrees.<|im_end|>"],
    ("qwen3-thinking", True): [f"I should look up the weather.\n</think>\n\n{CALL_ROME}",
                               "25 degrees is warm.\n</think>\n\nYes, 25 degrees.<|im_end|>"],
    ("qwen3-thinking", False): [f"\n</think>\n\n{CALL_ROME}", "\n</think>\n\nYes, 25 degrees.<|im_end|>"],
}


@pytest.mark.parametrize("train_reasoning", [True, False], ids=["train", "mask"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3-thinking"])
def test_reasoning_trains_as_the_template_writes_each_turn(tokenizer_dir, tmp_path, family, train_reasoning):
    """Qwen3 writes the reasoning of the turns after the last user message only (the first answer's is dropped
    once the next question follows): those turns train with their reasoning, found turn by turn from each prefix's
    rendering; the first answer is context, as the template writes it where inference would have the model think.
    With train_reasoning false the reasoning's tokens are context too. Thinking-2507's generation prompt opens the
    <think> block itself, so its turns train from inside it."""
    tokenizer = family_tokenizer(tokenizer_dir, family)
    record = reasoning_conversation()
    write_jsonl(tmp_path / "think_clean.jsonl", [{**record, "source": "t"}])
    config = validate(TrainConfig(model_name="m", dataset_path=str(tmp_path), val_fraction=0.0, num_proc=1,
                                  max_length=4096, train_reasoning=train_reasoning))
    (train, _), _ = load_data(config, tokenizer)
    row = train[0]
    assert (row["input_ids"], row["labels"]) == expected_example(tokenizer, record, {3, 5}, "<|im_end|>",
                                                                 train_reasoning)
    assert trained_text(tokenizer, row) == REASONING_TRAINED[family, train_reasoning]


@pytest.mark.parametrize("train_reasoning", [True, False], ids=["train", "mask"])
def test_a_think_block_in_the_content_trains_with_any_template(chat_tokenizer, train_reasoning):
    """ChatML writes the content as it is: the <think> block is part of the answer, and its reasoning is context
    with train_reasoning false."""
    record = {"messages": [{"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4."},
                           {"role": "user", "content": "3+3?"},
                           {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n6."}]}
    out = tokenized_conversations({"messages": [record["messages"]]}, chat_tokenizer, 512, "all", train_reasoning)
    row = {key: values[0] for key, values in out.items()}
    assert (row["input_ids"], row["labels"]) == expected_example(chat_tokenizer, record, {1, 3}, "<|im_end|>",
                                                                 train_reasoning)
    assert trained_text(chat_tokenizer, row) == (
        ["<think>\nTwo and two.\n</think>\n\n4.<|im_end|>", "<think>\nThree and three.\n</think>\n\n6.<|im_end|>"]
        if train_reasoning else ["<think>\n", "\n</think>\n\n4.<|im_end|>", "<think>\n", "\n</think>\n\n6.<|im_end|>"])


@pytest.mark.parametrize("family", ["deepseek-r1", "chatml"])
def test_a_template_that_leaves_the_reasoning_out_is_refused(tokenizer_dir, chat_tokenizer, tmp_path, family):
    """DeepSeek-R1's template drops every turn's reasoning, even the last one's; ChatML has no place for
    reasoning_content. Either would train the answers without the reasoning the data holds."""
    tokenizer = chat_tokenizer if family == "chatml" else family_tokenizer(tokenizer_dir, family)
    thinking = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4.", "reasoning_content": "Two and two."} if family == "chatml"
                else {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4."}]
    write_jsonl(tmp_path / "think_clean.jsonl", [{"messages": thinking, "source": "t"}] * 3)
    config = validate(TrainConfig(model_name="m", dataset_path=str(tmp_path), val_fraction=0.0, num_proc=1))
    with pytest.raises(UserError) as error:
        load_data(config, tokenizer)
    assert str(error.value) == (f"chat_template: it does not render the reasoning of 3 conversations (first: "
                                f"{tmp_path / 'think_clean.jsonl'}:1), so they would train without them; use a chat "
                                f"template that renders them (chat_template: path/to/template.jinja) or leave them out "
                                f"of the data")
