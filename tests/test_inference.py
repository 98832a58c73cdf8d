"""inference.py on the tiny GPT-J and the cleaned Dolly sample: one process against two (torchrun, gloo), the
per-example loss against a hand computation, the split against training's, and an adapter folder."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from support.files import write_jsonl
from support.models import build_tiny_gptj
from support.paths import PYTHON, REPO
from gpt4all_training.config.loader import load_config
from gpt4all_training.batch import IGNORE
from gpt4all_training.data.batching import collate
from gpt4all_training.data.sft import load_data
from gpt4all_training.errors import UserError
from gpt4all_training.model.loading import load_model
from gpt4all_training.analysis.inference import (example_losses, length_sorted_order, pool_hidden, rank_share,
                                                 run_inference)
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import InferenceConfig

# Measured: 1 vs 2 processes differ by at most 1e-6 in loss and 7e-7 in embeddings (fp32, different batches).
TOLERANCE = 1e-5


def read_run(path):
    table = pq.read_table(path)
    embeddings = table.column("embedding").combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
    return table.drop_columns(["embedding"]).to_pydict(), embeddings


def inference_config(model_dir, data_dir, output_dir, **overrides) -> InferenceConfig:
    # max_length 128 truncates some Dolly examples; batch 8 makes 1- and 2-process batches differ.
    values = dict(model_name=str(model_dir), dataset_path=str(data_dir), output_dir=str(output_dir), max_length=128,
                  val_fraction=0.1, batch_size=8, num_proc=1)
    values.update(overrides)
    return validate(InferenceConfig(**values))


# The scores that need more passes (the response alone, a proxy model, a greedy decode), sharded like the loss. The
# proxy is the scored model itself, so its IFD must be the model's own.
def score_overrides(model_dir) -> dict:
    return dict(ifd=True, ifd_model=str(model_dir), checker={"name": "exact_match"}, checker_max_new_tokens=4)


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, clean_dolly, tmp_path_factory):
    config = inference_config(tiny_model_dir, clean_dolly, tmp_path_factory.mktemp("inference-1"),
                              **score_overrides(tiny_model_dir))
    path = run_inference(config)
    return config, path


@pytest.fixture(scope="module")
def two_processes(tiny_model_dir, clean_dolly, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("inference-2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(REPO / "inference.py"),
         f"model_name={tiny_model_dir}", f"dataset_path={clean_dolly}", f"output_dir={output_dir}",
         "max_length=128", "val_fraction=0.1", "batch_size=8", "num_proc=1",
         *(f"{key}={json.dumps(value)}" for key, value in score_overrides(tiny_model_dir).items())],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir / "inference.parquet", result.stdout


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_give_the_rows_of_one(one_process, two_processes):
    (_, path_1), (path_2, stdout) = one_process, two_processes
    rows_1, emb_1 = read_run(path_1)
    rows_2, emb_2 = read_run(path_2)
    assert "619 examples" in stdout and "on 2 process(es)" in stdout
    assert len(rows_1["index"]) == 619  # every Dolly record once: none dropped, none repeated
    for column in ("split", "index", "n_tokens", "prompt", "response", "source", "model_answer", "agreement"):
        assert rows_1[column] == rows_2[column], column
    for column in ("loss", "response_loss", "ifd", "proxy_ifd", "outlier"):
        np.testing.assert_allclose(rows_1[column], rows_2[column], rtol=0, atol=TOLERANCE, err_msg=column)
    np.testing.assert_allclose(rows_1["proxy_ifd"], rows_1["ifd"], rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(emb_1, emb_2, rtol=0, atol=TOLERANCE)
    assert emb_1.dtype == np.float32 and emb_1.shape == (619, 64)


@pytest.mark.integration
def test_rows_are_ordered_by_split_then_index_and_unique(one_process):
    rows, _ = read_run(one_process[1])
    keys = list(zip(rows["split"], rows["index"]))
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert set(rows["split"]) == {"train", "val"}


@pytest.mark.integration
def test_split_and_trained_tokens_are_training_s(one_process, tokenizer):
    config, path = one_process
    rows, _ = read_run(path)
    (train, val), _ = load_data(config, tokenizer)  # exactly what train.py calls
    assert [i for s, i in zip(rows["split"], rows["index"]) if s == "val"] == sorted(val["index"])
    assert [i for s, i in zip(rows["split"], rows["index"]) if s == "train"] == sorted(train["index"])
    trained = {("train", r["index"]): r["n_trained"] for r in train} | {("val", r["index"]): r["n_trained"]
                                                                         for r in val}
    assert [trained[k] for k in zip(rows["split"], rows["index"])] == rows["n_tokens"]


@pytest.mark.integration
def test_loss_is_the_mean_over_trained_tokens_by_hand(one_process, tiny_model_dir, tokenizer):
    config, path = one_process
    rows, embeddings = read_run(path)
    (train, val), _ = load_data(config, tokenizer)
    model = load_model(str(tiny_model_dir)).eval()
    for split, dataset in (("train", train), ("val", val)):
        example = dataset[0]
        ids, labels = example["input_ids"], example["labels"]
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        log_probs = torch.log_softmax(out.logits[0].double(), dim=-1)
        # position t predicts token t+1; only positions whose label is not IGNORE count
        nll = [-log_probs[t, ids[t + 1]].item() for t in range(len(ids) - 1) if labels[t + 1] != IGNORE]
        row = list(zip(rows["split"], rows["index"])).index((split, example["index"]))
        assert rows["n_tokens"][row] == len(nll) > 0
        assert rows["loss"][row] == pytest.approx(sum(nll) / len(nll), abs=1e-5)
        np.testing.assert_allclose(embeddings[row], out.hidden_states[-1][0, -1].numpy(), atol=1e-5)


def test_example_losses_on_hand_made_logits():
    # Two rows, vocabulary 2. Logits (0, log 3) give p(1) = 3/4, p(0) = 1/4.
    logits = torch.tensor([[[0.0, np.log(3)]] * 3, [[0.0, np.log(3)]] * 3])
    labels = torch.tensor([[IGNORE, 1, 0], [IGNORE, IGNORE, IGNORE]])
    loss, n_tokens = example_losses(logits, labels)
    assert n_tokens.tolist() == [2, 0]
    assert loss[0].item() == pytest.approx((-np.log(0.75) - np.log(0.25)) / 2, abs=1e-6)
    assert torch.isnan(loss[1])  # nothing trained: no loss, rather than a misleading 0


def test_pooling_ignores_padding():
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert pool_hidden(hidden, mask, "last").tolist() == [[2.0, 3.0], [10.0, 11.0]]
    assert pool_hidden(hidden, mask, "mean").tolist() == [[1.0, 2.0], [8.0, 9.0]]


def test_mean_pooling_is_independent_of_batch_padding(tiny_model_dir, tokenizer):
    model = build_tiny_gptj(tokenizer).eval()
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE, 6, 7, 8, 9]},
            {"input_ids": [10, 11], "labels": [IGNORE, 11]}]
    batch = collate(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        padded = pool_hidden(model(**{k: batch[k] for k in ("input_ids", "attention_mask")},
                                   output_hidden_states=True).hidden_states[-1], batch["attention_mask"], "mean")
        alone = model(torch.tensor([[10, 11]]), output_hidden_states=True).hidden_states[-1][0].mean(dim=0)
    torch.testing.assert_close(padded[1], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_shares_cover_every_example_once(world_size):
    lengths = np.array([5, 9, 9, 1, 7, 3, 9])
    order = length_sorted_order(lengths, np.zeros(7, dtype=np.int64), np.arange(7))
    assert order.tolist() == [1, 2, 6, 4, 0, 5, 3]  # longest first, ties by index
    shares = [rank_share(order, r, world_size) for r in range(world_size)]
    assert sorted(np.concatenate(shares).tolist()) == list(range(7))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.integration
def test_adapter_folder_and_bf16(tiny_model_dir, tokenizer, tmp_path):
    """A LoRA adapter folder loads as base plus adapter; bf16 runs and stays near fp32."""
    from peft import LoraConfig, get_peft_model

    base = load_model(str(tiny_model_dir))
    peft_model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # a zero B would make the adapter a no-op
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(adapter_dir)
    tokenizer.save_pretrained(adapter_dir)
    merged = peft_model.merge_and_unload().eval()

    rows = [{"source": "t", "prompt": f"Question {i}: what is {i} plus {i}?", "response": f"It is {2 * i}."}
            for i in range(10)]
    data = write_jsonl(tmp_path / "data" / "tiny_clean.jsonl", rows)
    config = inference_config(adapter_dir, data, tmp_path / "out", val_fraction=0.2)
    table = pq.read_table(run_inference(config))
    for r, (split, index, loss) in enumerate(zip(*(table.column(c).to_pylist() for c in ("split", "index", "loss")))):
        ids = tokenizer(rows[index]["prompt"] + "\n")["input_ids"]
        target = tokenizer(rows[index]["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            logits = merged(torch.tensor([ids + target])).logits[0, len(ids) - 1:-1]
        expected = torch.nn.functional.cross_entropy(logits, torch.tensor(target)).item()
        assert loss == pytest.approx(expected, abs=1e-4), (split, index)

    bf16 = pq.read_table(run_inference(replace(config, dtype="bfloat16", output_dir=str(tmp_path / "bf16"))))
    np.testing.assert_allclose(bf16.column("loss").to_numpy(), table.column("loss").to_numpy(), rtol=2e-2)
    summary = json.loads((tmp_path / "out" / "inference.json").read_text())
    assert summary["examples"] == 10 and summary["splits"]["val"]["examples"] == 2


def test_bad_pooling_is_a_one_line_user_error():
    with pytest.raises(UserError, match=r"^pooling: must be one of last, mean, got 'max'$"):
        load_config(None, ["model_name=m", "dataset_path=d", "pooling=max"], cls=InferenceConfig,
                    check=validate)
    with pytest.raises(UserError, match="^dataset_path: missing"):
        load_config(None, ["model_name=m"], cls=InferenceConfig, check=validate)


@pytest.mark.integration
def test_a_split_other_than_the_training_runs_is_refused_in_one_line(tiny_model_dir, tokenizer, tmp_path, capsys):
    """A training run's final/ records its config; inference under another seed or val_fraction would label
    training examples as validation ones, so it is refused naming both values; under the run's own it labels the
    split exactly as training drew it."""
    from gpt4all_training.cli.main import main
    from gpt4all_training.config.schemas import TrainConfig
    from gpt4all_training.training.loop import train

    rows = [{"source": "t", "prompt": f"Question {i}: what is {i} plus {i}?", "response": f"It is {2 * i}."}
            for i in range(12)]
    data = write_jsonl(tmp_path / "data" / "sums_clean.jsonl", rows).parent
    run = validate(TrainConfig(model_name=str(tiny_model_dir), dataset_path=str(data), output_dir=str(tmp_path / "run"),
                               max_length=64, batch_size=4, seed=7, val_fraction=0.25, max_steps=2, eval_every=None,
                               save_every=None, num_proc=1, dtype="float32"))
    train(run)
    final = tmp_path / "run" / "final"
    inference = tmp_path / "inference.yaml"
    inference.write_text(f"model_name: {final}\ndataset_path: {data}\nmax_length: 64\nnum_proc: 1\n"
                         f"output_dir: {tmp_path / 'scores'}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["inference", "--config", str(inference), "seed=42", "val_fraction=0.1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: model_name {final}: its training run split the data with seed=7, val_fraction=0.25 (see "
        f"{final / 'config.yaml'}), but this config has seed=42, val_fraction=0.1, so the split column would not be "
        f"the training split; set seed=7 val_fraction=0.25")
    assert not (tmp_path / "scores").exists()

    with pytest.raises(SystemExit) as exit_info:
        main(["inference", "--config", str(inference), "seed=7", "val_fraction=0.25"])
    assert exit_info.value.code == 0
    scored, _ = read_run(tmp_path / "scores" / "inference.parquet")
    (_, val), _ = load_data(run, tokenizer)
    assert [i for s, i in zip(scored["split"], scored["index"]) if s == "val"] == sorted(val["index"]) != []
