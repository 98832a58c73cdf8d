"""QLoRA on the CPU with the real bitsandbytes: a tiny Llama's base quantized as it loads (model/build.py,
model/quantization.py), its logits against the fp32 model's, LoRA training over it, exact resume, the merge into the
dequantized base, and the refusals of what cannot work."""

from __future__ import annotations

import contextlib
import io
import json
import re
import signal
from pathlib import Path

import pytest
import torch
from support.files import write_jsonl
from support.models import build_tiny_llama, weights
from support.outputs import assert_bitwise_equal_weights, exact_rows

from gpt4all_training.backends.accelerate import backend_for
from gpt4all_training.batch import IGNORE
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.batching import collate
from gpt4all_training.errors import UserError
from gpt4all_training.model.build import build_training_model, recorded_base_fingerprint
from gpt4all_training.model.quantization import base_fingerprint, quantized_linears
from gpt4all_training.training.loss import token_loss_sum

TARGETS = ["q_proj", "v_proj", "gate_proj"]
PAIRS = [("What is the capital of France?", "Paris."), ("Name a primary colour.", "Red."),
         ("What is two plus two?", "Four."), ("Say hello.", "Hello!"), ("Which animal barks?", "A dog."),
         ("What do bees make?", "Honey."), ("Opposite of hot?", "Cold."), ("Largest planet?", "Jupiter.")]


@pytest.fixture(scope="module")
def llama_dir(tiny_llama_dir) -> Path:
    """The session's tiny Llama (2 layers, width 64): 7 linear layers per block to quantize."""
    return tiny_llama_dir


@pytest.fixture(scope="module")
def backend():
    from accelerate import Accelerator

    return backend_for(Accelerator())


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pairs")
    write_jsonl(folder / "pairs_clean.jsonl", [{"prompt": p, "response": r, "source": "t"} for p, r in PAIRS])
    return folder


def qlora_config(model_dir, **overrides) -> TrainConfig:
    values = dict(model_name=str(model_dir), dataset_path="unread", lora=True, lora_r=8, lora_alpha=16,
                  lora_dropout=0.0, lora_target_modules=TARGETS, load_in_4bit=True, dtype="float32")
    values.update(overrides)
    return validate(TrainConfig(**values))


def fixed_batch(tokenizer, rows: int = 4, length: int = 24) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, len(tokenizer), (rows, length), generator=generator)
    return collate([{"input_ids": row.tolist(), "labels": [IGNORE] * 4 + row[4:].tolist()} for row in ids], pad_id=0)


def frozen_state(model) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict that training must not change (packed weights, quantization constants, fp32
    embeddings, norms and head), as raw bytes."""
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    return {name: tensor.detach().clone().reshape(-1).view(torch.uint8)
            for name, tensor in model.state_dict().items() if name not in trainable}


# ---------------------------------------------------------------- the config

@pytest.mark.parametrize("overrides, message", [
    ({"lora": False}, "load_in_4bit: a quantized base stays frozen and only a LoRA adapter trains over it (QLoRA): "
                      "set lora: true, or drop it to fine-tune every weight"),
    ({"load_in_4bit": False, "load_in_8bit": True, "lora": False},
     "load_in_8bit: a quantized base stays frozen and only a LoRA adapter trains over it (QLoRA): set lora: true, "
     "or drop it to fine-tune every weight"),
    ({"load_in_8bit": True}, "load_in_8bit: load_in_4bit and load_in_8bit exclude each other; set one"),
    ({"load_in_4bit": False, "bnb_4bit_quant_type": "fp4"},
     "bnb_4bit_quant_type: only load_in_4bit reads it; remove it or set load_in_4bit: true, got 'fp4'"),
    ({"bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type: must be one of nf4, fp4, got 'int4'"),
    ({"merge_dtype": "bfloat16"}, "merge_dtype: only merge_lora reads it; remove it or set merge_lora: true, got "
                                  "'bfloat16'"),
])
def test_a_quantized_base_trains_only_under_lora_and_each_setting_is_read(overrides, message):
    with pytest.raises(UserError) as error:
        qlora_config("model", **overrides)
    assert str(error.value) == message


class PartitioningBackend:
    """What FSDP2 and ZeRO-3 tell model/build.py: their parameters are partitioned across the processes."""
    chunks_output_head = True
    fuses_lora = False
    attends_per_example = True
    partitions_parameters = True
    quantized_storage = torch.float32
    device = torch.device("cpu")

    def __init__(self, engine_name: str, shards_quantized_base: bool) -> None:
        self.engine_name, self.shards_quantized_base = engine_name, shards_quantized_base


def test_a_combination_that_cannot_shard_is_refused_naming_one_that_works(llama_dir, tokenizer):
    """8-bit under FSDP2 or ZeRO-3 (int8 weights are not sharded); 4-bit under a partitioning backend that does not
    say it shards a quantized base (none of ours now: FSDP2 and ZeRO-3 both do)."""
    for engine in ("FSDP2", "DeepSpeed"):
        with pytest.raises(UserError) as error:
            build_training_model(qlora_config(llama_dir, load_in_4bit=False, load_in_8bit=True), tokenizer,
                                 PartitioningBackend(engine, True))
        assert str(error.value) == (
            f"load_in_8bit: {engine} partitions every parameter across the processes, and int8 weights cannot be "
            f"sharded; use load_in_4bit (its storage is sharded), or a launch that keeps a whole base per process "
            f"(one process, DDP, DeepSpeed ZeRO-1/2)")
    with pytest.raises(UserError) as error:
        build_training_model(qlora_config(llama_dir), tokenizer, PartitioningBackend("a new engine", False))
    assert str(error.value) == (
        "load_in_4bit: a new engine cannot partition a quantized base across the processes; use FSDP2 or DeepSpeed "
        "ZeRO-3 to shard it, or a launch that keeps a whole base per process (one process, DDP, DeepSpeed ZeRO-1/2)")


# ---------------------------------------------------------------- the quantized base

def test_the_quantized_base_computes_its_dequantized_weights_and_differs_by_their_nf4_error(llama_dir, tokenizer,
                                                                                             backend, capsys):
    """Exactly: the 4-bit base's logits are those of the fp32 model with every quantized weight replaced by
    bitsandbytes' own quantize/dequantize of it (fp32 rounding apart). And against the fp32 model they move by the
    first-order effect of that nf4 error, J.dW (forward-mode AD through the fp32 model), up to a second-order rest
    bounded by 2 eps max|J.dW|, eps being the relative nf4 error of the weights (measured 0.092 and 0.12x)."""
    import bitsandbytes.functional as bnb_functional
    from torch.func import functional_call, jvp
    from transformers import LlamaForCausalLM

    model = build_training_model(qlora_config(llama_dir, lora_target_modules=["q_proj"]), tokenizer, backend).eval()
    reference = LlamaForCausalLM.from_pretrained(llama_dir, attn_implementation="eager").eval()
    params = {name: param.detach() for name, param in reference.named_parameters()}
    quantized = [name.replace("base_model.model.", "").replace(".base_layer", "") + ".weight"
                 for name, _ in quantized_linears(model)]
    assert len(quantized) == 2 * 7  # q k v o gate up down, per layer; embeddings and head stay fp32
    error = {}
    for name in quantized:
        packed, state = bnb_functional.quantize_4bit(params[name], quant_type="nf4", compress_statistics=True)
        error[name] = bnb_functional.dequantize_4bit(packed, state) - params[name]
    ids = fixed_batch(tokenizer)["input_ids"]

    def logits(weights):
        return functional_call(reference, {**params, **weights}, (ids,)).logits

    with torch.no_grad():
        got, fp32 = model(input_ids=ids).logits, reference(ids).logits
        dequantized = logits({name: params[name] + error[name] for name in quantized})
    torch.testing.assert_close(got, dequantized, rtol=0, atol=1e-5)

    _, first_order = jvp(logits, ({name: params[name] for name in quantized},), (error,))
    eps = (sum(e.square().sum() for e in error.values()) / sum(params[n].square().sum() for n in quantized)).sqrt()
    assert 0.05 < eps < 0.15  # nf4's relative error on normal weights
    rest = (got - fp32 - first_order).abs().max()
    assert rest <= 2 * eps * first_order.abs().max()
    assert (got - fp32).abs().max() > 0.5 * first_order.abs().max() > 0  # the base really is quantized


def test_the_build_does_what_kbit_preparation_does_and_logs_the_storage(llama_dir, tokenizer, backend, capsys):
    """PEFT's prepare_model_for_kbit_training then get_peft_model give the same trainable set and dtypes (the
    unquantized base in fp32, the adapter in fp32), and the same input-gradient hook under checkpointing; the counts
    are of weights, not of packed bytes."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from gpt4all_training.model.loading import load_model
    from gpt4all_training.model.quantization import bnb_config, quantization_settings

    capsys.readouterr()
    config = qlora_config(llama_dir, gradient_checkpointing=True)
    model = build_training_model(config, tokenizer, backend)
    lines = capsys.readouterr().out.strip().splitlines()
    peft = get_peft_model(prepare_model_for_kbit_training(load_model(
        str(llama_dir), quantization=bnb_config(quantization_settings(config), torch.float32))),
        LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS))
    ours = {name: (param.dtype, param.requires_grad) for name, param in model.named_parameters()}
    assert ours == {name: (param.dtype, param.requires_grad) for name, param in peft.named_parameters()}
    assert {dtype for dtype, trainable in ours.values() if trainable} == {torch.float32}
    ids = fixed_batch(tokenizer)["input_ids"]
    assert model.get_input_embeddings()(ids).requires_grad and peft.get_input_embeddings()(ids).requires_grad

    total = sum(p.numel() for p in LlamaForCausalLMOf(llama_dir).parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lines[0] == f"parameters: {trainable:,} trainable of {total + trainable:,} " \
                       f"({100 * trainable / (total + trainable):.2f}%)"
    assert lines[1].startswith("base: 4-bit nf4, double quantization, computing in float32: 73,728 weights in ")
    assert recorded_base_fingerprint(model) == base_fingerprint(model)


def LlamaForCausalLMOf(path):  # noqa: N802 - reads as the class it loads
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path)


def test_lora_trains_over_the_base_and_only_the_adapter_changes(llama_dir, tokenizer, backend):
    """20 AdamW steps on one fixed batch, a validation pass (eval mode, no gradients) after every fifth: the loss
    falls, the gradients of every adapter stay alive after the validation passes, and every frozen tensor, the packed
    4-bit weights and their constants included, ends bitwise as it was built."""
    torch.manual_seed(0)
    model = build_training_model(qlora_config(llama_dir), tokenizer, backend)
    before = frozen_state(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-2)
    batch = fixed_batch(tokenizer)
    losses = []
    for step in range(20):
        model.train()
        loss = token_loss_sum(model, batch) / (batch["labels"][:, 1:] != IGNORE).sum()
        optimizer.zero_grad()
        loss.backward()
        dead = [name for name, p in model.named_parameters() if p.requires_grad and step and
                (p.grad is None or not p.grad.abs().max() > 0)]
        assert not dead, f"step {step + 1}: no gradient reaches {dead[0]}"
        optimizer.step()
        losses.append(loss.item())
        if step % 5 == 4:
            model.eval()
            with torch.no_grad():
                model(input_ids=batch["input_ids"])
    assert losses[-1] < losses[0] - 0.5, losses  # measured 6.90 to 6.03 (a random base: its head is weak)
    assert all(b < a for a, b in zip(losses[::5], losses[5::5])), losses
    after = frozen_state(model)
    assert after.keys() == before.keys() and any(".absmax" in name for name in after)
    assert [name for name in before if not torch.equal(before[name], after[name])] == []


def test_8bit_base_trains_an_adapter_too(llama_dir, tokenizer, backend):
    torch.manual_seed(0)
    model = build_training_model(qlora_config(llama_dir, load_in_4bit=False, load_in_8bit=True), tokenizer, backend)
    assert {type(module).__name__ for _, module in quantized_linears(model)} == {"Linear8bitLt"}
    before = frozen_state(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    batch = fixed_batch(tokenizer)
    losses = []
    model.train()
    for _ in range(8):
        loss = token_loss_sum(model, batch) / (batch["labels"][:, 1:] != IGNORE).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.2, losses
    after = frozen_state(model)
    assert [name for name in before if not torch.equal(before[name], after[name])] == []


# ---------------------------------------------------------------- a run: resume, merge, loading the adapter

def run_values(model_dir, data_dir, output_dir, **overrides) -> dict:
    values = dict(model_name=str(model_dir), dataset_path=str(data_dir), output_dir=str(output_dir), max_length=64,
                  batch_size=4, lr=1e-2, min_lr=1e-3, warmup_steps=1, val_fraction=0.25, num_epochs=100, max_steps=6,
                  eval_every=3, save_every=3, num_proc=1, seed=0, lora=True, lora_r=8, lora_alpha=16,
                  lora_dropout=0.1, lora_target_modules=TARGETS, load_in_4bit=True, merge_lora=True, dtype="float32")
    return {**values, **overrides}


def run_config(model_dir, data_dir, output_dir, **overrides) -> TrainConfig:
    return validate(TrainConfig(**run_values(model_dir, data_dir, output_dir, **overrides)))


@pytest.fixture(scope="module")
def whole_run(llama_dir, pairs_dir, tmp_path_factory):
    from gpt4all_training.training.loop import train

    output = tmp_path_factory.mktemp("qlora-run") / "whole"
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        train(run_config(llama_dir, pairs_dir, output))
    (output / "train.log").write_text(log.getvalue())
    return output


@pytest.mark.slow
def test_a_run_killed_then_resumed_is_bitwise_the_run_that_never_stopped(whole_run, llama_dir, pairs_dir, tmp_path):
    """SIGKILL after step 5 (step_3/ is the last checkpoint: adapter, AdamW state, RNG for the LoRA dropout), then a
    rerun into the same output_dir: the base rebuilt from model_name and checked by its fingerprint, the run repeats
    the losses, validation and adapter bit for bit."""
    from resume.harness import run_train as run_killable
    from support.files import write_config
    from support.launch import explain

    from gpt4all_training.training.loop import train

    state = json.loads((whole_run / "step_3" / "state.json").read_text())
    assert len(state["base_fingerprint"]) == 64
    out = tmp_path / "run"
    killed = run_killable(write_config(tmp_path, run_values(llama_dir, pairs_dir, out)), out, crash="after_step:5")
    assert killed.returncode == -signal.SIGKILL, explain(killed)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        train(run_config(llama_dir, pairs_dir, out))
    assert f"resumed from {out / 'step_3'} at step 3" in log.getvalue()
    assert exact_rows(out) == exact_rows(whole_run)
    assert any("val_loss" in row for row in exact_rows(out) if row["step"] > 3)
    assert_bitwise_equal_weights(out / "final", whole_run / "final")


@pytest.mark.slow
def test_a_resume_over_another_base_is_refused(whole_run, pairs_dir, tokenizer, tmp_path):
    """A base that moved may be resumed over (resume_allow_changes: [model_name]), but not one whose weights are
    others: the config allows it, the fingerprint does not."""
    from gpt4all_training.training.loop import train

    other = tmp_path / "tiny-llama"
    build_tiny_llama(tokenizer, seed=1).save_pretrained(other)
    tokenizer.save_pretrained(other)
    state = json.loads((whole_run / "step_3" / "state.json").read_text())
    with pytest.raises(UserError) as error:
        train(run_config(other, pairs_dir, tmp_path / "run", checkpoint=str(whole_run / "step_3"),
                         resume_allow_changes=["model_name"]))
    assert str(error.value).startswith(f"checkpoint {whole_run / 'step_3'}: its adapter was trained over a quantized "
                                       f"base with fingerprint {state['base_fingerprint'][:12]}, and the base built "
                                       f"now has ")


def test_the_merged_model_is_the_dequantized_base_plus_the_adapter(whole_run, llama_dir, tokenizer):
    """final/merged: every adapted weight is bitsandbytes' dequantization of the base's plus the adapter's delta
    (B A x alpha/r), every other quantized one its dequantization, the rest the base's own; nothing is quantized
    again."""
    import bitsandbytes.functional as bnb_functional

    merged, base, adapter = weights(whole_run / "final" / "merged"), weights(llama_dir), \
        weights(whole_run / "final")
    config = json.loads((whole_run / "final" / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    assert merged.keys() == base.keys()
    for name, tensor in base.items():
        if tensor.dim() == 2 and ".layers." in name:
            packed, state = bnb_functional.quantize_4bit(tensor, quant_type="nf4", compress_statistics=True)
            expected = bnb_functional.dequantize_4bit(packed, state)
            prefix = "base_model.model." + name.removesuffix(".weight")
            if f"{prefix}.lora_A.weight" in adapter:
                expected = expected + scale * adapter[f"{prefix}.lora_B.weight"] @ adapter[f"{prefix}.lora_A.weight"]
            torch.testing.assert_close(merged[name], expected, rtol=0, atol=1e-6, msg=name)
        else:
            assert torch.equal(merged[name], tensor), name


def test_the_adapter_loads_over_the_same_4bit_base_and_the_merge_gap_is_small(whole_run, tokenizer):
    """eval, serve and inference open final/ (an adapter) over its base quantized as the run's config.yaml says;
    the merged model's logits are within the bound of the gap training logged."""
    from transformers import AutoModelForCausalLM

    from gpt4all_training.model.quantization import keep_weight_layout
    from gpt4all_training.model.trained import describe, open_model

    model, _ = open_model(str(whole_run / "final"), torch.float32, torch.device("cpu"))
    assert {type(m).__name__ for _, m in quantized_linears(model)} == {"Linear4bit"}
    assert describe(str(whole_run / "final"))["weights"]["adapter_of"]["quantization"] == \
        "4-bit nf4, double quantization"  # what eval's results.json records of the model it scored
    step = describe(str(whole_run / "step_3"))["weights"]
    assert step["path"].endswith("step_3/model") and step["adapter_of"]["quantization"].startswith("4-bit nf4")
    keep_weight_layout(model)  # bitsandbytes' bf16 CPU kernel otherwise: compare in fp32
    merged = AutoModelForCausalLM.from_pretrained(whole_run / "final" / "merged").eval()
    ids = fixed_batch(tokenizer)["input_ids"]
    with torch.no_grad():
        gap = (model(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item()
    assert gap < 1e-4  # the same function, merged in fp32: rounding only


def test_export_merges_into_the_dequantized_base_says_so_and_its_gguf_reads_back(whole_run, tokenizer, tmp_path):
    """export --from final/ (the adapter) merges it into its base dequantized, as training's final/merged: the same
    weights; the card and training's log give the gap measured on the fixed prompts, within rounding; the GGUF
    reads back in llama.cpp as any export does (test_gguf.py's bound for F16)."""
    from test_gguf import UNIT_ROUNDOFF, hf_logits
    from transformers import AutoModelForCausalLM

    from gpt4all_training.export import llama_cpp
    from gpt4all_training.export.hf import export

    files = export(str(whole_run / "final"), str(tmp_path / "gguf"), "gguf", "f16")
    card = (tmp_path / "gguf" / "README.md").read_text()
    assert "| Method | QLoRA (r=8, alpha=16) over a 4-bit nf4, double quantization base, merged in fp32 into the " \
           "dequantized base |" in card
    written = re.search(r"The merged model is the 4-bit nf4, double quantization base dequantized, plus the LoRA "
                        r"adapter, merged in fp32 and stored in float32; against the quantized base with its adapter, "
                        r"its logits on 4 fixed prompts differ by at most (\S+) \(mean", card)
    logged = re.search(r"final/merged: the merged model is .* differ by at most (\S+) \(mean",
                       (whole_run / "train.log").read_text())
    assert written and logged and float(written.group(1)) < 1e-4 and float(logged.group(1)) < 1e-4
    export(str(whole_run / "final" / "merged"), str(tmp_path / "hf"), "hf", "f32")  # measured against final/
    assert re.search(r"The merged model is the 4-bit nf4, .* differ by at most \S+ \(mean",
                     (tmp_path / "hf" / "README.md").read_text())

    merged = AutoModelForCausalLM.from_pretrained(whole_run / "final" / "merged").eval()
    ids = tokenizer("The capital of France is Paris. Name a primary colour.")["input_ids"]
    expected = hf_logits(merged, ids)
    with llama_cpp.LlamaCppModel(next(f for f in files if f.suffix == ".gguf")) as model:
        assert model.tokenize(tokenizer.decode(ids), add_special=False) == ids
        assert abs(model.logits(ids) - expected).max() < 8 * UNIT_ROUNDOFF["f16"] * abs(expected).max()


# ---------------------------------------------------------------- plan

LLAMA3 = {"8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
          "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=128256)}


def test_plan_counts_the_base_as_bitsandbytes_stores_it(llama_dir, tokenizer, backend):
    """plan's storage of the tiny Llama's 4-bit layers is the built model's, less the code maps it leaves out (a
    16- and a 256-value table per layer) and the rounding up of the second level's last block."""
    from gpt4all_training.model.quantization import quantized_bytes, state_tensors
    from gpt4all_training.preflight.plan import model_shape

    config = qlora_config(llama_dir)
    shape = model_shape(config)
    model = build_training_model(config, tokenizer, backend)
    weights_held, stored = quantized_bytes(model)
    layers = quantized_linears(model)
    codes = sum(t.numel() * t.element_size() for _, m in layers for t in state_tensors(m.weight.quant_state)
                if t.numel() in (16, 256) and t.dtype == torch.float32)
    assert shape.quantized == weights_held == 73_728
    assert 0 <= stored - codes - shape.quantized_bytes <= 8 * len(layers)


def test_plan_says_which_llama3_shaped_qlora_runs_fit_which_gpus(tmp_path, pairs_dir, llama_dir):
    """Llama-3-8B at 2048 tokens per micro-batch with checkpointing fits a 24 GiB GPU in one process (its fp32 LoRA
    does not); 70B needs 4 such GPUs under FSDP2 (2 are too few, and DDP or ZeRO-2 keep a whole base per GPU), or
    one 80 GiB GPU."""
    from transformers import LlamaConfig

    from gpt4all_training.preflight.plan import make_plan, memory_per_gpu, model_shape

    for name, dims in LLAMA3.items():
        LlamaConfig(**dims).save_pretrained(tmp_path / name)
    values = dict(dataset_path=str(pairs_dir), tokenizer_name=str(llama_dir), output_dir=str(tmp_path / "out"),
                  lora=True, lora_r=16, lora_alpha=32, dtype="bfloat16", max_length=2048, batch_size=1,
                  gradient_checkpointing=True, num_proc=1)
    plan = make_plan(validate(TrainConfig(model_name=str(tmp_path / "8b"), load_in_4bit=True, **values)),
                     gpu_memory_gib=24).describe()
    assert "base: 6,979,321,856 weights in 4-bit nf4, double quantization (3.35 GiB), the rest in fp32" in plan
    assert re.search(r"QLoRA, 1 process or DDP +9\.4\d GiB = .*; fits in 24\.00 GiB", plan), plan
    lora = make_plan(validate(TrainConfig(model_name=str(tmp_path / "8b"), **values)), gpu_memory_gib=24)
    assert lora.memory["LoRA"].total > 24 * 2**30

    shape = model_shape(validate(TrainConfig(model_name=str(tmp_path / "70b"), load_in_4bit=True, **values)))
    gib = {gpus: {name: memory.total / 2**30 for name, memory in memory_per_gpu(shape, 1, 2048, "bfloat16", gpus,
                                                                                True).items()}
           for gpus in (1, 2, 4)}
    assert 24 < gib[1]["QLoRA, 1 process or DDP"] < 80 and gib[4]["QLoRA, ZeRO-2"] > 24
    assert gib[4]["QLoRA, ZeRO-3"] == gib[4]["QLoRA, FSDP2"]
    assert gib[2]["QLoRA, FSDP2"] > 24 > gib[4]["QLoRA, FSDP2"]
