"""GGUF export across the architecture matrix, each file read back by a real llama.cpp.

Tiny models are built from each family's config with the features that change the file layout (GQA, Llama 3 RoPE
scaling, qk-norm, sliding windows, soft-capping, Gemma's norms and embedding scale, fused projections, tied
embeddings, biases, partial rotary, NoPE layers): 2 layers, width 256 (the k-quants' blocks are 256 long: a narrower
row would fall back to another type). The byte-level BPE families use the session's chat tokenizer; Gemma 2 and 3
and Phi-3 a real SentencePiece model trained here, laid out as theirs are (llama.cpp's converter reads their
vocabulary from tokenizer.model). Each is written once in every type (one converter process and one quantizer
process, llama.cpp v0.5.0's, for all), then read by llama.cpp b11549 (the `xllamacpp` wheel): its tokenizer must give
transformers' ids and its logits must match transformers' on the merged fp32 model within a bound derived from the
type below. What each family's check observes is the GGUF cell of the README's architecture matrix
(support/observations.py; tests/test_matrix.py observes the other cells).
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from support.observations import GGUF_FAMILIES, forget, observe

from gpt4all_training.errors import UserError
from gpt4all_training.export import llama_cpp
from gpt4all_training.export.gguf import (TYPES, check_architecture, plan, pre_tokenizer_name, save_for_conversion,
                                          sentencepiece_model)
from gpt4all_training.export.template import SAMPLING

TEXT = ("Which is a species of fish? Tope or Rope. <|im_start|>assistant\nTope<|im_end|>\n"
        "<|im_start|>user\nName 3 fish, 12 cats and 45.5 ünïcödé  spaces.<|im_end|>")
WIDTH = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def family_configs(vocab_size: int, bos: int, eos: int) -> dict:
    """One config per family, with the features of its released models."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos)
    window = dict(sliding_window=8)  # shorter than TEXT, so the windowed layers differ from full attention
    return {
        "llama3": tf.LlamaConfig(**common, **WIDTH, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "smollm2": tf.LlamaConfig(**common, **WIDTH, tie_word_embeddings=True),
        "mistral": tf.MistralConfig(**common, **WIDTH, sliding_window=None),
        "qwen2": tf.Qwen2Config(**common, **WIDTH, tie_word_embeddings=True),  # q/k/v biases
        "qwen3": tf.Qwen3Config(**common, **WIDTH, head_dim=64, tie_word_embeddings=True),  # qk-norm
        "gemma2": tf.Gemma2Config(**common, **WIDTH, **window, head_dim=64, query_pre_attn_scalar=64,
                                  attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        # two sliding-window layers: llama.cpp's fixed Gemma 3 pattern (every sixth layer global) at 2 layers
        "gemma3": tf.Gemma3TextConfig(**common, **WIDTH, **window, head_dim=64, query_pre_attn_scalar=64,
                                      final_logit_softcapping=30.0),
        "phi3": tf.Phi3Config(**common, **{**WIDTH, "num_key_value_heads": 4}, pad_token_id=eos),  # fused qkv
        # every fourth layer without RoPE, as llama.cpp's smollm3 graph has it
        "smollm3": tf.SmolLM3Config(**common, **{**WIDTH, "num_hidden_layers": 4}, no_rope_layers=[1, 1, 1, 0],
                                    pad_token_id=eos),
        "gpt_neox": tf.GPTNeoXConfig(**common, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.25),
    }


# The families whose vocabulary llama.cpp's converter reads from a SentencePiece tokenizer.model, and the layout of
# theirs: Gemma's (<pad> <eos> <bos> <unk>, no dummy prefix) or Llama's, which Phi-3 uses (<unk> <s> </s>, a dummy
# prefix before the text).
SENTENCEPIECE_LAYOUTS = {
    "gemma": dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
                  unk_piece="<unk>", add_dummy_prefix=False),
    "llama": dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True),
}
SENTENCEPIECE_FAMILIES = {"gemma2": "gemma", "gemma3": "gemma", "phi3": "llama"}
TOKENIZER_CLASSES = {"gemma": "GemmaTokenizer", "llama": "LlamaTokenizer"}


def sentencepiece_tokenizer(folder, layout: str):
    """A real SentencePiece BPE model (byte fallback, digits split, as Gemma's and Llama's) trained on the Dolly sample
    with ChatML's markers as pieces, in `folder`, and the transformers tokenizer converted from it with those markers
    special and the chat template; the folder then holds tokenizer.model as a base model's does."""
    import sentencepiece
    from support.files import dolly_texts
    from tokenizers import AddedToken
    from support.models import CHAT_TEMPLATE
    from transformers import AutoTokenizer

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(dolly_texts()), model_writer=model, vocab_size=1000, model_type="bpe",
        byte_fallback=True, split_digits=True, user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        minloglevel=2, **SENTENCEPIECE_LAYOUTS[layout])
    folder.mkdir(parents=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    # As in Phi-3's tokenizer, which llama.cpp assumes for a model named so: the text after each special token gets
    # the dummy prefix too (transformers' `legacy`), its markers take the whitespace after them, and <|endoftext|> is
    # added after the SentencePiece pieces.
    phi3 = layout == "llama"
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": TOKENIZER_CLASSES[layout],
                                                              "legacy": phi3}))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    markers = [AddedToken(marker, special=True, rstrip=phi3) for marker in ("<|im_start|>", "<|im_end|>")]
    tokenizer.add_special_tokens({"additional_special_tokens": markers + (["<|endoftext|>"] if phi3 else [])})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer  # not read back: transformers 5 saves no `legacy`, and reads Phi-3's tokenizer back without it


@pytest.fixture(scope="module")
def family_tokenizers(chat_tokenizer, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sentencepiece")
    layouts = {layout: sentencepiece_tokenizer(root / layout, layout) for layout in SENTENCEPIECE_LAYOUTS}
    return {family: layouts.get(SENTENCEPIECE_FAMILIES.get(family), chat_tokenizer)
            for family in family_configs(1, 0, 0)}


def build(config, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    # Gemma's norms scale by 1 + weight: the same scales as the others' (0.5 to 1.5) are weights of -0.5 to 0.5.
    offset = 1.0 if config.model_type.startswith("gemma") else 0.0
    with torch.no_grad():  # non-trivial norms and biases, so that a misplaced one shows in the logits
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.uniform_(0.5 - offset, 1.5 - offset) if "norm" in name else param.normal_(std=0.1)
    return model


@dataclasses.dataclass
class Family:
    model: object
    tokenizer: object
    files: dict  # dtype -> path of the GGUF written in it


@pytest.fixture(scope="module")
def matrix(family_tokenizers, tmp_path_factory) -> dict[str, Family]:
    """Every family written in every type."""
    root = tmp_path_factory.mktemp("gguf-matrix")
    families, plans = {}, []
    for family, tokenizer in family_tokenizers.items():
        config = family_configs(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)[family]
        model = build(config)
        folder = save_for_conversion(model, tokenizer, root / family, sentencepiece=sentencepiece_model(tokenizer))
        family_plans = {dtype: plan(folder, tokenizer, root / f"{family}-{dtype}.gguf", dtype, family)
                        for dtype in TYPES}
        families[family] = Family(model, tokenizer, {dtype: steps.quantize[1] if steps.quantize
                                                     else steps.convert.outfile
                                                     for dtype, steps in family_plans.items()})
        plans += family_plans.values()
    jobs = {steps.convert.outfile: steps.convert for steps in plans}  # one F32 file feeds every quantized type
    llama_cpp.convert(list(jobs.values()))
    llama_cpp.quantize([steps.quantize for steps in plans if steps.quantize])
    return families


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


# The bound per type: every weight is rounded with a relative error of at most u (of its value for F16/BF16, of its
# block's largest value for the quantized types: half a step of 2^-8 for Q8_0's 127 levels, 2^-4 for the 4-bit
# types, 2^-5 and 2^-6 for Q5_K and Q6_K), and llama.cpp rounds activations to F16 or 8-bit blocks on its own side
# (which sets u for F32). Through the layers the logit error stays a small multiple of u * max|logit|: measured at
# most 6.9 u (Gemma 3's Q8_0; its 4- to 6-bit files 3.3-5.7 u, the other families' at most 4.1 u) on these models;
# 8 u leaves room for other seeds.
UNIT_ROUNDOFF = {"f32": 2.0**-11, "f16": 2.0**-11, "bf16": 2.0**-8, "q8_0": 2.0**-8, "q6_k": 2.0**-6,
                 "q5_k_m": 2.0**-5, "q4_k_m": 2.0**-4, "q4_0": 2.0**-4}


@pytest.fixture(scope="module", autouse=True)
def fresh_observations():
    forget("gguf")


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_llama_cpp_reads_every_type_as_transformers_runs_the_model(matrix, family):
    def check():
        ids = matrix[family].tokenizer(TEXT, add_special_tokens=False)["input_ids"]
        expected = hf_logits(matrix[family].model, ids)
        scale = float(np.abs(expected).max())
        assert set(matrix[family].files) == set(TYPES)
        differences = {}
        for dtype, path in matrix[family].files.items():
            with llama_cpp.LlamaCppModel(path) as model:
                assert model.tokenize(TEXT, add_special=False) == ids, (family, dtype)
                differences[dtype] = float(np.abs(model.logits(ids) - expected).max())
        print(family, {dtype: f"{difference:.1e}" for dtype, difference in differences.items()},
              f"max|logit| {scale:.2f}")
        assert {dtype: difference for dtype, difference in differences.items()
                if difference > 8 * UNIT_ROUNDOFF[dtype] * scale} == {}
        assert differences["q8_0"] > differences["f16"]  # the types differ: each file holds what its name says

    observe("gguf", GGUF_FAMILIES[family], "export_gguf", check)


def test_a_file_carries_template_stop_tokens_sampling_and_names(matrix, chat_tokenizer):
    end_of_turn = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with llama_cpp.LlamaCppModel(matrix["llama3"].files["q4_k_m"]) as model:
        fields = {key: model.metadata(key) for key in (
            "general.architecture", "general.name", "general.file_type", "tokenizer.ggml.pre",
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.chat_template",
            *(f"general.sampling.{key}" for key in SAMPLING))}
        prompt = model.apply_chat_template([{"role": "user", "content": "Name 3 fish."}])
        assert model.is_end_of_generation(end_of_turn)
    assert fields == {
        "general.architecture": "llama", "general.name": "llama3", "general.file_type": "15",  # MOSTLY_Q4_K_M
        "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.eos_token_id": str(end_of_turn),
        "tokenizer.ggml.eot_token_id": str(end_of_turn), "tokenizer.chat_template": chat_tokenizer.chat_template,
        "general.sampling.temp": "0.000000", "general.sampling.top_k": "0", "general.sampling.top_p": "1.000000",
        "general.sampling.penalty_repeat": "1.000000"}
    # llama.cpp renders the file's template itself, as transformers does.
    assert prompt == chat_tokenizer.apply_chat_template([{"role": "user", "content": "Name 3 fish."}],
                                                        add_generation_prompt=True, tokenize=False)


def test_sampling_is_what_generate_and_eval_default_to():
    from gpt4all_training.generation.generate import Sampling

    default = Sampling()
    assert SAMPLING == {"temp": default.temperature, "top_k": default.top_k, "top_p": default.top_p,
                        "penalty_repeat": default.repetition_penalty}


def test_what_cannot_be_written_is_refused_in_one_line_naming_what_can():
    from transformers import Gemma3Config, GPTJConfig, Qwen3Config

    for dtype in TYPES:
        check_architecture(Qwen3Config(), dtype)
    with pytest.raises(UserError, match=r"^--format gguf: model type 'gemma3' is not supported; GGUF is written "
                                        r"for gemma2, gemma3_text, gpt_neox, llama, mistral, phi3, qwen2, qwen3, "
                                        r"smollm3; use --format hf$"):
        check_architecture(Gemma3Config(), "f16")  # the multimodal model: export its text model
    with pytest.raises(UserError, match="^--format gguf: GPT-J cannot be exported as GGUF"):
        check_architecture(GPTJConfig(), "f16")


def test_a_quantized_type_without_the_quantizer_is_refused_in_one_line_saying_how_to_install_it(monkeypatch,
                                                                                                  tmp_path):
    """Where `make install` could not install llama.cpp's quantizer (not Linux x86-64, no npm), before any load."""
    from transformers import Qwen3Config

    monkeypatch.setattr(llama_cpp, "QUANTIZER_DIR", tmp_path)
    monkeypatch.setattr(llama_cpp, "QUANTIZER_LIBRARY", tmp_path / "libllama.v0.5.0.so")
    with pytest.raises(UserError) as error:
        check_architecture(Qwen3Config(), "q4_k_m")
    assert str(error.value) == (f"--dtype q4_k_m: llama.cpp's quantizer is not installed ({tmp_path}/libllama.v0.5.0"
                                f".so); install it with `bash scripts/install_llama_quantizer.sh {tmp_path}` (make "
                                f"install does, on Linux x86-64 with npm), or write one of f32, f16, bf16, q8_0")
    check_architecture(Qwen3Config(), "q8_0")


def test_released_gemma3_configs_export_and_others_are_refused_naming_what_llama_cpp_fixes():
    """llama.cpp fixes Gemma 3's layer pattern, query scale and sliding-layer RoPE instead of reading them from the
    file: a config that differs would be run otherwise than it was trained."""
    from transformers import Gemma3TextConfig

    for layers, hidden, heads, head_dim, scalar in ((26, 1152, 4, 256, 256), (34, 2560, 8, 256, 256),
                                                    (62, 5376, 32, 128, 168)):  # 1B, 4B (global RoPE x8), 27B
        check_architecture(Gemma3TextConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                            head_dim=head_dim, query_pre_attn_scalar=scalar), "q8_0")
    reasons = {
        "its layer_types (llama.cpp makes every sixth layer full attention and the others sliding-window)":
            dict(num_hidden_layers=2, layer_types=["full_attention"] * 2),
        "query_pre_attn_scalar 256 (llama.cpp scales queries by 1/sqrt(64))": dict(head_dim=64),
        "RoPE scaling on its sliding-window layers (llama.cpp scales only the full-attention layers)":
            dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                  "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
    }
    for reason, fields in reasons.items():
        with pytest.raises(UserError) as error:
            check_architecture(Gemma3TextConfig(**fields), "f16")
        assert str(error.value) == (f"--format gguf: llama.cpp would run this Gemma 3 otherwise than transformers: "
                                    f"{reason}; the released Gemma 3 text configurations export; use --format hf")


def test_the_declared_pre_tokenizer_is_the_split_the_model_was_trained_with(chat_tokenizer):
    """A tokenizer without the digit split (SmolLM2's as transformers reads it from its GGUF) is `gpt-2`, one with it
    `smollm`, whatever the base file declared."""
    from tokenizers import pre_tokenizers

    from gpt4all_training.model.loading import load_tokenizer

    assert pre_tokenizer_name(chat_tokenizer) == "gpt-2"
    digits = load_tokenizer(chat_tokenizer.name_or_path)
    digits.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), digits.backend_tokenizer.pre_tokenizer])
    assert pre_tokenizer_name(digits) == "smollm"


def test_the_sentencepiece_model_is_found_only_where_its_pieces_are_the_tokenizers(family_tokenizers, tmp_path):
    """Next to the tokenizer or in a base folder; a tokenizer.model of another vocabulary is never taken."""
    from gpt4all_training.model.loading import load_tokenizer

    gemma, phi3 = family_tokenizers["gemma2"], family_tokenizers["phi3"]
    assert sentencepiece_model(gemma) == Path(gemma.name_or_path) / "tokenizer.model"
    gemma.save_pretrained(tmp_path / "final")  # what training writes: transformers 5 saves no tokenizer.model
    final = load_tokenizer(str(tmp_path / "final"))
    assert not (tmp_path / "final" / "tokenizer.model").exists() and sentencepiece_model(final) is None
    assert sentencepiece_model(final, [None, "no/such-model", gemma.name_or_path]) == sentencepiece_model(gemma)
    assert sentencepiece_model(final, [phi3.name_or_path]) is None  # Llama's layout: other pieces


def test_a_family_whose_converter_needs_sentencepiece_is_refused_in_one_line_without_it(family_tokenizers, tmp_path):
    """llama.cpp's converter reads Phi-3's (and Gemma 2's) vocabulary only from tokenizer.model."""
    tokenizer = family_tokenizers["phi3"]
    from gpt4all_training.model.loading import load_tokenizer

    tokenizer.save_pretrained(tmp_path / "tokenizer")  # a fine-tune's tokenizer, without the base's model
    config = family_configs(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)["phi3"]
    config.num_hidden_layers = 1
    with pytest.raises(UserError) as error:
        llama_cpp.convert([plan(save_for_conversion(build(config), load_tokenizer(str(tmp_path / "tokenizer")),
                                                    tmp_path / "phi3"), tokenizer, tmp_path / "phi3.gguf", "q8_0",
                                "phi3").convert])
    assert str(error.value) == ("--format gguf: llama.cpp's converter writes Phi3ForCausalLM only with its "
                                "SentencePiece tokenizer.model, and none whose pieces are the tokenizer's was found "
                                "next to the weights, the tokenizer or the base model (copy the base model's "
                                "tokenizer.model into the folder you export); use --format hf")
    assert not (tmp_path / "phi3.gguf").exists()


# Reads every file it is given with the gpt4all client (its bundled llama.cpp), one line per file.
GPT4ALL_PROBE = """
import sys
from pathlib import Path
from gpt4all import GPT4All
from gpt4all._pyllmodel import llmodel
for name in sys.argv[1:]:
    path = Path(name)
    try:
        client = GPT4All(path.name, model_path=str(path.parent), allow_download=False, device="cpu")
    except RuntimeError as error:
        print(path.name, "refused:", error, flush=True)
        continue
    print(path.name, "loaded" if llmodel.llmodel_isModelLoaded(client.model.model) else "not loaded", flush=True)
    client.close()
"""
# What the gpt4all 2.8.2 client (a llama.cpp of mid-2024) does with each family's file. Its Gemma 2 graph knows only
# the 9B and 27B models (42 and 46 layers) and aborts the process on any other: Gemma 2 2B's fine-tunes too.
GPT4ALL_2_8 = {**dict.fromkeys(["llama3", "mistral", "qwen2", "phi3", "gpt_neox"], "loaded"),
               **{family: f"refused: Unable to instantiate model: Unsupported model architecture: {architecture}"
                  for family, architecture in (("qwen3", "qwen3"), ("gemma3", "gemma3"), ("smollm3", "smollm3"))},
               "gemma2": "aborts"}


@pytest.mark.integration
@pytest.mark.slow
def test_which_families_the_gpt4all_2_8_client_reads(matrix, tmp_path):
    """The README's client table: each family's Q8_0 file through gpt4all 2.8.2, in child processes (one that
    aborts takes only its own)."""
    import subprocess
    import sys

    def probe(families: list[str]) -> subprocess.CompletedProcess:
        paths = [str(matrix[family].files["q8_0"]) for family in families]
        return subprocess.run([sys.executable, "-c", GPT4ALL_PROBE, *paths], capture_output=True, text=True,
                              timeout=300)

    readable = [family for family, outcome in GPT4ALL_2_8.items() if outcome != "aborts"]
    lines = probe(readable).stdout.splitlines()
    outcomes = {family: line.removeprefix(f"{family}-q8_0.gguf ") for family, line in zip(readable, lines)}
    aborted = probe(["gemma2"])
    outcomes["gemma2"] = "aborts" if aborted.returncode < 0 and "GGML_ASSERT" in aborted.stderr else aborted.stdout
    assert outcomes == GPT4ALL_2_8
