"""Conversations through the stages around training: generation from a conversation (`--messages`), `data.py
--show` and `--dump`, and inference's per-example loss over the trained turns. A tiny GPT-J over the ChatML
`chat_tokenizer`, whose EOS (<|endoftext|>) is not its end-of-turn token (<|im_end|>)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from support.conversations import TOPICS, two_rounds, write_conversations
from support.files import read_jsonl, write_jsonl
from support.models import build_tiny_gptj
from support.paths import REPO

from gpt4all_training.analysis.inference import run_inference
from gpt4all_training.batch import IGNORE
from gpt4all_training.cli.main import main
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import InferenceConfig
from gpt4all_training.data.chat import encode_for_generation
from gpt4all_training.data.sft import load_data, show_example
from gpt4all_training.generation.generate import generate_replies, generate_texts

CHAT_CONFIG = REPO / "configs" / "train" / "chat_tiny.yaml"
GENERATE_CONFIG = REPO / "configs" / "generate" / "tiny.yaml"


@pytest.fixture(scope="module")
def chat_model_dir(chat_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-gptj")
    build_tiny_gptj(chat_tokenizer, seed=3).save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def conversations_dir(tmp_path_factory):
    return write_conversations(tmp_path_factory.mktemp("conversations"))


def cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


# ---------------------------------------------------------------- generation

def test_a_reply_starts_from_the_training_encoding_and_stops_at_end_of_turn(chat_tokenizer):
    conversation = two_rounds(*TOPICS[0][:2])
    [ids] = encode_for_generation(chat_tokenizer, [conversation])
    assert ids == chat_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False, sanitize_control_tokens=True)
    model = build_tiny_gptj(chat_tokenizer, seed=3).eval()
    end_of_turn = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        model.lm_head.bias[end_of_turn] += 100.0  # <|im_end|> is now every step's argmax
    assert generate_replies(model, chat_tokenizer, [conversation, conversation[:2]], 10) == ["", ""]
    # A prompt written with the chat template stops there too, though the tokenizer's EOS is another token.
    assert generate_texts(model, chat_tokenizer, ["Hi"], "chat", 10) == [""]


def test_cli_messages_jsonl_appends_each_reply(chat_model_dir, chat_tokenizer, tmp_path, capsys):
    from gpt4all_training.model.loading import load_model

    conversations = [two_rounds(*TOPICS[0][:2]), two_rounds(*TOPICS[1][:2])[:2]]
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": conversations[0]}, conversations[1]])
    code, out, err = cli(capsys, "generate", "--config", GENERATE_CONFIG, "--messages", path,
                         f"model_name={chat_model_dir}", "max_new_tokens=6")
    assert code == 0, err
    replies = generate_replies(load_model(str(chat_model_dir)).eval(), chat_tokenizer, conversations, 6)
    assert [json.loads(line) for line in out.splitlines()] == [
        {"messages": [*c, {"role": "assistant", "content": r}]} for c, r in zip(conversations, replies)]
    (tmp_path / "one.json").write_text(json.dumps({"messages": conversations[0]}))
    code, out, err = cli(capsys, "generate", "--config", GENERATE_CONFIG, "--messages", tmp_path / "one.json",
                         f"model_name={chat_model_dir}", "max_new_tokens=6")
    assert (code, out) == (0, replies[0] + "\n")


@pytest.mark.parametrize("content, message", [
    ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}',
     "not a conversation to answer (roles_out_of_order)"),
    ('[{"role": "user", "content": ""}]', "not a conversation to answer (empty_turn)"),
    ('{"messages": "Hi"}', "not a conversation to answer (malformed_messages)"),
    ("{", "not valid JSON"),
], ids=["ends-with-answer", "empty", "not-a-list", "bad-json"])
def test_cli_bad_messages_file_is_one_line(chat_model_dir, tmp_path, capsys, content, message):
    path = tmp_path / "chats.jsonl"
    path.write_text(content + "\n")
    code, out, err = cli(capsys, "generate", "--messages", path, f"model_name={chat_model_dir}")
    assert code == 2
    assert err.startswith(f"error: messages_file {path}:1: {message}") and err.count("\n") == 1


def test_messages_and_a_prompt_together_are_refused(chat_model_dir, tmp_path, capsys):
    """In the config; on the command line the last flag given wins, as --prompt and --prompts-file do."""
    path = write_jsonl(tmp_path / "chats.jsonl", [two_rounds(*TOPICS[0][:2])])
    code, _, err = cli(capsys, "generate", f"messages_file={path}", f"model_name={chat_model_dir}", "prompt=Hi")
    assert code == 2
    assert err == (f"error: messages_file: give either messages_file or a prompt (prompt, prompts_file), not both, "
                   f"got '{path}'\n")


# ---------------------------------------------------------------- data.py --show and --dump

def test_show_and_dump(chat_model_dir, chat_tokenizer, conversations_dir, tmp_path, capsys):
    dump = tmp_path / "dump.jsonl"
    overrides = [f"model_name={chat_model_dir}", f"dataset_path={conversations_dir}", "val_fraction=0.25"]
    code, out, err = cli(capsys, "data", "--config", CHAT_CONFIG, "--show", 1, "--dump", dump, *overrides)
    assert code == 0, err
    (train, val), _ = load_data(load_config(CHAT_CONFIG, overrides), chat_tokenizer)
    first = train[0]
    assert out.splitlines()[:2] == [f"--- example {first['index']} ({first['n_trained']} trained tokens, between "
                                    f"{{+ and +}})", *show_example(first, chat_tokenizer).splitlines()[:1]]
    question, answer, second = TOPICS[first["index"]]
    assert show_example(first, chat_tokenizer) == (
        f"<|im_start|>system\nAnswer with one word.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        f"<|im_start|>assistant\n{{+{answer}<|im_end|>+}}\n<|im_start|>user\nAnother one?<|im_end|>\n"
        f"<|im_start|>assistant\n{{+{second}<|im_end|>+}}\n")
    assert out.splitlines()[-1] == f"{dump}: 8 examples"
    rows = read_jsonl(dump)
    assert [(r["split"], r["index"]) for r in rows] == [("train", i) for i in train["index"]] + \
        [("val", i) for i in val["index"]]
    assert [r["input_ids"] for r in rows] == list(train["input_ids"]) + list(val["input_ids"])
    assert [r["labels"] for r in rows] == list(train["labels"]) + list(val["labels"])
    assert sorted(r["index"] for r in rows) == list(range(8))


# ---------------------------------------------------------------- inference

@pytest.mark.integration
def test_inference_scores_the_trained_turns_and_pools_the_whole_conversation(chat_model_dir, chat_tokenizer,
                                                                              conversations_dir, tmp_path):
    from gpt4all_training.model.loading import load_model

    config = validate(InferenceConfig(model_name=str(chat_model_dir), dataset_path=str(conversations_dir),
                                      output_dir=str(tmp_path), val_fraction=0.25, max_length=128, num_proc=1,
                                      seed=0, batch_size=3))  # chat_tiny.yaml's split
    table = pq.read_table(run_inference(config))
    rows = table.drop_columns(["embedding"]).to_pylist()
    embeddings = table.column("embedding").combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
    assert len(rows) == 8
    model = load_model(str(chat_model_dir)).eval()
    (train, _), _ = load_data(load_config(CHAT_CONFIG, [f"model_name={chat_model_dir}",
                                                        f"dataset_path={conversations_dir}", "val_fraction=0.25"]),
                              chat_tokenizer)
    example = train[0]
    ids, labels = example["input_ids"], example["labels"]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    log_probs = torch.log_softmax(out.logits[0].double(), dim=-1)
    nll = [-log_probs[t, ids[t + 1]].item() for t in range(len(ids) - 1) if labels[t + 1] != IGNORE]
    row = next(i for i, r in enumerate(rows) if (r["split"], r["index"]) == ("train", example["index"]))
    question, answer, second = TOPICS[example["index"]]
    assert rows[row]["n_tokens"] == len(nll) == example["n_trained"] > 0
    assert rows[row]["loss"] == pytest.approx(sum(nll) / len(nll), abs=1e-5)
    # `last` pooling: the state after the conversation's final token, which has read every turn.
    np.testing.assert_allclose(embeddings[row], out.hidden_states[-1][0, -1].numpy(), atol=1e-5)
    assert (rows[row]["prompt"], rows[row]["response"]) == (
        f"system: Answer with one word.\nuser: {question}\nassistant: {answer}\nuser: Another one?", second)


# ---------------------------------------------------------------- check

@pytest.mark.integration
def test_check_passes_a_conversation_dataset_with_a_dry_run(chat_model_dir, conversations_dir, tmp_path):
    from gpt4all_training.preflight.check import run_checks

    config = tmp_path / "c.yaml"
    config.write_text(f"model_name: {chat_model_dir}\ndataset_path: {conversations_dir}\n"
                      f"output_dir: {tmp_path / 'out'}\nmax_length: 64\nbatch_size: 4\nnum_proc: 1\n")
    outcomes = {o.name: o.line() for o in run_checks(str(config), [], report=lambda line: None)}
    assert outcomes["dataset"] == f"ok    dataset: {conversations_dir}: 8 records, all with messages"
    assert outcomes["dry run"].startswith("ok    dry run: 2 steps on 2 examples passed"), outcomes
    assert all(line.startswith("ok") for line in outcomes.values()), outcomes


# ---------------------------------------------------------------- batches

def test_conversations_pack_and_group_like_any_example(chat_tokenizer, chat_model_dir, conversations_dir):
    """The batch builders and the sampler read input_ids, labels and length only: a packed micro-batch of
    conversations trains exactly the tokens the padded one does."""
    from gpt4all_training.batch import trained_token_count
    from gpt4all_training.data.batching import batch_fetcher
    from gpt4all_training.data.sampling import StepSampler

    config = load_config(CHAT_CONFIG, [f"model_name={chat_model_dir}", f"dataset_path={conversations_dir}",
                                       "packing=true", "group_by_length=true", "max_length=128"])
    (train, _), _ = load_data(config, chat_tokenizer)
    sampler = StepSampler(len(train), 4, 1, 0, 1, 0, lengths=train["length"])
    [indices] = sampler.step_indices(0)
    padded = batch_fetcher(False, 128)(train, indices, chat_tokenizer.pad_token_id)
    packed = batch_fetcher(True, 128)(train, indices, chat_tokenizer.pad_token_id)
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0]
    assert trained_token_count(packed) == trained_token_count(padded) == sum(train[i]["n_trained"] for i in indices)
    assert sorted(packed["labels"][packed["labels"] != IGNORE].tolist()) == \
        sorted(padded["labels"][padded["labels"] != IGNORE].tolist())
