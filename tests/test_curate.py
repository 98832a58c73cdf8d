"""curate: planted near-duplicates found on all-MiniLM-L6-v2 embeddings, planted broken labels found by the loss rule
after a short training of the tiny model, and the bookkeeping every run keeps (kept + dropped == read, the record
fields clean.py writes, the id files the map downloads, one-line errors)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from support.files import read_jsonl, write_jsonl
from support.inference_runs import write_inference_run
from support.paths import OASST
from gpt4all_training.analysis.curation.curate import REMOVED_FILE, REPORT_FILE, CurateOptions, curate, read_ids
from gpt4all_training.analysis.inference import run_inference
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import InferenceConfig, TrainConfig
from gpt4all_training.errors import UserError

PARAPHRASES = ["Could you tell me: {}", "{} Please answer briefly.", "Question: {}\nAnswer it.", "I was wondering, {}"]


def removed(output: Path) -> list[dict]:
    return read_jsonl(output / REMOVED_FILE)


def precision_recall(found: set[int], planted: set[int]) -> tuple[float, float]:
    hits = len(found & planted)
    return hits / max(len(found), 1), hits / len(planted)


# ---------------------------------------------------------------- near-duplicates

@pytest.fixture(scope="module")
def planted_duplicates(clean_dolly, tmp_path_factory):
    """150 short Dolly records, then 20 template paraphrases of some (same response) and 10 exact copies of
    others: (inference run folder, indices of the planted rows, number of originals)."""
    records = [r for r in read_jsonl(next(clean_dolly.glob("*_clean.jsonl")))
               if len(r["prompt"]) + len(r["response"]) < 400][:150]
    paraphrased = [dict(r, prompt=PARAPHRASES[k % len(PARAPHRASES)].format(r["prompt"]))
                   for k, r in enumerate(records[:20])]
    rows = records + paraphrased + [dict(r) for r in records[20:30]]
    rng = np.random.default_rng(0)
    folder = write_inference_run(tmp_path_factory.mktemp("planted-duplicates"),
                                 rng.standard_normal((len(rows), 8)).astype(np.float32),
                                 rng.gamma(2.0, 1.0, len(rows)), [r["prompt"] for r in rows],
                                 response=[r["response"] for r in rows], source=[r["source"] for r in rows])
    return folder, set(range(len(records), len(rows))), len(records)


@pytest.mark.slow
def test_planted_near_duplicates_are_found_on_minilm_embeddings(planted_duplicates, tmp_path):
    folder, planted, originals = planted_duplicates
    report = curate(folder, tmp_path / "out", CurateOptions(near_duplicates=0.9))
    dropped = {r["index"]: r for r in removed(tmp_path / "out")}
    precision, recall = precision_recall(set(dropped), planted)
    assert precision >= 0.9 and recall >= 0.9, (precision, recall)
    assert all(i in dropped for i in range(originals + 20, originals + 30))  # the exact copies, all of them
    assert {dropped[i]["reason"] for i in range(originals + 20, originals + 30)} == {"exact_duplicate"}
    # Each paraphrase points at the record it repeats, and no two distinct records were merged.
    for k, i in enumerate(range(originals, originals + 20)):
        if i in dropped:
            assert dropped[i] == {**dropped[i], "reason": "near_duplicate", "duplicate_of": k}
    assert not [i for i in dropped if i < originals]
    near = report["rules"]["near_duplicates"]
    assert near["embedder"] == "minilm" and near["nearest_similarity"]["records"] == originals + 20
    assert report["read"] == report["kept"] + report["dropped_total"] == originals + 30


@pytest.mark.slow
def test_sibling_replies_are_near_duplicates_only_when_their_answers_are(tmp_path):
    """OpenAssistant's sibling replies share their whole thread (the prompt) and differ in their last answer. A pair
    is as similar as its less similar side: a shared prompt cannot make two different answers duplicates, as the
    mean of the two sides did (answers 0.8 apart reached 0.9)."""
    from transformers import AutoModel, AutoTokenizer

    from gpt4all_training.analysis.curation.embeddings import minilm_embeddings, minilm_path
    from gpt4all_training.data.chat import conversation_text
    from gpt4all_training.data.conversations import oasst_threads

    threads = [t for line in OASST.read_text().splitlines()[:10] for t in oasst_threads(json.loads(line), "paths")]
    prompts, responses = zip(*(conversation_text(messages) for messages in threads))
    rng = np.random.default_rng(0)
    run = write_inference_run(tmp_path / "run", rng.standard_normal((len(threads), 4)).astype(np.float32),
                              np.ones(len(threads)),
                              list(prompts), response=list(responses))
    report = curate(run, tmp_path / "out", CurateOptions(near_duplicates=0.9))
    assert report["read"] == report["kept"] + report["dropped_total"] == len(threads)

    path = minilm_path()
    model, tokenizer = AutoModel.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(str(path))
    prompt_cos = (lambda e: e @ e.T)(minilm_embeddings(list(prompts), "end", model, tokenizer))
    answer_cos = (lambda e: e @ e.T)(minilm_embeddings(list(responses), "start", model, tokenizer))
    merged_by_the_mean = {i for i in range(len(threads)) for j in range(i) if prompts[i] == prompts[j]
                          and answer_cos[i, j] < 0.9 <= (1 + answer_cos[i, j]) / 2}
    dropped = {r["index"]: r for r in removed(tmp_path / "out")}
    assert len(merged_by_the_mean) >= 5  # the fixture holds the reported case
    for i, entry in dropped.items():
        j = entry["duplicate_of"]
        assert min(prompt_cos[i, j], answer_cos[i, j]) == pytest.approx(entry["similarity"], abs=1e-3)
        assert answer_cos[i, j] >= 0.9 - 1e-3 and prompt_cos[i, j] >= 0.9 - 1e-3
    assert merged_by_the_mean - set(dropped)  # distinct answers to one thread are kept


# ---------------------------------------------------------------- broken labels

FAMILIES = {
    "sound": ("What sound does a {} make?", {"cat": "Meow.", "dog": "Woof.", "cow": "Moo.", "duck": "Quack.",
                                             "sheep": "Baa.", "owl": "Hoot."}),
    "color": ("What colour is {}?", {"grass": "Green.", "snow": "White.", "the sky": "Blue.", "coal": "Black.",
                                     "a banana": "Yellow.", "a tomato": "Red."}),
    "capital": ("What is the capital of {}?", {"France": "Paris.", "Japan": "Tokyo.", "Italy": "Rome.",
                                               "Egypt": "Cairo.", "Peru": "Lima.", "Kenya": "Nairobi."}),
    "opposite": ("What is the opposite of {}?", {"hot": "Cold.", "up": "Down.", "big": "Small.", "fast": "Slow.",
                                                 "early": "Late.", "open": "Closed."}),
}
OPENINGS = ["", "Quick question: ", "Please answer: ", "Tell me: ", "Q: "]


@pytest.fixture(scope="module")
def swapped_labels(tmp_path_factory):
    """480 records (24 facts x 5 openings x 4 copies), and 24 of them (5%) given the answer of a record of another
    family: (dataset folder, the swapped records' indices)."""
    records = [{"source": family, "prompt": opening + template.format(key), "response": answer}
               for _ in range(4) for opening in OPENINGS
               for family, (template, facts) in FAMILIES.items() for key, answer in facts.items()]
    rng = np.random.default_rng(0)
    swapped: set[int] = set()
    while len(swapped) < 24:
        a, b = (int(i) for i in rng.choice(len(records), 2, replace=False))
        if a in swapped or b in swapped or records[a]["source"] == records[b]["source"]:
            continue
        records[a]["response"], records[b]["response"] = records[b]["response"], records[a]["response"]
        swapped |= {a, b}
    folder = tmp_path_factory.mktemp("swapped")
    write_jsonl(folder / "facts_clean.jsonl", records)
    return folder, swapped


@pytest.mark.integration
@pytest.mark.slow
def test_swapped_responses_are_found_by_the_loss_rule(swapped_labels, tiny_model_dir, tmp_path):
    from gpt4all_training.training.loop import train

    data, swapped = swapped_labels
    train(validate(TrainConfig(model_name=str(tiny_model_dir), dataset_path=str(data),
                               output_dir=str(tmp_path / "run"), max_length=48, batch_size=16, lr=3e-3, min_lr=3e-4,
                               warmup_steps=5, val_fraction=0.0, num_epochs=5, eval_every=None, save_every=None,
                               num_proc=1, seed=0)))
    run = run_inference(validate(InferenceConfig(model_name=str(tmp_path / "run" / "final"), dataset_path=str(data),
                                                 output_dir=str(tmp_path / "inference"), max_length=48,
                                                 val_fraction=0.0, batch_size=32, num_proc=1))).parent
    report = curate(run, tmp_path / "curated", CurateOptions(loss_above=0.9))
    found = {r["index"] for r in removed(tmp_path / "curated")}
    assert report["dropped"] == {"high_loss": len(found)} and 40 <= len(found) <= 56  # the top tenth of 480
    precision, recall = precision_recall(found, swapped)
    assert recall >= 0.8, (precision, recall)
    # The report names where they went: by source (family), with example prompts.
    assert {e["source"] for e in report["removed_by_source"]} <= set(FAMILIES)
    assert all(e["examples"] for e in report["removed_by_source"])


# ---------------------------------------------------------------- bookkeeping

@pytest.fixture
def small_run(tmp_path) -> Path:
    rng = np.random.default_rng(1)
    prompts = [f"prompt {i}" for i in range(40)]
    prompts[5] = prompts[4]  # an exact duplicate (same response below)
    responses = [f"response {i}" for i in range(40)]
    responses[5] = responses[4]
    # Listed out of dataset order, as a 2-process inference run's (split, index) order can be.
    index = np.roll(np.arange(40), 7)
    return write_inference_run(tmp_path / "run", rng.standard_normal((40, 8)).astype(np.float32),
                               np.linspace(1.0, 4.0, 40), [prompts[i] for i in index],
                               response=[responses[i] for i in index], index=index, source=["a", "b"] * 20)


def test_every_record_is_kept_or_counted_and_written_like_clean(small_run, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("1\n2, 3\n")
    out = tmp_path / "out"
    report = curate(small_run, out, CurateOptions(near_duplicates=0.999, embedder="model", loss_above=0.9,
                                                  loss_below=0.05, exclude_ids=str(ids), name="picked"))
    assert report["read"] == 40 and report["kept"] + report["dropped_total"] == 40
    assert report["dropped"]["excluded"] == 3 and report["dropped"]["exact_duplicate"] == 1
    assert report["dropped"]["high_loss"] == 4 and report["dropped"]["low_loss"] == 2
    assert json.loads((out / REPORT_FILE).read_text()) == report
    written = read_jsonl(out / "picked_clean.jsonl")
    assert len(written) == report["kept"]
    assert all(list(r) == ["source", "prompt", "response"] for r in written)  # clean.py's fields, nothing else
    kept_prompts = [r["prompt"] for r in written]
    assert kept_prompts == sorted(kept_prompts, key=lambda p: int(p.split()[1]))  # dataset order
    lines = removed(out)
    assert sorted(r["index"] for r in lines) == sorted(set(range(40)) - {int(p.split()[1]) for p in kept_prompts})
    assert next(r for r in lines if r["reason"] == "exact_duplicate")["duplicate_of"] == 4
    assert sorted(p.name for p in out.iterdir()) == [REMOVED_FILE, REPORT_FILE, "picked_clean.jsonl"]  # no temp


def test_id_files_in_every_format_the_map_and_people_write(tmp_path):
    for content in ('{"input": "x", "ids": [3, 1]}', "[3, 1]", "3\n1\n", "3, 1"):
        (tmp_path / "ids").write_text(content)
        assert read_ids(str(tmp_path / "ids"), "--exclude-ids").tolist() == [3, 1]
    (tmp_path / "ids").write_text("[1.5]")
    with pytest.raises(UserError, match="whole numbers; got 1.5"):
        read_ids(str(tmp_path / "ids"), "--exclude-ids")


@pytest.mark.parametrize("options, message", [
    ({}, "no rule given"),
    ({"loss_above": 95}, "--loss-above: a quantile between 0 and 1"),
    ({"loss_above": 0.5, "loss_below": 0.6}, "--loss-below 0.6 must be below --loss-above 0.5"),
    ({"near_duplicates": 1.5}, r"--near-duplicates: a cosine similarity in \(0, 1\]"),
    ({"exclude_ids": "no/such/file"}, "--exclude-ids no/such/file: no such file"),
    ({"include_ids": "IDS"}, "2 ids are not examples of"),
    ({"loss_above": 0.9, "name": "a/b"}, "--name 'a/b': letters, digits"),
])
def test_mistakes_are_one_line_errors(small_run, tmp_path, options, message):
    if options.get("include_ids") == "IDS":
        (tmp_path / "ids.json").write_text('{"ids": [1, 400, 500]}')
        options = {"include_ids": str(tmp_path / "ids.json")}
    with pytest.raises(UserError, match=message) as error:
        curate(small_run, tmp_path / "out", CurateOptions(**options))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out" / "curated_clean.jsonl").exists()


def test_cli_prints_the_counts(small_run, tmp_path, capsys):
    from gpt4all_training.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["curate", "--input", str(small_run), "--output", str(tmp_path / "out"), "--loss-above", "0.75"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("read 40, kept 30, dropped 10 (high_loss 10)\n")
    assert f"wrote {tmp_path / 'out' / 'curated_clean.jsonl'}" in out


# ---------------------------------------------------------------- rules on scores, against known-bad records

# Ten records, hand-labelled: rows 2, 5 and 8 are the known-bad ones. ifd is missing (NaN) on row 3.
IFD = [0.1, 0.2, 0.3, np.nan, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
AGREEMENT = [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
LOSS = [1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0]
PLANTED = [False, False, True, False, False, True, False, False, True, False]


@pytest.fixture
def scored_run(tmp_path) -> Path:
    rng = np.random.default_rng(2)
    return write_inference_run(tmp_path / "run", rng.standard_normal((10, 4)).astype(np.float32), np.array(LOSS),
                               [f"prompt {i}" for i in range(10)], ifd=np.array(IFD), agreement=np.array(AGREEMENT),
                               planted=PLANTED)


def test_drop_rules_report_what_each_dropped_and_its_precision_and_recall(scored_run, tmp_path):
    # ifd's 0.8 quantile over its 9 values 0.1 .. 1.0 without 0.4: 0.8 + 0.4 * (0.9 - 0.8) = 0.84 -> rows 8 and 9.
    # agreement < 1 with loss > 2: row 5 only. ifd >= 0.9 finds rows 8 and 9 again, which the first rule dropped.
    rules = ["ifd>q0.8", "agreement < 1 & loss > 2", "ifd>=0.9"]
    report = curate(scored_run, tmp_path / "out", CurateOptions(drop=rules, label_column="planted"))
    assert report["read"] == 10 and report["kept"] == 7
    assert report["dropped"] == {"ifd>q0.8": 2, "agreement<1&loss>2": 1}
    first, second, third = report["rules"]["drop"]
    assert first["conditions"][0]["threshold"] == pytest.approx(0.84, abs=1e-6)
    assert first == {"rule": "ifd>q0.8", "conditions": [{"column": "ifd", "op": ">", "quantile": 0.8,
                                                         "threshold": first["conditions"][0]["threshold"]}],
                     "matched": 2, "dropped": 2}
    assert second == {"rule": "agreement<1&loss>2",
                      "conditions": [{"column": "agreement", "op": "<", "threshold": 1.0},
                                     {"column": "loss", "op": ">", "threshold": 2.0}], "matched": 1, "dropped": 1}
    assert (third["matched"], third["dropped"]) == (2, 0)
    # Dropped {5, 8, 9}, known bad {2, 5, 8}: 2 of 3 dropped are bad, 2 of 3 bad were dropped.
    assert report["label"] == {
        "from": "column planted", "bad": 3, "dropped": 3, "dropped_bad": 2, "precision": 0.6667, "recall": 0.6667,
        "by_rule": {"ifd>q0.8": {"matched": 2, "matched_bad": 1, "precision": 0.5, "recall": 0.3333},
                    "agreement<1&loss>2": {"matched": 1, "matched_bad": 1, "precision": 1.0, "recall": 0.3333},
                    "ifd>=0.9": {"matched": 2, "matched_bad": 1, "precision": 0.5, "recall": 0.3333}}}
    assert removed(tmp_path / "out") == [
        {"index": 5, "split": "train", "reason": "agreement<1&loss>2", "loss": 3.0, "ifd": 0.6, "agreement": 0.0,
         "bad": True, "prompt": "prompt 5"},
        {"index": 8, "split": "train", "reason": "ifd>q0.8", "loss": 1.0, "ifd": 0.9, "agreement": 1.0,
         "bad": True, "prompt": "prompt 8"},
        {"index": 9, "split": "train", "reason": "ifd>q0.8", "loss": 1.0, "ifd": 1.0, "agreement": 0.0,
         "bad": False, "prompt": "prompt 9"}]
    # The label is no field of a record: the curated dataset holds clean.py's fields only.
    assert all(list(r) == ["source", "prompt", "response"] for r in read_jsonl(tmp_path / "out" / "curated_clean.jsonl"))


def test_known_bad_ids_score_the_loss_and_id_rules_too(scored_run, tmp_path):
    ids = tmp_path / "bad.json"
    ids.write_text('{"ids": [2, 5, 8]}')
    excluded = tmp_path / "excluded.txt"
    excluded.write_text("2\n")
    report = curate(scored_run, tmp_path / "out", CurateOptions(loss_above=0.9, exclude_ids=str(excluded),
                                                                label_ids=str(ids)))
    assert report["dropped"] == {"excluded": 1, "high_loss": 1}  # row 2, then row 5 (loss 3 above the 0.9 quantile)
    assert report["label"] == {
        "from": f"ids {ids}", "bad": 3, "dropped": 2, "dropped_bad": 2, "precision": 1.0, "recall": 0.6667,
        "by_rule": {"excluded": {"matched": 1, "matched_bad": 1, "precision": 1.0, "recall": 0.3333},
                    "high_loss": {"matched": 1, "matched_bad": 1, "precision": 1.0, "recall": 0.3333}}}


@pytest.mark.parametrize("options, message", [
    ({"drop": ["ifd>>1"]}, "--drop 'ifd>>1': 'ifd>>1' is not COLUMN OP VALUE; write e.g. 'ifd>q0.9'"),
    ({"drop": ["ifd>q1.5"]}, "--drop 'ifd>q1.5': q1.5 is not a quantile; give one between 0 and 1"),
    ({"drop": ["ifd>q0.9", "ifd > q0.9"]}, "--drop 'ifd>q0.9': given twice"),
    ({"drop": ["base_loss>1"]}, "has no numeric column 'base_loss'; run inference with base_model to write it"),
    ({"drop": ["colour>1"]}, "has no numeric column 'colour'; it has loss, n_tokens, ifd, agreement, planted"),
    ({"drop": ["ifd>1"], "label_column": "source"}, "--label-column source: holds string; give a column of "
                                                    "true/false"),
    ({"drop": ["ifd>1"], "label_column": "bad"}, "--label-column bad: .* has no such column"),
    ({"drop": ["ifd>1"], "label_column": "planted", "label_ids": "x"}, "--label-column and --label-ids both"),
])
def test_rule_mistakes_are_one_line_errors(scored_run, tmp_path, options, message):
    with pytest.raises(UserError, match=message) as error:
        curate(scored_run, tmp_path / "out", CurateOptions(**options))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out" / "curated_clean.jsonl").exists()


def test_cli_prints_each_rule_and_the_precision_and_recall(scored_run, tmp_path, capsys):
    from gpt4all_training.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["curate", "--input", str(scored_run), "--output", str(tmp_path / "out"), "--drop", "ifd>q0.8",
              "--drop", "agreement<1&loss>2", "--label-column", "planted"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:6] == [
        "read 10, kept 7, dropped 3 (ifd>q0.8 2, agreement<1&loss>2 1)",
        "ifd>q0.8: ifd > 0.84; matched 2, dropped 2",
        "agreement<1&loss>2: agreement < 1, loss > 2; matched 1, dropped 1",
        "known bad (column planted): 3; dropped 2 of them (precision 0.667, recall 0.667)",
        "  ifd>q0.8 on its own: matched 2, precision 0.500, recall 0.333",
        "  agreement<1&loss>2 on its own: matched 1, precision 1.000, recall 0.333"]
