"""export/hf.py and export/gguf.py: files that real readers load back to the same model.

Every GGUF here is read by transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`), the same layout
llama.cpp reads; every HF export by `from_pretrained(dir)`. The models are a tiny Llama (2 layers, width 64,
4 heads, 2 KV heads) with a byte-level BPE tokenizer that has a chat template and ChatML special tokens.
"""

from __future__ import annotations

import copy
import itertools
import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from support.files import dolly_texts
from support.launch import free_port
from support.models import CHAT_TEMPLATE, build_tiny_llama
from support.paths import PYTHON, REPO
from gpt4all_training.errors import UserError
from gpt4all_training.export.formats import FORMATS, ExportFormat, ExportRequest, Written, described
from gpt4all_training.export.hf import export, training_method
from gpt4all_training.training.checkpoint import write_marker

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_model_folder(model, tokenizer, path, license_id: str | None = "apache-2.0"):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if license_id:
        (path / "README.md").write_text(f"---\nlicense: {license_id}\n---\n# tiny\n")
    return path


@pytest.fixture(scope="module")
def tiny_llama_dir(chat_tokenizer, tmp_path_factory):
    return save_model_folder(build_tiny_llama(chat_tokenizer), chat_tokenizer, tmp_path_factory.mktemp("tiny-llama"))


def sample_ids(tokenizer) -> torch.Tensor:
    text = "Which is a species of fish? Tope or Rope. <|im_start|>assistant\nTope<|im_end|>"
    return torch.tensor([tokenizer(text)["input_ids"]])


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def load_gguf(folder):
    from transformers import AutoModelForCausalLM

    (path,) = folder.glob("*.gguf")
    return AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=path.name, dtype=torch.float32).eval()


def gguf_fields(folder) -> dict:
    import gguf

    (path,) = folder.glob("*.gguf")
    reader = gguf.GGUFReader(str(path))
    fields = {key: field.contents() for key, field in reader.fields.items()}
    fields["tensors"] = {tensor.name: tensor for tensor in reader.tensors}
    return fields


# ---------------------------------------------------------------- GGUF


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_gguf_f32_reloads_with_the_same_logits(chat_tokenizer, tie, tmp_path):
    model = build_tiny_llama(chat_tokenizer, tie=tie)
    source = save_model_folder(model, chat_tokenizer, tmp_path / "model")
    export(str(source), str(tmp_path / "out"), "gguf", "f32")

    fields = gguf_fields(tmp_path / "out")
    assert {key: fields[f"llama.{key}"] for key in (
        "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "rope.dimension_count", "vocab_size")} == {
        "block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 128,
        "attention.head_count": 4, "attention.head_count_kv": 2, "rope.dimension_count": 16, "vocab_size": 1002}
    assert fields["general.sampling.penalty_repeat"] == 1.0 and fields["general.sampling.temp"] == 0.0
    assert fields["llama.rope.freq_base"] == 10000.0
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert fields["general.architecture"] == "llama" and fields["general.license"] == "apache-2.0"
    # A tied head has no tensor of its own: both readers then use token_embd for the output.
    assert ("output.weight" in fields["tensors"]) is not tie
    assert fields["tensors"]["blk.0.attn_k.weight"].tensor_type.name == "F32"

    reloaded = load_gguf(tmp_path / "out")
    assert reloaded.config.tie_word_embeddings is tie
    ids = sample_ids(chat_tokenizer)
    assert (logits(reloaded, ids) - logits(model, ids)).abs().max().item() <= 1e-4  # measured: 0.0


def test_gguf_tokenizer_reads_back_to_the_same_ids(chat_tokenizer, tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    export(str(tiny_llama_dir), str(tmp_path / "out"), "gguf", "f32")
    (path,) = (tmp_path / "out").glob("*.gguf")
    reread = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    conversation = [{"role": "user", "content": "Name 3 fish."}, {"role": "assistant", "content": "Tope, cod, eel."}]
    chat_text = chat_tokenizer.apply_chat_template(conversation, tokenize=False)
    assert chat_text.startswith("<|im_start|>user\nName 3 fish.<|im_end|>")
    for text in [*dolly_texts(30), chat_text, "  spaces,\ttabs\nand ünïcödé 12345 <|endoftext|>"]:
        assert reread(text)["input_ids"] == chat_tokenizer(text)["input_ids"], text
    assert reread.chat_template == CHAT_TEMPLATE

    fields = gguf_fields(tmp_path / "out")
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert len(fields["tokenizer.ggml.tokens"]) == 1002
    special_ids = [chat_tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert special_ids == [0, 1000, 1001]
    types = fields["tokenizer.ggml.token_type"]
    assert [i for i, token_type in enumerate(types) if token_type == 3] == special_ids  # 3: control
    assert set(types) == {1, 3}
    merges = json.loads(chat_tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    assert fields["tokenizer.ggml.merges"] == [" ".join(pair) for pair in merges]
    # bos = pad, like GPT-J's tokenizer; EOS and EOT are the chat template's end-of-turn token, <|im_end|>.
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"],
            fields["tokenizer.ggml.eot_token_id"], fields["tokenizer.ggml.padding_token_id"]) == (0, 1001, 1001, 0)
    assert fields.get("tokenizer.ggml.add_bos_token", False) is False  # the converter writes it only when true


def test_gguf_q8_0_equals_gguf_own_quantiser(chat_tokenizer, tiny_llama_dir, tmp_path):
    """Q8_0 matrices are exactly gguf's dequantize(quantize(w)); vectors stay F32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from transformers import AutoModelForCausalLM

    export(str(tiny_llama_dir), str(tmp_path / "out"), "gguf", "q8_0")
    tensors = gguf_fields(tmp_path / "out")["tensors"]
    assert {t.tensor_type.name for name, t in tensors.items() if name.endswith("norm.weight")} == {"F32"}
    assert {t.tensor_type.name for name, t in tensors.items() if not name.endswith("norm.weight")} == {"Q8_0"}

    original = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    expected = copy.deepcopy(original)
    with torch.no_grad():
        for param in expected.parameters():
            if param.ndim == 2:  # Q8_0 blocks run along rows, so the q/k row permutation commutes with it
                q8 = dequantize(quantize(param.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
                param.copy_(torch.from_numpy(q8))
    reloaded = load_gguf(tmp_path / "out")
    for name, param in expected.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], param), name

    ids = sample_ids(chat_tokenizer)
    assert (logits(reloaded, ids) - logits(expected, ids)).abs().max().item() <= 1e-5
    # Measured 7.4e-3 against fp32 (logits here span about +-0.6): 8-bit weights with one scale per 32.
    assert (logits(reloaded, ids) - logits(original, ids)).abs().max().item() <= 2e-2


@pytest.mark.parametrize("dtype, torch_dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_gguf_half_precision_stores_rounded_weights(tiny_llama_dir, dtype, torch_dtype, tmp_path):
    from transformers import AutoModelForCausalLM

    export(str(tiny_llama_dir), str(tmp_path / "out"), "gguf", dtype)
    tensors = gguf_fields(tmp_path / "out")["tensors"]
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == dtype.upper()
    original = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    reloaded = load_gguf(tmp_path / "out")
    for name, param in original.state_dict().items():
        expected = param.to(torch_dtype).float() if param.ndim == 2 else param
        assert torch.equal(reloaded.state_dict()[name], expected), name


def test_cli_prints_each_file_with_its_size_in_a_readable_unit(tiny_llama_dir, tmp_path, capsys):
    from gpt4all_training.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--from", str(tiny_llama_dir), "--to", str(tmp_path / "tiny"), "--format", "gguf",
              "--dtype", "f16"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    sizes = {path.name: path.stat().st_size for path in (tmp_path / "tiny").iterdir()}
    assert sizes["Modelfile"] < 1000 and 1000 <= sizes["tiny-F16.gguf"] < 1e6  # so each line shows its unit
    assert lines[:3] == [f"{tmp_path / 'tiny' / 'Modelfile'}  {sizes['Modelfile']} B",
                         f"{tmp_path / 'tiny' / 'README.md'}  {sizes['README.md'] / 1e3:.1f} KB",
                         f"{tmp_path / 'tiny' / 'tiny-F16.gguf'}  {sizes['tiny-F16.gguf'] / 1e3:.1f} KB"]
    assert lines[-1].startswith(f"exported {tiny_llama_dir} as gguf in ")


def test_sizes_are_printed_in_the_largest_unit_that_keeps_them_at_least_one():
    from gpt4all_training.cli.export import readable_size

    assert [readable_size(size) for size in (0, 999, 1000, 1234, 999_949, 999_950, 105_500_000, 2.5e9, 3e15)] == [
        "0 B", "999 B", "1.0 KB", "1.2 KB", "999.9 KB", "1.0 MB", "105.5 MB", "2.5 GB", "3000.0 TB"]


@pytest.mark.slow
def test_a_gguf_export_states_its_agreement_with_the_merged_model(chat_tokenizer, tmp_path, capsys):
    """A tiny Qwen3 (width 256: whole k-quant blocks) exported as Q4_K_M: the model card and the export's last line
    give how often llama.cpp on the file picks the merged model's next token and the largest logit difference, on
    the fixed chat prompts and the merged model's greedy answers; recomputed here with transformers' own generate
    and llama.cpp's logits, they are the same numbers."""
    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM, Qwen3Config

    from gpt4all_training.cli.main import main
    from gpt4all_training.export.agreement import ANSWER_TOKENS, PROMPTS
    from gpt4all_training.export.llama_cpp import LlamaCppModel

    end_of_turn = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(vocab_size=len(chat_tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=chat_tokenizer.bos_token_id,
                         eos_token_id=chat_tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-trivial norms, as the trained models' are
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    source = save_model_folder(model, chat_tokenizer, tmp_path / "qwen3")
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--from", str(source), "--to", str(tmp_path / "out"), "--format", "gguf", "--dtype", "q4_k_m"])
    assert exit_info.value.code == 0
    last_line = capsys.readouterr().out.splitlines()[-1]
    path = tmp_path / "out" / "out-Q4_K_M.gguf"
    assert {tensor.tensor_type.name for tensor in gguf.GGUFReader(str(path)).tensors} == {"F32", "Q4_K", "Q6_K"}

    rows = []
    for prompt in PROMPTS:
        ids = chat_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        with torch.no_grad():
            answer = model.generate(torch.tensor([ids]), max_new_tokens=ANSWER_TOKENS, do_sample=False,
                                    eos_token_id=[chat_tokenizer.eos_token_id, end_of_turn])[0, len(ids):].tolist()
        rows.append(ids + (answer[:-1] if answer[-1] in (chat_tokenizer.eos_token_id, end_of_turn) else answer))
    with torch.no_grad():
        expected = [model(torch.tensor([row])).logits[0].numpy() for row in rows]
    with LlamaCppModel(path, context=max(len(row) for row in rows)) as file:
        actual = [file.logits(row) for row in rows]
    positions = sum(len(row) for row in rows)
    same = sum(int((a.argmax(-1) == e.argmax(-1)).sum()) for a, e in zip(actual, expected))
    difference = max(float(np.abs(a - e).max()) for a, e in zip(actual, expected))
    largest = max(float(np.abs(e).max()) for e in expected)
    assert 0 < same < positions and positions > len(PROMPTS) * ANSWER_TOKENS  # 4-bit weights change some argmaxes

    card = (tmp_path / "out" / "README.md").read_text()
    assert "\n## Agreement with the merged model\n" in card
    assert f"\n| {positions} | {same} ({same / positions:.1%}) | {difference:.3g} | {largest:.3g} |\n" in card
    assert last_line.startswith(f"exported {source} as gguf in ") and last_line.endswith(
        f" s; llama.cpp picks the merged model's next token at {same}/{positions} positions of 4 fixed chat prompts "
        f"and their greedy answers; largest logit difference {difference:.3g} (largest logit {largest:.3g})")


def test_gguf_name_keeps_mistral_out():
    """transformers would load a llama file named "mistral" as Mistral."""
    from gpt4all_training.export.gguf import gguf_name

    assert gguf_name("my-Mistral-7B-tune") == "my-7B-tune"
    assert gguf_name("mistral") == "model" and gguf_name("smollm2-dolly") == "smollm2-dolly"


@pytest.mark.integration
@pytest.mark.slow
def test_gptj_gguf_export_is_refused_with_one_line(tiny_model_dir, tmp_path):
    """No GGUF reader runs GPT-J: transformers has no GPT-J GGUF loader, llama.cpp no GPT-J graph."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    assert "gptj" not in GGUF_SUPPORTED_ARCHITECTURES and "llama" in GGUF_SUPPORTED_ARCHITECTURES
    result = subprocess.run([PYTHON, str(REPO / "export.py"), "--from", str(tiny_model_dir),
                             "--to", str(tmp_path / "out"), "--format", "gguf"],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --format gguf: GPT-J cannot be exported as GGUF")
    assert "use --format hf" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


# ---------------------------------------------------------------- HF export and LoRA merge


def test_gptj_exports_as_hf_in_bf16(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    export(str(tiny_model_dir), str(tmp_path / "out"), "hf")  # default dtype: bf16
    assert saved_dtypes(tmp_path / "out") == {torch.bfloat16}
    original = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    assert exported.config.model_type == "gptj"
    for name, param in original.state_dict().items():
        if param.is_floating_point():
            assert torch.equal(exported.state_dict()[name], param.to(torch.bfloat16).float()), name


def make_adapter(base_name: str, path, seed: int = 1):
    """A PEFT adapter on `base_name` with random non-zero B matrices (a fresh adapter is a no-op)."""
    from peft import LoraConfig, get_peft_model

    from gpt4all_training.model.loading import load_model

    model = get_peft_model(load_model(base_name, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    model.save_pretrained(path)
    return model.eval()


def saved_dtypes(folder) -> set[torch.dtype]:
    from safetensors import safe_open

    dtypes = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            dtypes |= {f.get_tensor(key).dtype for key in f.keys()}
    return dtypes


# Exported weights are exact (asserted below: merged in fp32, rounded once), so the logits may differ from the
# unmerged adapter model only by that one rounding: relative error u per weight, u = 2^-8 for bf16 and 2^-11 for
# f16 (round to nearest with 8 and 11 significant bits). Through the embedding, 7 matrices per layer and the head,
# the logit error stays a small multiple of u * max|logit|: measured 2.4 u (bf16: 6.1e-3) and 1.7 u (f16: 5.3e-4)
# with max|logit| 0.66; 8 u leaves room for other seeds. In f32 only the summation order differs (measured 3.3e-7).
UNIT_ROUNDOFF = {"f16": 2.0**-11, "bf16": 2.0**-8}


@pytest.mark.parametrize("dtype, torch_dtype", [("f32", torch.float32), ("f16", torch.float16),
                                                ("bf16", torch.bfloat16)])
def test_hf_export_of_adapter_matches_unmerged_adapter(chat_tokenizer, tiny_llama_dir, dtype, torch_dtype,
                                                       tmp_path):
    from transformers import AutoModelForCausalLM

    adapter = make_adapter(str(tiny_llama_dir), tmp_path / "adapter")
    merged_in_fp32 = copy.deepcopy(adapter).merge_and_unload().state_dict()
    files = export(str(tmp_path / "adapter"), str(tmp_path / "out"), "hf", dtype)

    assert {f.name for f in files} == {"README.md", "chat_template.jinja", "config.json", "generation_config.json",
                                       "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert saved_dtypes(tmp_path / "out") == {torch_dtype}
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    for name, param in exported.state_dict().items():  # merged in fp32, then cast once
        assert torch.equal(param, merged_in_fp32[name].to(torch_dtype).float()), name
    ids = sample_ids(chat_tokenizer)
    difference = (logits(exported, ids) - logits(adapter, ids)).abs().max().item()
    tolerance = 8 * UNIT_ROUNDOFF[dtype] * logits(adapter, ids).abs().max().item() if dtype != "f32" else 1e-5
    assert difference <= tolerance
    with adapter.disable_adapter():  # the adapter changes the model, so the comparison means something
        base_logits = logits(adapter, ids)
    assert (logits(adapter, ids) - base_logits).abs().max().item() > 0.05


def test_adapter_on_gguf_base_merges_into_dequantised_weights(chat_tokenizer, tiny_llama_dir, tmp_path):
    """The demo's case: the base is a quantised GGUF. The adapter is merged into its fp32 dequantised weights,
    and the base's license (read from the GGUF metadata) reaches the model card."""
    export(str(tiny_llama_dir), str(tmp_path / "base"), "gguf", "q8_0")
    (base_gguf,) = (tmp_path / "base").glob("*.gguf")
    adapter = make_adapter(str(base_gguf), tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == str(base_gguf)
    export(str(tmp_path / "adapter"), str(tmp_path / "out"), "hf", "f32")

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    ids = sample_ids(chat_tokenizer)
    assert (logits(exported, ids) - logits(adapter, ids)).abs().max().item() <= 1e-5
    card = (tmp_path / "out" / "README.md").read_text()
    assert "license: apache-2.0" in card and f"| Base model | {base_gguf} |" in card
    assert "| Base model, as its GGUF names it | " in card  # general.name, where the path may say little


def test_model_card_names_the_lora_rank_and_alpha():
    assert training_method({"lora": True, "lora_r": 16, "lora_alpha": 32}) == "LoRA (r=16, alpha=32), merged in fp32"
    assert training_method({"lora": False}) == "full fine-tuning" and training_method({}) == "unknown"


# ---------------------------------------------------------------- training outputs


def write_run(output_dir, step: int, config: dict):
    """A training output_dir as train.py leaves it: step_N/ with optimiser state, and metrics.jsonl."""
    step_dir = output_dir / f"step_{step}"
    (step_dir / "rng").mkdir(parents=True)
    torch.save({"state": {}, "param_groups": []}, step_dir / "optimizer.pt")
    torch.save({"last_epoch": step}, step_dir / "scheduler.pt")
    torch.save({"torch": torch.get_rng_state()}, step_dir / "rng" / "rank0.pt")
    (step_dir / "state.json").write_text(json.dumps({"step": step, "epoch": 0, "position": 24,
                                                     "trained_tokens": 5000}))
    (step_dir / "config.yaml").write_text(yaml.safe_dump(config))
    write_marker(step_dir)  # lists the files above; the model saved into step_dir/model later is not checked
    rows = [{"step": 1, "train_loss": 6.9, "lr": 1e-3}, {"step": 2, "train_loss": 6.5, "val_loss": 6.61},
            {"step": step, "train_loss": 6.25, "lr": 1e-3}]
    (output_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return step_dir


def test_step_checkpoint_exports_sharded_without_training_state(chat_tokenizer, tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    config = {"model_name": str(tiny_llama_dir), "dataset_path": "data/dolly_clean.jsonl", "lr": 0.001}
    step_dir = write_run(tmp_path / "run", 3, config)
    model = build_tiny_llama(chat_tokenizer, seed=3)  # "trained" weights differ from the base
    save_model_folder(model, chat_tokenizer, step_dir / "model", license_id=None)
    files = export(str(step_dir), str(tmp_path / "out"), "hf", "f32", max_shard_size="100KB")

    names = {f.name for f in files}
    shards = {name for name in names if name.endswith(".safetensors")}
    assert len(shards) > 1 and "model.safetensors.index.json" in names
    assert names - shards == {"README.md", "chat_template.jinja", "config.json", "generation_config.json",
                              "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"}
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    ids = sample_ids(chat_tokenizer)
    assert torch.equal(logits(exported, ids), logits(model, ids))

    card = (tmp_path / "out" / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["license"] == "apache-2.0"  # from the base model's card, named by the run's config
    for row in (f"| Base model | {tiny_llama_dir} |", "| Training data | data/dolly_clean.jsonl |",
                "| Training steps | 3 |", "| Final train_loss | 6.2500 |", "| Final val_loss | 6.6100 |",
                "| Method | full fine-tuning |", "| Export | hf f32 |"):
        assert row in card
    assert yaml.safe_load(card.split("```yaml")[1].split("```")[0]) == config


@pytest.mark.parametrize("bad, message", [
    ({"fmt": "hf", "dtype": "q8_0"}, "--dtype q8_0: --format hf takes one of f32, f16, bf16"),
    ({"to": "model.gguf"}, "give a folder; the .gguf file and README.md are written inside it"),
    ({"source": "no/such/folder"}, "--from no/such/folder: not found"),
])
def test_bad_arguments_are_user_errors(tiny_llama_dir, tmp_path, bad, message):
    arguments = {"source": str(tiny_llama_dir), "to": str(tmp_path / "out"), "fmt": "gguf", **bad}
    with pytest.raises(UserError, match=message.replace(".", r"\.")):
        export(**arguments)


def test_existing_output_is_not_overwritten(tiny_llama_dir, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists and is not empty"):
        export(str(tiny_llama_dir), str(tmp_path / "out"), "hf")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def folder_state(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_a_folder_named_like_the_partial_export_is_never_touched(tiny_llama_dir, tmp_path):
    """export deleted OUT.partial/ (the user's, or another export's in progress) before writing its own."""
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "notes.txt").write_text("the user's")
    export(str(tiny_llama_dir), str(tmp_path / "out"), "hf", "f32")
    assert (tmp_path / "out.partial" / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.partial"]
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_two_exports_to_one_target_leave_the_first_finished_whole(tiny_llama_dir, tmp_path, monkeypatch):
    """A second export that finishes while the first is writing: the first then stops with one line and removes
    only its own folder; the second's export stays whole."""
    import gpt4all_training.export.hf as hf

    out = tmp_path / "out"
    write_hf = hf.write_hf

    def another_export_finishes_first(source, folder, request):
        monkeypatch.setattr(hf, "write_hf", write_hf)
        export(str(tiny_llama_dir), str(out), "hf", "bf16")
        return write_hf(source, folder, request)

    monkeypatch.setattr(hf, "write_hf", another_export_finishes_first)
    with pytest.raises(UserError) as refused:
        export(str(tiny_llama_dir), str(out), "hf", "f32")
    assert str(refused.value) == (f"--to {out}: another export finished there while this one ran; its files are "
                                  f"kept. Choose a new folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_an_export_on_a_full_disk_is_one_line_and_leaves_nothing(tiny_llama_dir, tmp_path, capsys):
    import resource

    from hardening.entry_points import clean_failure

    (tmp_path / "kept.txt").write_text("the user's")
    before = folder_state(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))  # the weights are larger: their write fails
    try:
        line = clean_failure(capsys, ["export", "--from", str(tiny_llama_dir), "--to", str(tmp_path / "out"),
                                      "--format", "hf"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert line.startswith(f"error: --to {tmp_path / 'out'}: could not write the export (") and \
        line.endswith("); nothing was left behind. Free disk space, then run again")
    assert folder_state(tmp_path) == before


# ---------------------------------------------------------------- DeepSpeed ZeRO checkpoints

ZERO_SCRIPT = textwrap.dedent("""
    # One real DeepSpeed engine on CPU (1 process): one AdamW step, then save_checkpoint as ZeRO shards.
    import os, sys
    from pathlib import Path
    import torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoTokenizer
    base, out = Path(sys.argv[1]), Path(sys.argv[2])
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = torch.tensor([tokenizer("Which is a species of fish? Tope or Rope.")["input_ids"]])
    for stage, lora in ((2, False), (3, False), (2, True)):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        step_dir = out / f"zero{stage}{'-lora' if lora else ''}" / "step_1"
        (step_dir / "model").mkdir(parents=True)
        if lora:
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                     target_modules=["q_proj", "v_proj"]))
            model.peft_config["default"].save_pretrained(step_dir / "model")
        else:
            model.config.save_pretrained(step_dir / "model")
        tokenizer.save_pretrained(step_dir / "model")
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True})
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.save_checkpoint(str(step_dir), tag="pytorch_model")
        with torch.no_grad():
            torch.save({"ids": ids, "logits": engine(input_ids=ids).logits.float()}, step_dir.parent / "expected.pt")
""")


@pytest.fixture(scope="module")
def zero_runs(tiny_llama_dir, tmp_path_factory) -> Path:
    """ZeRO-2, ZeRO-3 and a ZeRO-2 LoRA run of one step each, with the logits each engine computed after it."""
    out = tmp_path_factory.mktemp("zero-runs")
    script = out / "zero.py"
    script.write_text(ZERO_SCRIPT)
    try:
        result = subprocess.run([PYTHON, str(script), str(tiny_llama_dir), str(out), str(free_port())],
                                capture_output=True, text=True, cwd=REPO, timeout=300)
    except subprocess.TimeoutExpired as exc:  # show where it stuck rather than only that it did
        output = b"".join(part if isinstance(part, bytes) else part.encode() for part in (exc.stdout, exc.stderr)
                          if part)
        pytest.fail(f"DeepSpeed run timed out; output tail:\n{output[-3000:].decode(errors='replace')}")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.integration
@pytest.mark.slow
def test_zero_checkpoints_consolidate_to_the_trained_model(zero_runs, tiny_llama_dir, tmp_path):
    """ZeRO-2, ZeRO-3 and a ZeRO-2 LoRA run: the export computes what the engine computed after its step."""
    from transformers import AutoModelForCausalLM

    for run in ("zero2", "zero3", "zero2-lora"):
        step_dir = zero_runs / run / "step_1"
        assert (step_dir / "pytorch_model").is_dir() and not (step_dir / "model" / "model.safetensors").exists()
        export(str(step_dir), str(tmp_path / f"{run}-out"), "hf", "f32")
        expected = torch.load(zero_runs / run / "expected.pt", weights_only=True)
        exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / f"{run}-out"), dtype=torch.float32).eval()
        base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
        assert (logits(exported, expected["ids"]) - expected["logits"]).abs().max().item() <= 1e-5, run
        assert (logits(base, expected["ids"]) - expected["logits"]).abs().max().item() > 1e-2, run  # it trained


class WritesMarker:
    """Unpickling this calls open(marker, "w"): any pickle global could as well be os.system."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.integration
@pytest.mark.slow
def test_a_zero_checkpoint_holding_code_is_refused_before_deepspeed_reads_it(zero_runs, tmp_path):
    """DeepSpeed's own reader unpickles with weights_only=False; the export checks every file first."""
    step_dir = shutil.copytree(zero_runs / "zero2" / "step_1", tmp_path / "step_1")
    [optim] = sorted(step_dir.rglob("*rank_0*optim_states.pt"))
    state = torch.load(optim, weights_only=False)
    state["payload"] = WritesMarker(tmp_path / "marker")
    torch.save(state, optim)
    with pytest.raises(UserError) as error:
        export(str(step_dir), str(tmp_path / "out"), "hf", "f32")
    assert str(error.value) == (f"checkpoint file {optim}: holds objects other than tensors, and loading them could "
                                f"run code; refused. Use only checkpoints this program wrote")
    assert not (tmp_path / "marker").exists() and not (tmp_path / "out").exists()

# ---------------------------------------------------------------- the table of formats (export/formats.py)

FORMAT_TABLE_HEADER = "| `--format` | what it writes | `--dtype` | default |"


def documented_formats(text: str) -> dict[str, tuple[str, tuple[str, ...], str]]:
    """{format: (what it writes, weight types, default)} as docs/export.md's table of formats lists them."""
    lines = text.splitlines()
    rows = itertools.takewhile(lambda line: line.startswith("|"), lines[lines.index(FORMAT_TABLE_HEADER) + 2:])
    documented = {}
    for row in rows:
        name, what, dtypes, default = (cell.strip() for cell in row.strip().strip("|").split("|"))
        documented[name.strip("`")] = (what, tuple(dtype.strip(" `") for dtype in dtypes.split(",")),
                                       default.strip("`"))
    return documented


def format_table_problems(text: str) -> list[str]:
    documented = documented_formats(text)
    table = {spec.name: (spec.help, spec.dtypes, spec.default_dtype) for spec in FORMATS.values()}
    return [f"--format {name}: docs/export.md lists {documented.get(name)}, export/formats.py has {table.get(name)}"
            for name in sorted(documented.keys() | table.keys()) if documented.get(name) != table.get(name)]


def test_the_docs_list_exactly_the_export_formats():
    assert format_table_problems((REPO / "docs" / "export.md").read_text(encoding="utf-8")) == []


def test_a_format_missing_from_the_docs_or_one_they_invent_or_change_is_named():
    text = (REPO / "docs" / "export.md").read_text(encoding="utf-8")
    gguf_row = next(line for line in text.splitlines() if line.startswith("| `gguf` |"))
    planted = text.replace(gguf_row, "| `onnx` | a graph | `f32` | `f32` |").replace(
        "| `f32`, `f16`, `bf16` | `bf16` |", "| `f32`, `bf16` | `bf16` |")
    assert format_table_problems(planted) == [
        "--format gguf: docs/export.md lists None, export/formats.py has ('one file for llama.cpp and GPT4All', "
        "('f32', 'f16', 'bf16', 'q8_0', 'q4_0', 'q4_k_m', 'q5_k_m', 'q6_k'), 'q8_0')",
        "--format hf: docs/export.md lists ('safetensors folder for transformers', ('f32', 'bf16'), 'bf16'), "
        "export/formats.py has ('safetensors folder for transformers', ('f32', 'f16', 'bf16'), 'bf16')",
        "--format onnx: docs/export.md lists ('a graph', ('f32',), 'f32'), export/formats.py has None",
    ]


def test_each_format_names_a_writer_and_weight_types_its_module_knows():
    from gpt4all_training.export import gguf, hf

    assert set(FORMATS["hf"].dtypes) == set(hf.DTYPES)
    assert set(FORMATS["gguf"].dtypes) == set(gguf.TYPES)
    assert [spec.write() for spec in FORMATS.values()] == [hf.write_hf, gguf.write_export]
    assert all(spec.default_dtype in spec.dtypes for spec in FORMATS.values())
    assert [entry["name"] for entry in described()] == ["hf", "gguf"]


def write_text_export(source, folder: Path, request: ExportRequest) -> Written:
    """A format planted by the test below: the tokenizer's vocabulary size, as text."""
    (folder / f"{request.name}.txt").write_text(f"{len(source.tokenizer)} {request.dtype}\n", encoding="utf-8")
    return Written(["Planted by the test."])


def test_a_new_format_is_one_table_entry_and_its_writer(chat_tokenizer, tiny_llama_dir, tmp_path, monkeypatch,
                                                        capsys):
    from gpt4all_training.cli.main import main

    monkeypatch.setitem(FORMATS, "text", ExportFormat("text", "the vocabulary size", ("f32",), "f32",
                                                      f"{__name__}:write_text_export", None, "text"))
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--from", str(tiny_llama_dir), "--to", str(tmp_path / "vocab"), "--format", "text"])
    assert exit_info.value.code == 0
    assert sorted(path.name for path in (tmp_path / "vocab").iterdir()) == ["README.md", "vocab.txt"]
    assert (tmp_path / "vocab" / "vocab.txt").read_text() == f"{len(chat_tokenizer)} f32\n"
    card = (tmp_path / "vocab" / "README.md").read_text()
    assert card.endswith("Planted by the test.\n") and "| Export | text f32 |" in card and "- text\n" in card
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"exported {tiny_llama_dir} as text in ")
    with pytest.raises(UserError, match=r"^--dtype bf16: --format text takes one of f32$"):
        export(str(tiny_llama_dir), str(tmp_path / "other"), "text", "bf16")
