"""`clean --near-duplicates SIMILARITY` (data/near_duplicates.py): a record whose word 3-grams nearly match those of a
record kept before it is dropped as near_duplicate, counted and written to --rejects like every drop; a record below
the similarity is kept; without the option nothing changes. Exact duplicates are found by a 16-byte digest of what
two duplicates share."""

from __future__ import annotations

import json

import pytest
from support.files import write_jsonl

from gpt4all_training.cli.main import main
from gpt4all_training.data.clean import clean, first_time
from gpt4all_training.data.near_duplicates import NearDuplicates, record_text, shingles

WORDS = ("the quick brown fox jumps over the lazy dog while a small bird sings in the tall green tree near the old "
         "stone bridge that crosses the slow river winding through the quiet valley under a pale morning sky").split()
ANSWER = " ".join(WORDS)
# One word of 40 changed in the middle: 3 of the record's 40 distinct word 3-grams change, a Jaccard similarity of
# 37/43 = 0.86 (estimated 0.875 from the signatures).
NEAR = " ".join(WORDS[:20] + ["iron"] + WORDS[21:])
OTHER = " ".join(reversed(WORDS))
RECORDS = [{"prompt": "Describe a scene.", "response": ANSWER}, {"prompt": "Describe a scene.", "response": NEAR},
           {"prompt": "Describe a scene.", "response": OTHER}, {"prompt": "Describe a scene.", "response": ANSWER}]


def kept_responses(folder) -> list[str]:
    return [json.loads(line)["response"] for line in (folder / "raw_clean.jsonl").read_text().splitlines()]


def test_a_near_duplicate_is_dropped_counted_and_rejected(tmp_path):
    raw = write_jsonl(tmp_path / "raw.jsonl", RECORDS)
    report = clean([str(raw)], tmp_path / "out", near_duplicates=0.7, rejects=tmp_path / "rejects.jsonl")
    assert kept_responses(tmp_path / "out") == [ANSWER, OTHER]
    assert report["total"] == {"lines": 4, "read": 4, "kept": 2, "dropped:near_duplicate": 1, "dropped:duplicate": 1}
    assert report["near_duplicates"] == 0.7
    rejects = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects] == [(2, "near_duplicate"), (4, "duplicate")]


def test_below_the_similarity_or_without_the_option_a_record_is_kept(tmp_path):
    raw = write_jsonl(tmp_path / "raw.jsonl", RECORDS)
    clean([str(raw)], tmp_path / "strict", near_duplicates=0.95)
    assert kept_responses(tmp_path / "strict") == [ANSWER, NEAR, OTHER]
    report = clean([str(raw)], tmp_path / "plain")
    assert kept_responses(tmp_path / "plain") == [ANSWER, NEAR, OTHER]
    assert report["near_duplicates"] is None


def test_the_estimate_finds_the_pairs_it_should_among_many(tmp_path):
    """500 distinct records and a near copy of every tenth: exactly the 50 copies are dropped."""
    def sentence(i: int) -> str:
        return " ".join(f"w{(i * 7919 + k * 104729) % 100003}" for k in range(40))

    near = NearDuplicates(0.7)
    firsts = [near.first_of_its_kind({"prompt": "p", "response": sentence(i)}) for i in range(500)]
    copies = [near.first_of_its_kind({"prompt": "p", "response": sentence(i).rsplit(" ", 1)[0] + " changed"})
              for i in range(0, 500, 10)]
    assert all(firsts) and not any(copies)


def test_the_text_compared_and_its_shingles():
    conversation = {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]}
    assert record_text(conversation) == "Hi there\nHello"
    assert record_text({"prompt": "P", "chosen": [{"role": "assistant", "content": "A"}], "rejected": "B"}) == "P\nA"
    assert shingles("A b") == [b"a b"]
    assert shingles("One two three four") == [b"one two three", b"two three four"]


def test_exact_duplicates_are_kept_as_digests():
    seen: set[bytes] = set()
    assert first_time(("a", "b"), seen) and not first_time(("a", "b"), seen) and first_time(("a", "c"), seen)
    assert all(isinstance(digest, bytes) and len(digest) == 16 for digest in seen) and len(seen) == 2


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_a_similarity_out_of_range_is_one_line(tmp_path, capsys, value):
    raw = write_jsonl(tmp_path / "raw.jsonl", RECORDS)
    with pytest.raises(SystemExit) as exit_info:
        main(["clean", str(raw), "--output-dir", str(tmp_path / "out"), "--near-duplicates", value])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --near-duplicates: a similarity above 0 and at most 1 (0.9 drops records that share 90% of their "
        f"word 3-grams with one kept before), got {float(value)}")
    assert not (tmp_path / "out" / "raw_clean.jsonl").exists()
