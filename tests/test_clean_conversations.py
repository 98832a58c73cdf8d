"""clean.py on conversations: OpenAI `messages`, ShareGPT `conversations` and OpenAssistant trees as whole threads,
with every record kept or counted (`kept + dropped == read`).

The OpenAssistant expectations are counted independently of data/conversations.py, by walking the sample's trees
here: every assistant reply, the best-ranked path, the thread above each reply.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from support.files import read_jsonl, write_jsonl
from support.paths import OASST, REPO

from gpt4all_training.data.clean import Filters, clean
from gpt4all_training.errors import UserError

MALFORMED = REPO / "tests" / "data" / "malformed.jsonl"
SYSTEM = {"role": "system", "content": "You answer briefly."}
ROUND = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello."}]
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}


def clean_rows(tmp_path: Path, rows: list, **options) -> tuple[dict, list[dict]]:
    """(the file's report entry, its cleaned records) for `rows` written as data.jsonl."""
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    report = clean([str(path)], tmp_path / "out", **options)
    entry = report["files"][str(path)]
    assert entry["kept"] + entry["dropped_total"] == entry["read"]
    return entry, read_jsonl(tmp_path / "out" / "data_clean.jsonl")


# ---------------------------------------------------------------- OpenAI and ShareGPT

def test_openai_messages_keep_roles_order_and_template_fields(tmp_path):
    messages = [SYSTEM, {"role": "user", "content": "Weather in Oslo?", "weight": 1},
                {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                {"role": "tool", "content": '{"sky": "rain"}', "tool_call_id": "call_1", "name": "weather"},
                {"role": "assistant", "content": "Rain.", "train": False}, *ROUND]
    entry, records = clean_rows(tmp_path, [{"messages": messages, "source": "chat-export"}])
    assert (entry["read"], entry["kept"]) == (1, 1)
    call = {**TOOL_CALL, "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    assert records == [{"messages": [
        SYSTEM, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"sky": "rain"}', "name": "weather", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Rain.", "train": False}, *ROUND], "source": "chat-export"}]
    assert list(records[0]) == ["messages", "source"]


def test_sharegpt_roles_in_any_case(tmp_path):
    turns = [{"from": "System", "value": "Be brief."}, {"from": "HUMAN", "value": "2+2?"},
             {"from": "gpt", "value": "4"}, {"from": "human", "value": "And 3+3?"}, {"from": "GPT", "value": "6"}]
    entry, records = clean_rows(tmp_path, [{"conversations": turns, "id": "x1"}])
    assert records == [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                                     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
                                     {"role": "assistant", "content": "6"}], "source": "data"}]


def test_every_drop_reason_of_a_conversation_is_counted(tmp_path):
    user, answer = ROUND
    rows = [
        {"messages": [SYSTEM, *ROUND]},                                                    # kept
        {"messages": [user, user, answer]},                                                # kept: two user turns
        {"messages": [user, {"role": "assistant", "content": " \n"}]},                    # empty_turn
        {"messages": [user]},                                                              # last_turn_not_assistant
        {"messages": [*ROUND, user]},                                                      # last_turn_not_assistant
        {"messages": [answer, user, answer]},                                              # roles_out_of_order
        {"messages": [user, answer, answer]},                                              # roles_out_of_order
        {"messages": [user, SYSTEM, answer]},                                              # roles_out_of_order
        {"messages": [user, {"role": "tool", "content": "42"}, answer]},                   # roles_out_of_order
        {"messages": [{"role": "narrator", "content": "Once."}, *ROUND]},                  # unknown_role
        {"conversations": [{"from": "bing", "value": "Hi."}, {"from": "gpt", "value": "Hello."}]},  # unknown_role
        {"conversations": [{"from": "human"}, {"from": "gpt", "value": "Hello."}]},        # empty_turn
        {"messages": [{"role": "user", "content": ["a", "list"]}, answer]},                # non_string_content
        {"messages": "not a list"},                                                        # malformed_messages
        {"messages": []},                                                                  # malformed_messages
        {"messages": [SYSTEM, *ROUND]},                                                    # duplicate
        {"messages": [SYSTEM, {"role": "user", "content": " Hi  there."}, answer], "source": "b"},  # duplicate
    ]
    entry, records = clean_rows(tmp_path, rows)
    assert entry["dropped"] == {"duplicate": 2, "empty_turn": 2, "last_turn_not_assistant": 2,
                                "malformed_messages": 2, "non_string_content": 1, "roles_out_of_order": 4,
                                "unknown_role": 2}
    assert (entry["read"], entry["kept"]) == (17, 2)
    assert [r["messages"] for r in records] == [[SYSTEM, *ROUND], [user, user, answer]]


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
# (a message field of the wrong type, the reason it is counted under); issue 28's "train": "false" and 0 first.
WRONG_TYPES = [({"train": "false"}, "non_boolean_train"), ({"train": 0}, "non_boolean_train"),
               ({"train": 1}, "non_boolean_train"), ({"content": 3}, "non_string_content")]
WRONG_TOOL_TYPES = [({"name": 3}, "non_string_name"), ({"tool_call_id": ["c1"]}, "non_string_tool_call_id")]
WRONG_CALLS = [("call f", "malformed_tool_calls"), ([{"function": "f"}], "malformed_tool_calls"),
               ([{"function": {"arguments": "{}"}}], "malformed_tool_calls")]


def test_every_field_of_the_wrong_type_is_counted_never_dropped_silently(tmp_path):
    user, answer = ROUND
    rows = [{"messages": [user, {**answer, **field}]} for field, _ in WRONG_TYPES]
    rows += [{"messages": [user, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                           {"role": "tool", "content": "42", **field}, answer]} for field, _ in WRONG_TOOL_TYPES]
    rows += [{"messages": [user, {"role": "assistant", "content": "", "tool_calls": calls}, answer]}
             for calls, _ in WRONG_CALLS]
    rows.append({"messages": [user, {**answer, "train": True}], "source": "kept"})  # true is the default
    entry, records = clean_rows(tmp_path, rows)
    expected = Counter(reason for _, reason in WRONG_TYPES + WRONG_TOOL_TYPES + WRONG_CALLS)
    assert entry["dropped"] == dict(expected) and entry["kept"] == 1
    assert entry["read"] == entry["kept"] + entry["dropped_total"] == len(rows)
    assert records == [{"messages": [user, answer], "source": "kept"}]


def test_filters_read_only_the_trained_answers(tmp_path):
    disclaimer = "As an AI language model, I cannot."
    rows = [{"messages": [ROUND[0], {"role": "assistant", "content": disclaimer, "train": False},
                          {"role": "user", "content": "Please?"}, ROUND[1]]},
            {"messages": [ROUND[0], {"role": "assistant", "content": disclaimer}]}]
    entry, records = clean_rows(tmp_path, rows, filters=Filters(drop_ai_disclaimers=True))
    assert (entry["kept"], entry["dropped"]) == (1, {"ai_disclaimer": 1})
    assert records[0]["messages"][1]["train"] is False


# ---------------------------------------------------------------- OpenAssistant trees

def oasst_trees() -> list[dict]:
    return [json.loads(line) for line in OASST.read_text(encoding="utf-8").splitlines()]


def assistant_replies(node: dict, thread: tuple = ()):
    """(the thread above it as (role, text) pairs, the reply) for every assistant reply, depth first."""
    thread = (*thread, ("user" if node["role"] == "prompter" else "assistant", node["text"]))
    if node["role"] == "assistant":
        yield thread
    for reply in node["replies"]:
        yield from assistant_replies(reply, thread)


def test_oasst_paths_train_every_reply_exactly_once(tmp_path):
    report = clean([str(OASST)], tmp_path)
    records = read_jsonl(tmp_path / "oasst-sample_clean.jsonl")
    threads = [thread for tree in oasst_trees() for thread in assistant_replies(tree["prompt"])]
    # A conversation ends at every reply with no reply of its own below it, and only there.
    endpoints = [t for t in threads if not any(len(o) > len(t) and o[:len(t)] == t for o in threads)]
    assert report["files"][str(OASST)] == {"lines": 100, "read": len(endpoints), "kept": len(endpoints),
                                           "dropped": {}, "dropped_total": 0}
    assert len(endpoints) == 546  # of the 687 replies, 141 have replies below them
    assert Counter(tuple((m["role"], m["content"]) for m in r["messages"]) for r in records) == Counter(endpoints)
    trained = Counter(m["content"] for r in records for m in r["messages"]
                      if m["role"] == "assistant" and m.get("train") is not False)
    assert trained == Counter(thread[-1][1] for thread in threads)  # each of the 687 replies once
    assert {r["source"] for r in records} == {"oasst"}


def test_oasst_best_follows_the_best_ranked_reply(tmp_path):
    report = clean([str(OASST)], tmp_path, oasst="best")
    records = read_jsonl(tmp_path / "oasst-sample_clean.jsonl")
    expected = []
    for tree in oasst_trees():
        node, path = tree["prompt"], []
        while True:
            path.append(("user" if node["role"] == "prompter" else "assistant", node["text"]))
            if not node["replies"]:
                break
            node = min(node["replies"], key=lambda r: r.get("rank") if r.get("rank") is not None else 99)
        while path[-1][0] != "assistant":
            path.pop()
        expected.append(tuple(path))
    assert report["files"][str(OASST)]["kept"] == 100
    assert [tuple((m["role"], m["content"]) for m in r["messages"]) for r in records] == expected
    assert not any("train" in m for r in records for m in r["messages"])


def test_malformed_trees_as_threads(tmp_path):
    """The hand-made file's trees (see test_clean.py): the two pairs of the first tree are one conversation; its
    deleted answer and the reply below it end one would-be conversation, dropped once."""
    pairs = clean([str(MALFORMED)], tmp_path / "pairs", oasst="pairs")["files"][str(MALFORMED)]
    paths = clean([str(MALFORMED)], tmp_path / "paths")["files"][str(MALFORMED)]
    assert pairs["dropped"]["deleted_message"] == 2 and pairs["dropped"]["no_pairs"] == 1
    expected = {k: v for k, v in pairs["dropped"].items() if k not in ("deleted_message", "no_pairs")}
    assert paths["dropped"] == {**expected, "deleted_message": 1, "no_threads": 1}
    assert (paths["read"], paths["kept"]) == (pairs["read"] - 2, pairs["kept"] - 1)
    conversations = [r for r in read_jsonl(tmp_path / "paths" / "malformed_clean.jsonl") if "messages" in r]
    assert conversations == [{"messages": [
        {"role": "user", "content": "How do plants make food?"}, {"role": "assistant", "content": "By photosynthesis."},
        {"role": "user", "content": "What do they need for it?"},
        {"role": "assistant", "content": "Light, water and carbon dioxide."}], "source": "oasst"}]


def test_unknown_oasst_mode_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"^--oasst: must be one of paths, best, pairs, got 'all'$"):
        clean([str(OASST)], tmp_path, oasst="all")
