"""The chat template in exports (export/template.py): the Ollama Modelfile beside a GGUF, and the slim HF folder's
tokenizer config and generation config. A GGUF read by a real client is in test_chat_e2e.py."""

from __future__ import annotations

import json

import pytest
from support.models import CHAT_TEMPLATE, build_tiny_llama

from gpt4all_training.export.hf import export
from gpt4all_training.export.template import OLLAMA_CHATML, chatml_default_system, ollama_modelfile

# The sampling the models were evaluated with (greedy, no repetition penalty), in every Modelfile.
SAMPLING = "PARAMETER temperature 0\nPARAMETER top_k 0\nPARAMETER top_p 1\nPARAMETER repeat_penalty 1\n"


@pytest.mark.slow
def test_smollm2_modelfile_keeps_its_default_system_message(smollm2_tokenizer):
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert chatml_default_system(smollm2_tokenizer) == (True, system)
    assert ollama_modelfile("smol.gguf", smollm2_tokenizer) == (
        f'FROM ./smol.gguf\nSYSTEM """{system}"""\nTEMPLATE """{OLLAMA_CHATML}"""\nPARAMETER stop "<|im_end|>"\n{SAMPLING}')


def test_chatml_without_a_default_system_message(chat_tokenizer):
    assert chatml_default_system(chat_tokenizer) == (True, None)
    assert ollama_modelfile("m.gguf", chat_tokenizer) == (
        f'FROM ./m.gguf\nTEMPLATE """{OLLAMA_CHATML}"""\nPARAMETER stop "<|endoftext|>"\nPARAMETER stop "<|im_end|>"\n'
        f'{SAMPLING}')


def test_a_template_that_is_not_chatml_gets_no_template(llama2_chat_tokenizer, chat_tokenizer):
    assert chatml_default_system(llama2_chat_tokenizer) == (False, None)
    assert ollama_modelfile("m.gguf", llama2_chat_tokenizer).splitlines() == [
        "FROM ./m.gguf",
        "# No TEMPLATE: only ChatML chat templates are translated to Ollama's Go templates. Ollama picks its template "
        "by matching the GGUF's tokenizer.chat_template against those it knows.",
        'PARAMETER stop "<|endoftext|>"', *SAMPLING.splitlines()]
    # ChatML with a different separator is not ChatML: Ollama's template would render other text.
    chat_tokenizer.chat_template = CHAT_TEMPLATE.replace("\n{{ message['content'] }}", ": {{ message['content'] }}")
    try:
        assert chatml_default_system(chat_tokenizer) == (False, None)
    finally:
        chat_tokenizer.chat_template = CHAT_TEMPLATE


def test_hf_folder_carries_the_template_in_its_configs(chat_tokenizer, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    model = build_tiny_llama(chat_tokenizer)
    model.save_pretrained(tmp_path / "model")
    chat_tokenizer.save_pretrained(tmp_path / "model")
    export(str(tmp_path / "model"), str(tmp_path / "out"), "hf", "f32")
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (tmp_path / "out" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == CHAT_TEMPLATE
    # generate() stops at EOS or at the end of a turn.
    assert GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == [0, 1001]


def test_gguf_of_a_tokenizer_without_template_keeps_its_eos(tokenizer, tmp_path):
    import gguf

    model = build_tiny_llama(tokenizer)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    export(str(tmp_path / "model"), str(tmp_path / "out"), "gguf", "f32")
    fields = gguf.GGUFReader(str(tmp_path / "out" / "out-F32.gguf")).fields
    assert fields["tokenizer.ggml.eos_token_id"].contents() == tokenizer.eos_token_id
    assert "tokenizer.ggml.eot_token_id" not in fields and "tokenizer.chat_template" not in fields
    assert [line for line in (tmp_path / "out" / "Modelfile").read_text().splitlines() if "stop" in line] == [
        'PARAMETER stop "<|endoftext|>"']
    # Its agreement with the model is measured on the fixed prompts as plain text: there is no template to ask in.
    card = (tmp_path / "out" / "README.md").read_text()
    assert "at every position of 4 fixed prompts (`What is the capital of France?`;" in card
