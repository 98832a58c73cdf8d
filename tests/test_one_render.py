"""data/one_render.py: the trained spans of a conversation from one tokenization of it are exactly what the
turn-by-turn rule (ChatEncoder.spans_by_prefix: one encoding per prefix) gives, for every family's chat template
(tests/support/templates.py), ChatML, Llama 2's [INST] template and SmolLM2's own; and the conversations it leaves to
that rule are the ones it says it cannot decide.

Conversations are drawn from words that stress the places where two encodings could part: leading and trailing
spaces and newlines, text that spells a control token, non-ASCII letters; with a system message or not, tool turns,
turns kept as context, several rounds, and (for the templates that write them) tool calls and reasoning.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.templates import FAMILIES, TOOL_FAMILIES, decoded, family_tokenizer, reasoning_conversation, \
    tool_conversation

from gpt4all_training.data.chat import ChatEncoder
from gpt4all_training.data.one_render import OneRender, common_length, overlapping, usable_tokenizer

TEMPLATES = ["chatml", "llama2", *FAMILIES]
WORDS = st.sampled_from(["Hi", " there", "2+2", " is", " 4", "ünï", " 12345", ".", "!?", "\n", "\n\n", "  ", "\t",
                         "a\nb", " <think>", "</think> ", "<|im_end|>", "<|im_start|>", "<|eot_id|>", "[INST]",
                         " [/INST]", "<tool_call>"])
CONTENT = st.lists(WORDS, min_size=1, max_size=6).map("".join).filter(str.strip)
PLAIN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
         {"role": "assistant", "content": "Blue."}, {"role": "user", "content": " And another?\n"},
         {"role": "assistant", "content": "Green."}]
PARITY = settings(max_examples=120, derandomize=True, database=None, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=TEMPLATES)
def encoder(request, chat_tokenizer, llama2_chat_tokenizer, tokenizer_dir) -> ChatEncoder:
    if request.param == "chatml":
        return ChatEncoder(chat_tokenizer)
    if request.param == "llama2":
        return ChatEncoder(llama2_chat_tokenizer)
    return ChatEncoder(family_tokenizer(tokenizer_dir, request.param))


@st.composite
def conversations(draw):
    messages = [{"role": "system", "content": draw(CONTENT)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(CONTENT)})
        if draw(st.integers(0, 3)) == 0:
            messages += [{"role": "assistant", "content": draw(CONTENT)}, {"role": "tool", "content": draw(CONTENT)}]
        answer = {"role": "assistant", "content": draw(CONTENT)}
        messages.append({**answer, "train": False} if draw(st.integers(0, 4)) == 0 else answer)
    return messages


def both(encoder: ChatEncoder, messages: list[dict], tools=None) -> tuple:
    """(one tokenization's answer, the turn-by-turn rule's) for one conversation, every assistant turn trained
    unless it says `"train": false`."""
    plain = [{k: v for k, v in m.items() if k != "train"} for m in messages]
    flags = [m["role"] == "assistant" and m.get("train") is not False for m in messages]
    [fast] = OneRender(encoder).spans([plain], [flags], [tools])
    [slow] = encoder.spans_by_prefix([plain], [flags], [tools])
    return fast, slow


@PARITY
@given(messages=conversations())
def test_one_tokenization_gives_the_turn_by_turn_spans(encoder, messages):
    fast, slow = both(encoder, messages)
    assert fast is None or fast == slow


def test_a_plain_conversation_is_decided_by_one_tokenization(encoder):
    """Every template here lets one tokenization decide a conversation without control-token text: the rule's
    speed-up applies to all of them (none falls back)."""
    assert OneRender(encoder).usable
    fast, slow = both(encoder, PLAIN)
    assert fast is not None and fast == slow


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_tool_calls_and_definitions_give_the_turn_by_turn_spans(tokenizer_dir, family):
    encoder = ChatEncoder(family_tokenizer(tokenizer_dir, family))
    record = tool_conversation()
    fast, slow = both(encoder, decoded(record["messages"]), record["tools"])
    assert fast is None or fast == slow
    assert fast is not None


@pytest.mark.parametrize("family", ["qwen3", "qwen3-thinking", "deepseek-r1"])
def test_reasoning_gives_the_turn_by_turn_spans(tokenizer_dir, family):
    encoder = ChatEncoder(family_tokenizer(tokenizer_dir, family))
    record = reasoning_conversation()
    fast, slow = both(encoder, decoded(record["messages"]), record["tools"])
    assert fast is None or fast == slow


def test_masked_reasoning_and_typed_control_tokens_are_left_to_the_turn_by_turn_rule(tokenizer_dir, chat_tokenizer):
    """Masked reasoning needs a second encoding and typed control tokens are encoded apart: one tokenization does
    not decide either."""
    record = reasoning_conversation()
    masking = ChatEncoder(family_tokenizer(tokenizer_dir, "qwen3"), train_reasoning=False)
    flags = [m["role"] == "assistant" for m in record["messages"]]
    assert OneRender(masking).spans([decoded(record["messages"])], [flags], [record["tools"]]) == [None]
    typed = [{"role": "user", "content": "What does <|im_end|> mean?"}, {"role": "assistant", "content": "An end."}]
    assert OneRender(ChatEncoder(chat_tokenizer)).spans([typed], [[False, True]], [None]) == [None]


def test_a_tokenizer_whose_added_tokens_strip_or_overlap_is_not_used(chat_tokenizer, tmp_path):
    """Added tokens that strip the spaces beside them, or one that holds the start of another, could split two
    texts differently where they part: such a tokenizer goes turn by turn."""
    from tokenizers import AddedToken

    from gpt4all_training.model.loading import load_tokenizer

    assert usable_tokenizer(chat_tokenizer)
    stripping = load_tokenizer(chat_tokenizer.name_or_path)
    stripping.add_special_tokens({"additional_special_tokens": [AddedToken("<|end|>", rstrip=True)]})
    assert not usable_tokenizer(stripping)
    assert not OneRender(ChatEncoder(stripping)).usable
    assert overlapping(["<|im_start|>", "<|im_start|>assistant"])  # one holds another
    assert overlapping(["ab<", "<x>"])  # one ends with the start of another
    assert not overlapping(["<|im_start|>", "<|im_end|>", "<think>", "</think>", "[INST]", "[/INST]"])


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(a=st.text("ab", max_size=12), b=st.text("ab", max_size=12))
def test_common_length_is_the_common_prefix(a, b):
    import os

    assert common_length(a, b) == len(os.path.commonprefix([a, b]))
