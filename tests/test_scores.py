"""inference's scores against hand computations on tiny models: IFD as the loss of the response given its prompt over
its loss alone (both by plain transformers forwards), the base model's loss and the change, IFD under a proxy model
with its own tokenizer and chat template (Superfiltering), the greedy answer and a checker's agreement (built in and
a user's file); the outlier score on planted points; and the config's mistakes as one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from support.files import read_jsonl, write_jsonl
from support.models import build_tiny_gptj, build_tiny_llama
from gpt4all_training.analysis.curation.curate import REMOVED_FILE, CurateOptions, curate
from gpt4all_training.analysis.inference import SCORE_COLUMNS, run_inference
from gpt4all_training.analysis.scores import last_turn_start, outlier_scores, response_only
from gpt4all_training.batch import IGNORE
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import InferenceConfig
from gpt4all_training.errors import UserError
from gpt4all_training.model.loading import load_model

ANSWER_TOKENS = 6  # checker_max_new_tokens
AGREEING = (0, 3, 5)  # records whose response is set to the model's own greedy answer
USER_CHECKER = """
def longer_than_record(prompts, completions, completion_ids, response, source, **columns):
    assert len(prompts) == len(completions) == len(completion_ids) == len(response) == len(source)
    return [float(len(c) > len(r)) for c, r in zip(completions, response)]
"""
# A verifier that computes each sum from its prompt: it knows the right answer without any model.
SUMS_VERIFIER = """
import re


def sum_is_right(prompts, completions, completion_ids, response, **columns):
    assert completions == response and all(completion_ids)
    sums = [sum(map(int, re.search(r"what is (\\d+) plus (\\d+)", p).groups())) for p in prompts]
    return [float(c == f"It is {s}.") for c, s in zip(completions, sums)]
"""


def nll(model, ids: list[int], first: int) -> float:
    """The mean negative log-likelihood of ids[first:], each token given every token before it, in float64."""
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return float(np.mean([-log_probs[t - 1, ids[t]].item() for t in range(first, len(ids))]))


def greedy(model, ids: list[int], eos: int, max_new_tokens: int) -> list[int]:
    """Argmax decoding by repeated full forwards: the tokens before EOS, at most max_new_tokens."""
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_new_tokens:
            token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if token == eos:
                break
            out.append(token)
    return out


def plain_prompt(tokenizer, prompt: str) -> list[int]:
    return tokenizer(prompt + "\n")["input_ids"]


def response_ids(tokenizer, response: str) -> list[int]:
    return tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


@pytest.fixture(scope="module")
def scored(tiny_model_dir, tokenizer, chat_tokenizer, tmp_path_factory):
    """Twelve sums, three of them answered as the fine-tuned model answers them, scored with every score on: (the
    output rows by index, the records, the three model folders, the output folder)."""
    root = tmp_path_factory.mktemp("scores")
    base, proxy = root / "base", root / "proxy"
    build_tiny_gptj(tokenizer, seed=1).save_pretrained(base)
    tokenizer.save_pretrained(base)
    build_tiny_llama(chat_tokenizer, seed=2).save_pretrained(proxy)
    chat_tokenizer.save_pretrained(proxy)
    model = load_model(str(tiny_model_dir)).eval()
    records = [{"source": "sums", "prompt": f"Question {i}: what is {i} plus {i}?", "response": f"It is {2 * i}."}
               for i in range(12)]
    for i in AGREEING:
        answer = tokenizer.decode(greedy(model, plain_prompt(tokenizer, records[i]["prompt"]),
                                         tokenizer.eos_token_id, ANSWER_TOKENS), skip_special_tokens=True)
        assert answer.strip(), "the fixture needs an answer that is not empty"
        records[i]["response"] = answer
    data = write_jsonl(root / "data" / "sums_clean.jsonl", records).parent
    verifier = root / "verify.py"
    verifier.write_text(SUMS_VERIFIER)
    config = validate(InferenceConfig(
        model_name=str(tiny_model_dir), dataset_path=str(data), output_dir=str(root / "out"), max_length=64,
        val_fraction=0.25, batch_size=4, num_proc=1, ifd=True, base_model=str(base), ifd_model=str(proxy),
        checker={"name": "exact_match"}, checker_max_new_tokens=ANSWER_TOKENS,
        verifier={"module": str(verifier), "function": "sum_is_right"}))
    table = pq.read_table(run_inference(config))
    rows = {row["index"]: row for row in table.to_pylist()}
    return rows, records, (model, load_model(str(base)).eval(), load_model(str(proxy)).eval()), root / "out"


@pytest.mark.integration
@pytest.mark.slow
def test_ifd_is_the_ratio_of_two_hand_computed_losses(scored, tokenizer):
    rows, records, (model, _, _), _ = scored
    assert len(rows) == 12
    for index, record in enumerate(records):
        prompt, target = plain_prompt(tokenizer, record["prompt"]), response_ids(tokenizer, record["response"])
        given = nll(model, prompt + target, len(prompt))
        alone = nll(model, [tokenizer.bos_token_id] + target, 1)  # every response token predicted, as given
        row = rows[index]
        assert row["loss"] == pytest.approx(given, abs=1e-5)
        assert row["response_loss"] == pytest.approx(alone, abs=1e-5)
        assert row["ifd"] == pytest.approx(given / alone, rel=1e-5)


@pytest.mark.integration
@pytest.mark.slow
def test_curate_drops_by_the_hand_computed_ifd(scored, tokenizer, tmp_path):
    """`curate --drop 'ifd>q0.5'` drops the records whose IFD, computed by hand, is above the median of all twelve;
    `agreement<1` keeps exactly the records that repeat the model's answer."""
    rows, records, (model, _, _), out = scored
    hand = []
    for record in records:
        prompt, target = plain_prompt(tokenizer, record["prompt"]), response_ids(tokenizer, record["response"])
        hand.append(nll(model, prompt + target, len(prompt)) / nll(model, [tokenizer.bos_token_id] + target, 1))
    report = curate(out, tmp_path / "by-ifd", CurateOptions(drop=["ifd>q0.5"]))
    dropped = sorted(r["index"] for r in read_jsonl(tmp_path / "by-ifd" / REMOVED_FILE))
    assert dropped == [i for i, value in enumerate(hand) if value > np.quantile(hand, 0.5)]
    assert report["rules"]["drop"][0]["conditions"][0]["threshold"] == pytest.approx(np.quantile(hand, 0.5), rel=1e-5)
    curate(out, tmp_path / "agreeing", CurateOptions(drop=["agreement<1"]))
    kept = read_jsonl(tmp_path / "agreeing" / "curated_clean.jsonl")
    assert [r["response"] for r in kept] == [records[i]["response"] for i in AGREEING]


@pytest.mark.integration
@pytest.mark.slow
def test_base_loss_and_loss_change_by_hand(scored, tokenizer):
    rows, records, (model, base, _), _ = scored
    changes = []
    for index, record in enumerate(records):
        prompt, target = plain_prompt(tokenizer, record["prompt"]), response_ids(tokenizer, record["response"])
        before = nll(base, prompt + target, len(prompt))
        assert rows[index]["base_loss"] == pytest.approx(before, abs=1e-5)
        assert rows[index]["loss_change"] == pytest.approx(nll(model, prompt + target, len(prompt)) - before,
                                                           abs=1e-5)
        changes.append(rows[index]["loss_change"])
    assert np.abs(changes).min() > 1e-3  # two different models: the change is not trivially 0


@pytest.mark.integration
@pytest.mark.slow
def test_proxy_ifd_uses_the_proxys_own_tokenizer_and_template(scored, chat_tokenizer):
    """The proxy's tokenizer has a chat template, so `prompt_template: auto` writes its prompts as chat turns, as
    training that model would."""
    rows, records, (_, _, proxy), _ = scored
    for index, record in enumerate(records):
        text = chat_tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}], tokenize=False,
                                                  add_generation_prompt=True)
        prompt = chat_tokenizer(text, add_special_tokens=False)["input_ids"]
        target = response_ids(chat_tokenizer, record["response"])
        expected = nll(proxy, prompt + target, len(prompt)) / nll(proxy, [chat_tokenizer.bos_token_id] + target, 1)
        assert rows[index]["proxy_ifd"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.integration
@pytest.mark.slow
def test_model_answer_is_the_greedy_decode_and_agreement_the_exact_match(scored, tokenizer):
    rows, records, (model, _, _), _ = scored
    for index, record in enumerate(records):
        answer = tokenizer.decode(greedy(model, plain_prompt(tokenizer, record["prompt"]), tokenizer.eos_token_id,
                                         ANSWER_TOKENS), skip_special_tokens=True)
        assert rows[index]["model_answer"] == answer
        assert rows[index]["agreement"] == float(answer.strip() == record["response"].strip())
    assert sorted(i for i, row in rows.items() if row["agreement"] == 1.0) == list(AGREEING)


@pytest.mark.integration
@pytest.mark.slow
def test_verified_checks_each_records_own_answer(scored, tmp_path):
    """The verifier scores the record's response with no model: the nine sums answered right score 1, the three
    answered as the model answers them 0; `curate --drop 'verified<1'` keeps exactly the nine."""
    rows, records, _, out = scored
    right = [i for i, record in enumerate(records) if record["response"] == f"It is {2 * i}."]
    assert right == [i for i in range(12) if i not in AGREEING]
    assert [rows[i]["verified"] for i in range(12)] == [float(i in right) for i in range(12)]
    curate(out, tmp_path / "verified", CurateOptions(drop=["verified<1"]))
    kept = read_jsonl(tmp_path / "verified" / "curated_clean.jsonl")
    assert [r["response"] for r in kept] == [records[i]["response"] for i in right]


@pytest.mark.integration
@pytest.mark.slow
def test_summary_and_columns(scored):
    rows, _, _, out = scored
    assert list(rows[0])[-len(SCORE_COLUMNS):] == list(SCORE_COLUMNS)  # after the record's fields and the results
    summary = json.loads((out / "inference.json").read_text())
    assert summary["scores"]["agreement"] == {"examples": 12, "mean": 0.25,
                                              "quantiles": {"0.1": 0.0, "0.5": 0.0, "0.9": 1.0}}
    assert summary["scores"]["ifd"]["mean"] == pytest.approx(np.mean([r["ifd"] for r in rows.values()]), abs=1e-4)


@pytest.mark.integration
def test_a_users_checker_gets_the_answers_and_every_record_field(tiny_model_dir, tmp_path, capsys):
    module = tmp_path / "checks.py"
    module.write_text(USER_CHECKER)
    records = [{"source": "s", "prompt": f"Say {w}.", "response": w} for w in ("a", "bb", "a longer answer")]
    data = write_jsonl(tmp_path / "data" / "say_clean.jsonl", records).parent
    config = validate(InferenceConfig(
        model_name=str(tiny_model_dir), dataset_path=str(data), output_dir=str(tmp_path / "out"), max_length=32,
        val_fraction=0.0, num_proc=1, checker={"module": str(module), "function": "longer_than_record"},
        checker_max_new_tokens=5, outliers=False))
    table = pq.read_table(run_inference(config))
    answers, responses = table.column("model_answer").to_pylist(), table.column("response").to_pylist()
    assert table.column("agreement").to_pylist() == [float(len(a) > len(r)) for a, r in zip(answers, responses)]
    assert "outlier" not in table.column_names and "ifd" not in table.column_names
    assert f"checker: running your code: longer_than_record from {module}" in capsys.readouterr().out


@pytest.mark.integration
@pytest.mark.slow
def test_a_conversation_is_answered_from_its_last_trained_turn(chat_tokenizer, tmp_path):
    """For a conversation the model answers its last assistant turn from everything before it, written by the chat
    template with its generation prompt, and stops at the template's end of turn; the checker compares with that
    turn, the `response` column."""
    model_dir = tmp_path / "chat-model"
    build_tiny_llama(chat_tokenizer, seed=3).save_pretrained(model_dir)
    chat_tokenizer.save_pretrained(model_dir)
    model = load_model(str(model_dir)).eval()
    end_of_turn = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")

    def answer(messages: list[dict]) -> str:
        text = chat_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = chat_tokenizer(text, add_special_tokens=False)["input_ids"]
        out: list[int] = []
        with torch.no_grad():
            while len(out) < ANSWER_TOKENS:
                token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
                if token in (end_of_turn, chat_tokenizer.eos_token_id):
                    break
                out.append(token)
        return chat_tokenizer.decode(out, skip_special_tokens=True)

    conversations = []
    for i in range(5):
        messages = [{"role": "user", "content": f"Name {i}."}, {"role": "assistant", "content": f"Name {i} it is."},
                    {"role": "user", "content": f"And {i + 1}?"}]
        reply = answer(messages) if i in (1, 3) else f"That is {i + 1}."
        assert reply.strip(), "the fixture needs an answer that is not empty"
        conversations.append({"messages": [*messages, {"role": "assistant", "content": reply}], "source": "c"})
    data = write_jsonl(tmp_path / "data" / "talk_clean.jsonl", conversations).parent
    table = pq.read_table(run_inference(validate(InferenceConfig(
        model_name=str(model_dir), dataset_path=str(data), output_dir=str(tmp_path / "out"), max_length=96,
        val_fraction=0.0, num_proc=1, checker={"name": "exact_match"}, checker_max_new_tokens=ANSWER_TOKENS))))
    assert table.column("model_answer").to_pylist() == [answer(c["messages"][:-1]) for c in conversations]
    assert table.column("agreement").to_pylist() == [0.0, 1.0, 0.0, 1.0, 0.0]


def test_outlier_score_marks_the_isolated_point():
    rng = np.random.default_rng(0)
    embeddings = np.concatenate([rng.normal(0, 0.05, (60, 16)) + 1, rng.normal(0, 0.05, (60, 16)) - 1,
                                 np.full((1, 16), 4.0) * np.array([1, -1] * 8)]).astype(np.float32)
    embeddings[5, 3] = np.nan  # an overflowed embedding gets no score, and does not stop the others
    scores = outlier_scores(embeddings, seed=0)
    assert np.isnan(scores[5]) and np.isfinite(np.delete(scores, 5)).all()
    assert int(np.nanargmax(scores)) == 120 and scores[120] > 3
    assert np.nanmedian(scores[:120]) == pytest.approx(1.0, abs=0.1)
    assert np.isnan(outlier_scores(embeddings[:2], seed=0)).all()  # no neighbourhood to compare with


def test_response_alone_and_the_last_trained_turn():
    row = {"input_ids": [9, 8, 7, 6, 5, 4, 3, 2], "labels": [IGNORE, IGNORE, 7, 6, IGNORE, IGNORE, 3, 2]}
    assert response_only(row, 1) == {"input_ids": [1, 7, 6, 3, 2], "labels": [IGNORE, 7, 6, 3, 2]}
    assert last_turn_start(row["labels"]) == 6  # the model answers the last turn from ids[:6]
    assert last_turn_start([IGNORE, IGNORE, 5, 6, IGNORE]) == 2  # an untrained tail (a template's newline)


@pytest.mark.parametrize("override, message", [
    ("checker={name: bleu}", "checker: no built-in checker is called 'bleu'; the built-in ones are exact_match, "
                             "numeric_match (your own function: module and function)"),
    ("checker={module: c.py}", "checker: give name (exact_match or numeric_match), or module (a .py file) and "
                               "function (the name of a function in it)"),
    ("checker={name: exact_match, weight: 2}", "checker: unknown key 'weight'; it takes name, field, pattern"),
    ("checker={name: exact_match, pattern: '('}", "checker: pattern '(' is not a regular expression"),
    ("checker_max_new_tokens=0", "checker_max_new_tokens: must be at least 1, got 0"),
    ("verifier={name: bleu}", "verifier: no built-in verifier is called 'bleu'; the built-in ones are exact_match, "
                              "numeric_match (your own function: module and function)"),
    ("base_model=' '", "base_model: must name a model (or leave it unset), got ' '"),
])
def test_config_mistakes_are_one_line_errors(override, message):
    with pytest.raises(UserError) as error:
        load_config(None, ["model_name=m", "dataset_path=d", override], cls=InferenceConfig, check=validate)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.integration
def test_run_mistakes_are_refused_before_the_data_loads(tiny_model_dir, chat_tokenizer, tmp_path):
    """A base model with another vocabulary, and a checker file that does not exist: one line each, before the
    examples are tokenized and any model's weights load."""
    other = tmp_path / "chat-model"
    build_tiny_gptj(chat_tokenizer).save_pretrained(other)
    chat_tokenizer.save_pretrained(other)
    data = write_jsonl(tmp_path / "data" / "one_clean.jsonl", [{"source": "s", "prompt": "p", "response": "r"}])
    values = dict(model_name=str(tiny_model_dir), dataset_path=str(data.parent), output_dir=str(tmp_path / "o"),
                  max_length=32, num_proc=1)
    with pytest.raises(UserError, match=rf"^base_model {other}: its tokenizer gives '<\|im_(start|end)\|>' the id "
                                        r"100[01], this run's tokenizer None; loss_change compares the same tokens"):
        run_inference(validate(InferenceConfig(**values, base_model=str(other))))
    with pytest.raises(UserError, match=rf"^checker: module {tmp_path / 'no.py'}: no such file"):
        run_inference(validate(InferenceConfig(**values, checker={"module": str(tmp_path / "no.py"),
                                                                  "function": "f"})))
    assert not Path(tmp_path / "o" / "inference.parquet").exists()
