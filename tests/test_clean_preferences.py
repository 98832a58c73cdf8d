"""clean.py on preference data: prompt/chosen/rejected as text or messages (TRL), whole conversations without a
prompt (TRL's implicit prompt, UltraFeedback-binarized), HH-RLHF transcripts, and OpenAssistant trees ranked into
pairs; every pair kept or counted (`kept + dropped == read`).

The OpenAssistant expectations are counted here by walking the sample's trees, independently of data/preferences.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from support.files import read_jsonl, write_jsonl
from support.paths import OASST

from gpt4all_training.data.clean import Filters, clean
from gpt4all_training.data.pairs import load_preference_records


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def clean_rows(tmp_path: Path, rows: list, name: str = "prefs", **options) -> tuple[dict, list[dict]]:
    """(the file's report entry, its cleaned records) for `rows` written as <name>.jsonl."""
    path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    report = clean([str(path)], tmp_path / "out", **options)
    entry = report["files"][str(path)]
    assert entry["kept"] + entry["dropped_total"] == entry["read"]
    return entry, read_jsonl(tmp_path / "out" / f"{name}_clean.jsonl")


def test_text_pairs_clean_to_prompt_chosen_rejected_and_drops_are_counted(tmp_path):
    good = {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5", "score": 7}
    rows = [good, {"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."},
            {"prompt": "Say hi.", "chosen": "Hi  there", "rejected": "Hi there"},  # the same after whitespace
            {"prompt": "Q?", "chosen": "   ", "rejected": "No."}, {"prompt": "", "chosen": "A.", "rejected": "B."},
            {"chosen": "A.", "rejected": "B."}, {"prompt": "Q?", "chosen": "A."}, {**good, "source": "again"}]
    entry, records = clean_rows(tmp_path, rows)
    assert entry["dropped"] == {"duplicate": 1, "empty_answer": 1, "identical_answers": 1, "missing_prompt": 2,
                                "missing_rejected": 1}
    assert records == [{"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5", "source": "prefs"},
                       {"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon.", "source": "prefs"}]
    assert [list(r) for r in records] == [["prompt", "chosen", "rejected", "source"]] * 2
    loaded = load_preference_records(str(tmp_path / "out"))
    assert loaded["chosen"] == ["4", "Paris."] and loaded["index"] == [0, 1]


def test_filters_read_the_chosen_answer_only(tmp_path):
    rows = [{"prompt": "Help me.", "chosen": "Sure, here it is.", "rejected": "I'm sorry, I can't help."},
            {"prompt": "Help me too.", "chosen": "I'm sorry, I cannot help.", "rejected": "Fine."}]
    entry, records = clean_rows(tmp_path, rows, filters=Filters(drop_refusals=True))
    assert entry["dropped"] == {"refusal": 1} and [r["prompt"] for r in records] == ["Help me."]


def test_hh_rlhf_transcripts_become_messages_split_where_they_part(tmp_path):
    shared = "\n\nHuman: Hi.\n\nAssistant: Hello!\n\nHuman: Tell me a fruit."
    rows = [{"chosen": shared + "\n\nAssistant: An apple.", "rejected": shared + "\n\nAssistant: A chair."},
            # answers that part at an earlier turn: what follows the last shared user turn is each answer
            {"chosen": "\n\nHuman: Hi.\n\nAssistant: Hello!\n\nHuman: Bye.\n\nAssistant: Bye!",
             "rejected": "\n\nHuman: Hi.\n\nAssistant: Go away.\n\nHuman: Bye.\n\nAssistant: Bye!"},
            {"chosen": "Preamble\n\nHuman: Hi.\n\nAssistant: A.", "rejected": "\n\nHuman: Hi.\n\nAssistant: B."},
            {"chosen": shared + "\n\nAssistant: Same.", "rejected": shared + "\n\nAssistant: Same."}]
    entry, records = clean_rows(tmp_path, rows, name="hh")
    assert entry["dropped"] == {"identical_answers": 1, "malformed_transcript": 1}
    assert records == [
        {"prompt": [user("Hi."), assistant("Hello!"), user("Tell me a fruit.")], "chosen": [assistant("An apple.")],
         "rejected": [assistant("A chair.")], "source": "hh"},
        {"prompt": [user("Hi.")], "chosen": [assistant("Hello!"), user("Bye."), assistant("Bye!")],
         "rejected": [assistant("Go away."), user("Bye."), assistant("Bye!")], "source": "hh"}]


def test_conversations_with_or_without_a_prompt(tmp_path):
    """TRL's explicit prompt (messages, or a string before assistant-only answers), its implicit prompt, and
    UltraFeedback-binarized: a prompt string beside whole conversations and a messages field."""
    question = [user("Name a colour.")]
    rows = [{"prompt": question, "chosen": [assistant("Red.")], "rejected": [assistant("Dog.")]},
            {"prompt": "Name a colour.", "chosen": [assistant("Blue.")], "rejected": [assistant("Cat.")]},
            {"chosen": [*question, assistant("Green.")], "rejected": [*question, assistant("Cow.")]},
            {"prompt": "Name a colour.", "prompt_id": "x", "chosen": [*question, assistant("Pink.")],
             "rejected": [*question, assistant("Pig.")], "messages": [*question, assistant("Pink.")],
             "score_chosen": 9.0, "score_rejected": 2.0},
            {"prompt": question, "chosen": [user("Again?")], "rejected": [assistant("No.")]},
            {"chosen": [assistant("Hi.")], "rejected": [assistant("Yo.")]}]
    entry, records = clean_rows(tmp_path, rows, name="chat")
    assert entry["dropped"] == {"answer_not_assistant": 1, "missing_prompt": 1}
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in records] == [
        (question, [assistant(c)], [assistant(r)]) for c, r in (("Red.", "Dog."), ("Blue.", "Cat."),
                                                                ("Green.", "Cow."), ("Pink.", "Pig."))]


def ranked_pairs(tree: dict) -> list[tuple[str, str, str]]:
    """(last prompter text, best reply, worse reply) for every ranked sibling below a prompter, depth first."""
    found = []
    stack = [tree["prompt"]]
    while stack:
        node = stack.pop()
        replies = node.get("replies") or []
        ranked = sorted((r for r in replies if r.get("rank") is not None and not r.get("deleted")),
                        key=lambda r: r["rank"])
        found += [(node["text"], ranked[0]["text"], worse["text"]) for worse in ranked[1:]]
        stack.extend(reversed(replies))
    return found


def test_oasst_preferences_pair_the_best_reply_with_each_lower_ranked_sibling(tmp_path):
    trees = [json.loads(line) for line in OASST.read_text(encoding="utf-8").splitlines()]
    expected = [pair for tree in trees for pair in ranked_pairs(tree)]
    report = clean([str(OASST)], tmp_path, oasst_preferences=True)
    entry = report["files"][str(OASST)]
    records = read_jsonl(tmp_path / "oasst-sample_clean.jsonl")
    assert len(expected) == entry["read"] == entry["kept"] == len(records) == 429
    assert entry["dropped"] == {} and report["oasst"] == "preferences"
    assert [(r["prompt"][-1]["content"], r["chosen"][0]["content"], r["rejected"][0]["content"])
            for r in records] == expected
    assert all(r["prompt"][0]["role"] == "user" and [m["role"] for m in r["prompt"]][1::2] ==
               ["assistant"] * (len(r["prompt"]) // 2) for r in records)
    assert max(len(r["prompt"]) for r in records) >= 3  # pairs deeper in a tree carry their thread
