"""model/build.py assembles the model a run trains: the same weights, trainable set and counts as loading the base
in fp32 and wrapping it with PEFT by hand; checkpointing that leaves the gradients as they are; dropout off on
request; the loss told by the backend whether it may chunk the head; and a frozen base stored in bf16 under a LoRA
adapter that PEFT keeps in fp32 (the seam a compute-dtype base plugs into)."""

from __future__ import annotations

import copy

import pytest
import torch
from support.models import weights

from gpt4all_training.backends.accelerate import backend_for
from gpt4all_training.batch import IGNORE
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.batching import collate
from gpt4all_training.model.build import build_training_model
from gpt4all_training.model.loading import load_model
from gpt4all_training.model.lora import apply_lora
from gpt4all_training.training.loss import output_head, token_loss_sum

TARGETS = ["q_proj", "v_proj"]
WIDTH, LAYERS, RANK = 64, 2, 4  # the tiny GPT-J's, and the adapter's rank here


@pytest.fixture(scope="module")
def backend():
    from accelerate import Accelerator

    return backend_for(Accelerator())


def train_config(model_dir, **overrides) -> TrainConfig:
    values = dict(model_name=model_dir and str(model_dir), dataset_path="unread", lora_r=RANK, lora_alpha=8,
                  lora_dropout=0.0, lora_target_modules=TARGETS, dtype="float32")
    values.update(overrides)
    return validate(TrainConfig(**values))


def built(config, tokenizer, backend, capsys, **options):
    """(model, the parameter line it logged), built from torch seed 0."""
    capsys.readouterr()
    torch.manual_seed(0)
    model = build_training_model(config, tokenizer, backend, **options)
    return model, capsys.readouterr().out.strip()


def states(model) -> dict[str, tuple[torch.Tensor, bool]]:
    return {name: (param.detach(), param.requires_grad) for name, param in model.named_parameters()}


def assert_same_model(model, reference) -> None:
    got, expected = states(model), states(reference)
    assert got.keys() == expected.keys()
    for name, (tensor, trainable) in expected.items():
        assert got[name][1] == trainable, name
        assert got[name][0].dtype == tensor.dtype and torch.equal(got[name][0], tensor), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_full_fine_tune_trains_the_saved_weights_in_fp32_whatever_the_compute_dtype(tiny_model_dir, tokenizer,
                                                                                     backend, capsys, dtype):
    model, line = built(train_config(tiny_model_dir, dtype=dtype), tokenizer, backend, capsys)
    saved = weights(tiny_model_dir)
    total = sum(tensor.numel() for tensor in saved.values())
    assert line == f"parameters: {total:,} trainable of {total:,} (100.00%)"
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32 and param.requires_grad, name
        assert torch.equal(param.detach(), saved[name]), name


def test_lora_is_the_base_wrapped_by_peft_with_the_adapter_alone_trainable(tiny_model_dir, tokenizer, backend,
                                                                           capsys):
    model, line = built(train_config(tiny_model_dir, lora=True), tokenizer, backend, capsys)
    torch.manual_seed(0)
    by_hand = apply_lora(load_model(str(tiny_model_dir)), RANK, 8, 0.0, TARGETS, False)
    assert_same_model(model, by_hand)
    trainable = LAYERS * len(TARGETS) * RANK * (WIDTH + WIDTH)  # A: r x in, B: out x r, per adapted projection
    total = sum(tensor.numel() for tensor in weights(tiny_model_dir).values()) + trainable
    assert line == f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)"
    assert {name for name, param in model.named_parameters() if param.requires_grad} == {
        f"base_model.model.transformer.h.{layer}.attn.{target}.lora_{part}.default.weight"
        for layer in range(LAYERS) for target in TARGETS for part in "AB"}


def adapter_gradients(model, batch) -> dict[str, torch.Tensor]:
    model.train()
    token_loss_sum(model, batch).backward()
    return {name: param.grad for name, param in model.named_parameters() if param.requires_grad}


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointing_recomputes_and_leaves_the_gradients_as_they_were(tiny_model_dir, tokenizer, backend, capsys,
                                                                        lora):
    """The checkpointed blocks recompute their activations in the backward; the gradients are the plain model's,
    the adapter's too (under frozen embeddings)."""
    plain, _ = built(train_config(tiny_model_dir, lora=lora), tokenizer, backend, capsys)
    checkpointed, _ = built(train_config(tiny_model_dir, lora=lora, gradient_checkpointing=True), tokenizer, backend,
                            capsys)
    assert checkpointed.is_activation_checkpointing and not plain.is_activation_checkpointing
    assert checkpointed.config.use_cache is False
    ids = torch.arange(5, 37)[None] % len(tokenizer)
    batch = collate([{"input_ids": ids[0].tolist(), "labels": [IGNORE] * 8 + ids[0, 8:].tolist()}], pad_id=0)
    if lora:  # B starts at zero, which leaves A without gradient; move it so both matrices get one
        for model in (plain, checkpointed):
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.fill_(0.01)
    expected, got = adapter_gradients(plain, batch), adapter_gradients(checkpointed, batch)
    assert got.keys() == expected.keys() and expected
    for name, gradient in expected.items():
        assert got[name] is not None and gradient.abs().max() > 0, name
        torch.testing.assert_close(got[name], gradient, rtol=1e-5, atol=1e-7, msg=name)


def test_init_from_config_builds_seeded_random_weights_checkpointed(tokenizer, backend, capsys):
    config = train_config(None, objective="causal_lm", init="from_config", model_config="gptj", lora=False,
                          model_config_overrides={"n_layer": 2, "n_embd": 32, "n_head": 4, "rotary_dim": 8},
                          tokenizer_name="unused", gradient_checkpointing=True, packing=False)
    first, line = built(config, tokenizer, backend, capsys)
    second, _ = built(config, tokenizer, backend, capsys)
    assert_same_model(first, second)
    assert first.get_input_embeddings().num_embeddings == len(tokenizer)
    assert first.is_activation_checkpointing
    total = sum(param.numel() for param in first.parameters())
    assert line == f"parameters: {total:,} trainable of {total:,} (100.00%)"


def test_dropout_off_zeroes_the_base_dropout_and_leaves_the_adapter_dropout(tokenizer, backend, capsys, tmp_path):
    """dpo's base, as the preference loss wants it; the adapter's own dropout is lora_dropout's, as before."""
    from transformers import GPTJConfig, GPTJForCausalLM

    GPTJForCausalLM(GPTJConfig(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1, n_head=4,
                               rotary_dim=8, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)).save_pretrained(tmp_path)
    config = train_config(tmp_path, lora=True, lora_dropout=0.2)
    dropouts = {name: module.p for name, module in built(config, tokenizer, backend, capsys)[0].named_modules()
                if isinstance(module, torch.nn.Dropout)}
    off = {name: module.p for name, module in built(config, tokenizer, backend, capsys, dropout_off=True)[0]
           .named_modules() if isinstance(module, torch.nn.Dropout)}
    assert off.keys() == dropouts.keys() and any(p == 0.1 for p in dropouts.values())
    for name, p in off.items():
        assert p == (0.2 if ".lora_dropout." in name else 0.0), name


def test_the_backend_decides_whether_the_loss_may_chunk_the_head(tiny_model_dir, tokenizer, backend, capsys):
    config = train_config(tiny_model_dir, lora=True)
    assert output_head(built(config, tokenizer, backend, capsys)[0]) is not None
    backend.chunks_output_head = False  # what a ZeRO-3 or XLA backend says
    try:
        model = built(config, tokenizer, backend, capsys)[0]
    finally:
        del backend.chunks_output_head
    assert output_head(model) is None


def test_the_backend_decides_whether_the_lora_layers_are_fused(tiny_model_dir, tokenizer, backend, capsys):
    from gpt4all_training.model.lora import FusedLoraLinear

    config = train_config(tiny_model_dir, lora=True)
    assert any(isinstance(m, FusedLoraLinear) for m in built(config, tokenizer, backend, capsys)[0].modules())
    backend.fuses_lora = False  # what a ZeRO-3 backend says
    try:
        model = built(config, tokenizer, backend, capsys)[0]
    finally:
        del backend.fuses_lora
    assert not any(isinstance(m, FusedLoraLinear) for m in model.modules())


@pytest.mark.parametrize("lora", [False, True])
def test_a_bf16_run_stores_a_lora_base_in_bf16_with_the_adapter_in_fp32(tiny_model_dir, tokenizer, backend, capsys,
                                                                        lora):
    """dtype bfloat16 under LoRA: the frozen base is stored in bf16 (storage_dtype), and PEFT keeps the trained
    adapter, and so the optimizer state built over it, in fp32; the counts are the fp32 run's. A full fine-tune
    keeps every weight in fp32 (the master weights)."""
    _, fp32_line = built(train_config(tiny_model_dir, lora=lora), tokenizer, backend, capsys)
    model, line = built(train_config(tiny_model_dir, lora=lora, dtype="bfloat16"), tokenizer, backend, capsys)
    assert line == fp32_line
    dtypes = {(param.requires_grad, param.dtype) for param in model.parameters()}
    assert dtypes == ({(True, torch.float32), (False, torch.bfloat16)} if lora else {(True, torch.float32)})


@pytest.fixture(scope="module")
def dolly_batches(clean_dolly, tokenizer) -> list[dict[str, torch.Tensor]]:
    """Five micro-batches of four real tokenised Dolly examples."""
    from gpt4all_training.data.records import load_records
    from gpt4all_training.data.sft import tokenize_dataset

    records = load_records(str(clean_dolly)).select(range(20))
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]}
            for r in tokenize_dataset(records, tokenizer, 64, "plain", None)]
    return [collate(rows[i:i + 4], pad_id=0) for i in range(0, 20, 4)]


def lora_steps(model, batches, autocast: bool) -> dict[str, torch.Tensor]:
    """The adapter after one AdamW step per batch, under bf16 autocast or in fp32."""
    from gpt4all_training.batch import trained_token_count

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = token_loss_sum(model, batch) / trained_token_count(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name].float() - b[name].float()).abs().max().item() for name in a)


def test_a_bf16_lora_base_trains_the_adapter_the_fp32_base_trains(tiny_model_dir, tokenizer, backend, capsys,
                                                                  dolly_batches):
    """Five steps under bf16 autocast over the base stored in bf16 give the adapter, and the merged model's logits,
    of the same steps over the fp32 base, within the distance between that run and the same steps in fp32 (bf16's
    own rounding, which autocast accepts already); the base's tensors are bitwise what was loaded."""
    runs = {}
    for name, dtype in (("bf16 base", "bfloat16"), ("fp32 base", "float32"), ("fp32", "float32")):
        model, _ = built(train_config(tiny_model_dir, lora=True, dtype=dtype), tokenizer, backend, capsys)
        loaded = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        adapter = lora_steps(model, dolly_batches, autocast=name != "fp32")
        assert all(torch.equal(p, loaded[n]) for n, p in model.named_parameters() if not p.requires_grad), name
        if name == "fp32 base":  # the same merge over the base rounded to bf16: what storing it in bf16 changes
            rounded = copy.deepcopy(model)
            with torch.no_grad():
                for param in rounded.parameters():
                    if not param.requires_grad:
                        param.copy_(param.bfloat16())
            runs["fp32 base, rounded"] = adapter, merged_logits(rounded, dolly_batches[0])
        runs[name] = adapter, merged_logits(model, dolly_batches[0])
    adapter_noise = largest_difference(runs["fp32 base"][0], runs["fp32"][0])
    assert 0 < largest_difference(runs["bf16 base"][0], runs["fp32 base"][0]) <= adapter_noise
    # The merged model holds the base as it was stored (bf16) plus the adapter: its logits differ from the fp32
    # base's merged model by at most the rounding of the base and the adapter's noise.
    tolerance = (largest_difference(runs["fp32 base"][1], runs["fp32"][1])
                 + largest_difference(runs["fp32 base"][1], runs["fp32 base, rounded"][1]))
    assert 0 < largest_difference(runs["bf16 base"][1], runs["fp32 base"][1]) <= tolerance


def merged_logits(model, batch) -> dict[str, torch.Tensor]:
    """The logits of the model merged in fp32 (as final/merged/ is written), computed in fp32."""
    with torch.no_grad():
        return {"logits": copy.deepcopy(model).float().merge_and_unload()(batch["input_ids"]).logits}
