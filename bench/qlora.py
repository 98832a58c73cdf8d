"""QLoRA on the CPU: SmolLM2-135M-Instruct's weights in 4-bit against bf16, and a LoRA step over the 4-bit base
against the same LoRA over the unquantized base (bf16 autocast, the bf16 LoRA rows of train_throughput.py).

    python bench/qlora.py [--repeats 2] [--steps 8]
    python bench/qlora.py --gpu-row prepare|ours|trl --size 8b|dry-run --work DIR   # bench/gpu.sh --qlora

The GPU rows (bench/gpu.sh --qlora, one lease of their own): a Llama-3-8B-shaped model (random weights from its
config, saved once in bf16) trained with a 4-bit nf4 base (double quantization, bf16 compute) and a LoRA adapter
(r=16 on every linear layer), one row of 2048 tokens per micro-batch, activation checkpointing on: by our `train`
and by TRL's SFTTrainer with the same model, adapter, data and settings (its QLoRA recipe: BitsAndBytesConfig,
prepare_model_for_kbit_training, peft_config). Each row writes DIR/qlora_<row>.json: tokens/s after the warm-up
steps and the GPU's peak allocated memory (target: under 24 GB).

Every measurement is a fresh process (bench/harness.py). Weight memory is the bytes of the loaded model's parameters
and buffers (the packed 4-bit weights with their quantization constants); step time is our `train` with
train_throughput.py's SmolLM2 setting (LoRA r=16 on every linear layer, 3 examples of up to 512 tokens per step),
`load_in_4bit: true` the only difference, the median of its steps after the first two.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from gpt4all_training.run_folder import METRICS_FILE  # noqa: E402

VARIANTS = {"bf16 LoRA": [], "4-bit nf4 LoRA": ["load_in_4bit=true"]}
GPU_SIZES = {
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "seq": 2048, "steps": 12, "warmup": 2},
    "dry-run": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 512, "seq": 128, "steps": 4, "warmup": 1},
}
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "lr": 2e-4}


def model_bytes(model) -> dict[str, float]:
    """MiB of the parameters and buffers, and of the decoder's linear weights alone (packed, constants included)."""
    from gpt4all_training.model.quantization import is_quantized, quantized_bytes

    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    if is_quantized(model):
        weights, linear = quantized_bytes(model)
    else:
        linears = [m.weight for name, m in model.named_modules() if ".layers." in name and hasattr(m, "in_features")]
        weights, linear = sum(w.numel() for w in linears), sum(w.numel() * w.element_size() for w in linears)
    return {"total_mib": total / 2**20, "linear_mib": linear / 2**20, "linear_weights": weights}


def memory_worker() -> dict:
    import torch

    from gpt4all_training.model.loading import load_model
    from gpt4all_training.model.quantization import bnb_config, quantization_settings

    path = str(harness.smollm2())
    bf16 = model_bytes(load_model(path, dtype=torch.bfloat16))
    settings = quantization_settings({"load_in_4bit": True})
    nf4 = model_bytes(load_model(path, dtype=torch.bfloat16, quantization=bnb_config(settings, torch.bfloat16)))
    return {"bf16": bf16, "nf4": nf4}


def train_worker(variant: str, steps: int, output_dir: Path) -> dict:
    from gpt4all_training.cli.main import run_command

    model, data = harness.smollm2(), harness.clean_data()
    overrides = harness.ours_overrides("smollm2", model, data, output_dir, steps) + VARIANTS[variant]
    config = harness.WORK / "qlora-config.yaml"
    config.write_text("{}\n")
    if run_command(["train", "--config", str(config), *overrides]) != 0:
        raise RuntimeError(f"train {variant} failed")
    rows = [json.loads(line) for line in (output_dir / METRICS_FILE).read_text().splitlines()]
    rows = [row for row in rows if "loss" in row][harness.MODELS["smollm2"]["warmup"]:]
    seconds = [row["batch_seconds"] + row["update_seconds"] for row in rows]
    tokens = sum(row["tokens_per_s"] * s for row, s in zip(rows, seconds))
    return {"step_s": statistics.median(seconds), "tokens_per_s": tokens / sum(seconds),
            "peak_rss_mb": max(row["peak_rss_mb"] for row in rows), "steps": len(rows)}


# ---------------------------------------------------------------- the GPU rows

def gpu_prepare(work: Path, size: dict) -> dict:
    """A word-level tokenizer (one token per word), documents of random words for every step, and the model in bf16
    with random weights (seeded), built on the GPU where there is one and saved as a model folder."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(2, size["vocab_size"])]
    backend = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "<unk>": 1, **{w: i for i, w in enumerate(words, 2)}},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", unk_token="<unk>",
                            pad_token="<|endoftext|>").save_pretrained(work / "tokenizer")
    rng = np.random.default_rng(0)
    documents = [" ".join(words[i] for i in rng.integers(0, len(words), size["seq"]))
                 for _ in range(2 * size["steps"])]
    (work / "data.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    config = LlamaConfig(**{k: v for k, v in size.items() if k not in ("seq", "steps", "warmup")},
                         max_position_embeddings=size["seq"], bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(work / "model")
    return {"status": "ok", "parameters": sum(p.numel() for p in model.parameters()), "documents": len(documents)}


def peak_gpu_gb() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None


def gpu_ours(work: Path, size: dict) -> dict:
    import yaml

    from gpt4all_training.cli.main import run_command

    output_dir = work / "ours"
    config = {"objective": "causal_lm", "model_name": str(work / "model"), "tokenizer_name": str(work / "tokenizer"),
              "dataset_path": str(work / "data.jsonl"), "max_length": size["seq"], "batch_size": 1,
              "val_fraction": 0.0, "lora": True, "lora_r": LORA["r"], "lora_alpha": LORA["alpha"],
              "lora_dropout": LORA["dropout"], "lora_target_modules": harness.LORA_TARGETS, "load_in_4bit": True,
              "dtype": "bfloat16", "gradient_checkpointing": True, "lr": LORA["lr"], "warmup_steps": 0,
              "max_steps": size["steps"], "eval_every": None, "save_every": None, "log_every": 1,
              "output_dir": str(output_dir), "report_to": ["jsonl"], "seed": 0}
    (work / "ours.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    if run_command(["train", "--config", str(work / "ours.yaml")]) != 0:
        raise RuntimeError("train failed")
    rows = [row for row in map(json.loads, (output_dir / METRICS_FILE).read_text().splitlines())
            if "tokens_per_s" in row][size["warmup"]:]
    seconds = [row["batch_seconds"] + row["update_seconds"] for row in rows]
    return {"status": "ok", "tokens_per_s": sum(r["tokens_per_s"] * s for r, s in zip(rows, seconds)) / sum(seconds),
            "peak_gpu_gb": peak_gpu_gb(), "steps": len(rows), "config": config}


def gpu_trl(work: Path, size: dict) -> dict:
    import time

    import torch
    from datasets import load_dataset
    from peft import LoraConfig, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(work / "model", quantization_config=quantization,
                                                 dtype=torch.bfloat16, device_map={"": 0} if torch.cuda.is_available()
                                                 else None)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    args = SFTConfig(output_dir=str(work / "trl"), max_steps=size["steps"], per_device_train_batch_size=1,
                     learning_rate=LORA["lr"], lr_scheduler_type="constant", bf16=torch.cuda.is_available(),
                     gradient_checkpointing=True, packing=True, max_length=size["seq"], dataset_text_field="text",
                     save_strategy="no", report_to="none", logging_steps=size["steps"], disable_tqdm=True, seed=0,
                     use_cpu=not torch.cuda.is_available())
    trainer = SFTTrainer(model=model, args=args, processing_class=AutoTokenizer.from_pretrained(work / "tokenizer"),
                         train_dataset=load_dataset("json", data_files=str(work / "data.jsonl"), split="train"),
                         peft_config=LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                                target_modules=harness.LORA_TARGETS, task_type="CAUSAL_LM"),
                         callbacks=[Clock()])
    trainer.train()
    seconds = ends[-1] - ends[size["warmup"] - 1]
    return {"status": "ok", "tokens_per_s": size["seq"] * (len(ends) - size["warmup"]) / seconds,
            "peak_gpu_gb": peak_gpu_gb(), "steps": len(ends) - size["warmup"]}


GPU_ROWS = {"prepare": gpu_prepare, "ours": gpu_ours, "trl": gpu_trl}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=["memory", "train"])
    parser.add_argument("--variant", choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output-dir", type=Path)
    parser.add_argument("--gpu-row", choices=list(GPU_ROWS))
    parser.add_argument("--size", choices=list(GPU_SIZES), default="8b")
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()
    if args.gpu_row:
        args.work.mkdir(parents=True, exist_ok=True)
        result = GPU_ROWS[args.gpu_row](args.work, GPU_SIZES[args.size])
        (args.work / f"qlora_{args.gpu_row}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(json.dumps({k: v for k, v in result.items() if k != "config"}))
        return
    harness.setup_environment()
    if args.worker == "memory":
        print(json.dumps(memory_worker()))
        return
    if args.worker == "train":
        print(json.dumps(train_worker(args.variant, args.steps, args.output_dir)))
        return
    print(harness.machine())
    memory = harness.run_worker("qlora.py", ["--worker", "memory"])
    for name, row in (("bf16", memory["bf16"]), ("4-bit nf4, double quantization", memory["nf4"])):
        print(f"| {name} | {row['total_mib']:,.1f} | {row['linear_mib']:,.1f} | "
              f"{8 * row['linear_mib'] * 2**20 / row['linear_weights']:.3f} |")
    runs: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for repeat in range(args.repeats):
        for variant in VARIANTS:  # alternating, so a change in the machine's load falls on both
            out = harness.WORK / "runs" / f"qlora-{variant.split()[0]}-{repeat}"
            shutil.rmtree(out, ignore_errors=True)
            runs[variant].append(harness.run_worker("qlora.py", ["--worker", "train", "--variant", variant,
                                                                 "--steps", str(args.steps), "--output-dir", str(out)]))
            print(variant, runs[variant][-1], flush=True)
    for variant, results in runs.items():
        print(f"| {variant} | {harness.median([r['step_s'] for r in results]):.2f} "
              f"({', '.join(format(r['step_s'], '.2f') for r in results)}) | "
              f"{harness.median([r['tokens_per_s'] for r in results]):,.0f} | "
              f"{max(r['peak_rss_mb'] for r in results):,.0f} |")


if __name__ == "__main__":
    main()
