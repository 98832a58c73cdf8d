#!/usr/bin/env bash
# The GPU benchmark, prepared to run once on a lent GPU machine (one H100 or H200) in at most 9 minutes (a 540 s
# budget: with the machine's start and the copies back it fits one 15-minute lease):
#
#   bash bench/gpu.sh [--out DIR] [--skip STAGE,...]   # results in DIR, else $OUT, else bench_gpu_out/
#   bash bench/gpu.sh --dry-run --out DIR               # the same code paths at tiny sizes on a CPU
#
# Stages, each in its own process under its share of the time budget, in the order they run (the most important
# first: where the budget runs out it cuts the last ones); a stage that fails or runs out of time is recorded with
# its error line and the next one runs. The seconds are estimates for one H100 (SXM, 989 TFLOP/s dense bf16): each
# row's FLOPs at ~355 TFLOP/s (the 1B row's rate on the H200) or ~400 (LoRA, the 40% of 989 NeMo reports for 8B
# LoRA on one H100), plus its start and loading:
#   hardware    versions, the GPU, the bf16 matmul peak (the MFU denominator) and the GPU's published dense bf16
#               peak (bench/gpu_peaks.py; a device not in its table gets none, and "-" in the published MFU column)
#               (~20 s)
#   cuda_tests  tests/test_cuda.py (bf16 numerics, packed examples kept apart by the attention kernels) (~60 s)
#   prepare     a word-level tokenizer (32000 words), documents of random words (no downloads), the model's size
#               (~15 s)
#   ours        a ~1B Llama trained from random init by `python3 train.py --config ...` (causal_lm rows of 4096):
#               25 steps of 32768 tokens at 7.84 GFLOP a token, 6.4 PFLOP: ~18 s of steps, ~60 s in all
#   lora8b, lora8b_gc
#               LoRA (r=16, every linear layer but the head) on a Llama-3-8B-shaped model (hidden 4096, 32 layers,
#               32 heads, 8 KV heads, MLP 14336, vocab 128256) built from its config at random init, its frozen base
#               in bf16, by train.py; without and with activation checkpointing (tokens/s, MFU both ways, peak GPU
#               memory). 8 steps of 2 x 2048 tokens at 4N + 6 n_lora + 12 n_layer hidden seq = 33.5 GFLOP a token:
#               1.1 PFLOP, ~3 s of steps (~5 s with checkpointing's second forward). Loading dominates: the first
#               row builds the 8.0B random weights on the GPU and saves them (16 GB, ~30 s), each row's train.py
#               loads them (~20 s) after its imports: ~75 s, then ~45 s
#   smollm2_lora bench/train_throughput.py's SmolLM2 LoRA row (ours packed against TRL packed, bf16, 3 alternating
#               repeats) at 8 times the CPU batch, on SmolLM2-135M's shapes with random weights (the trained ones are
#               not on that machine); host-bound, 6 fresh processes: its 120 s cap. Carry
#               .cache/bench/smollm2-135m-shape and .cache/bench/dolly-clean, which bench/harness.py builds here.
#               The dry run runs this one stage on the tiny GPT-J.
#   trl_wrapped the 1B model, data and step size through TRL's SFTTrainer with packing=True and packing_strategy
#               wrapped: fixed rows of max_length, the layout ours trains on (~60 s)
#   smollm2_full, smollm2_profile (--profile: where the LoRA row's step time goes, with the plain transformers +
#               PEFT step beside it), trl (packing=True, its default bfd: measured twice on the H200),
#               smollm2_lora_gc, smollm2_full_gc: 120-150 s each, run as far as the budget reaches (the stages
#               up to trl_wrapped are estimated at ~455 s, so smollm2_full is the first one cut short)
#   report      results.json and results.md: every row's MFU against the measured matmul peak and against the
#               published peak (null / "-" where the device is not in the table, as in the dry run)
# The out dir gets results.json, results.md, log.txt and NAME_metrics.jsonl (each train.py row's per-step rows).
# --skip leaves stages out (the report says "not run"), to spend a short lease on what is not yet measured.
#
#   bash bench/gpu.sh --qlora [--out DIR]     # (with --dry-run: tiny sizes on a CPU)
# runs instead, under a budget of its own, bench/qlora.py's GPU rows: a Llama-3-8B-shaped model built from its
# config (random bf16 weights) trained as QLoRA (4-bit nf4 base, LoRA r=16 on every linear layer, 2048 tokens per
# micro-batch, activation checkpointing) by ours and by TRL's SFTTrainer: tokens/s and peak GPU memory (target: under
# 24 GB), in DIR/qlora_ours.json and DIR/qlora_trl.json. Needs bitsandbytes on the machine (requirements.txt's pin).
#
# On the GPU machine, wheels in .whl/ (trl, datasets and the datasets dependencies that machine lacks) are installed
# first into /tmp/site; carry .whl with the call. The dry run installs nothing: a row whose package is missing is
# recorded as skipped (trl) or as an error.
set -uo pipefail

dry_run=0
qlora=0
skip=,
out=${OUT:-bench_gpu_out}
while (($#)); do
  case $1 in
    --dry-run) dry_run=1; shift ;;
    --qlora) qlora=1; shift ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --skip) skip=,${2:?--skip needs stage names, comma-separated},; shift 2 ;;
    *) echo "error: unknown argument $1; use --dry-run, --qlora, --out DIR and --skip STAGE,..." >&2; exit 2 ;;
  esac
done
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
repo=$PWD
python=${PYTHON:-python3}
if ((dry_run)); then mode=dry-run budget=300; else mode=full budget=540; fi
reserve=20  # seconds kept back for the report, whatever the stages before it took
log=$out/log.txt
: > "$log"
work=$(mktemp -d -t gpu-bench.XXXXXX) || exit 2
trap 'rm -rf "$work"' EXIT

export PYTHONUNBUFFERED=1 PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
# No network on the GPU machine: every Hub lookup would wait for its timeout. Caches stay in the work dir.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME=$work/hf WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false TQDM_MININTERVAL=10

say() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$log"; }

if ((!dry_run)) && compgen -G ".whl/*.whl" > /dev/null; then
  say "installing the carried wheels into /tmp/site: $(cd .whl && echo *.whl)"
  if "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl >> "$log" 2>&1; then
    export PYTHONPATH=/tmp/site:$PYTHONPATH
  else
    say "the wheels did not install (see log.txt); going on with the packages already there"
  fi
fi

if ((!dry_run)) && ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>> "$log"; then
  say "error: $python sees no CUDA device; on a CPU machine run bench/gpu.sh --dry-run"
  exit 2
fi

# stage NAME CAP COMMAND...: run COMMAND for at most CAP seconds and never past the budget; its output goes to the
# console, log.txt and $work/NAME.log, its exit code and limit to $work/NAME.exit for the report.
stage() {
  local name=$1 cap=$2
  shift 2
  if [[ $skip == *,$name,* ]]; then
    say "$name: skipped (--skip)"
    return
  fi
  local left=$((budget - SECONDS - reserve))
  local limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    echo "124 0" > "$work/$name.exit"
    say "$name: not run, the ${budget} s budget is spent"
    return
  fi
  say "$name: start (at most ${limit} s)"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$work/$name.log" | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "$rc $limit" > "$work/$name.exit"
  say "$name: exit code $rc"
}

cat > "$work/bench.py" <<'PY'
"""bench/gpu.sh's stages: `python bench.py STAGE WORK_DIR MODE` writes WORK_DIR/STAGE.json (report: the out dir)."""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from xml.etree import ElementTree

sys.path.insert(0, str(Path.cwd() / "bench"))  # run from the repository: gpu_peaks, and train_throughput's table
from gpu_peaks import mfu, published_peak  # noqa: E402

SIZES = {
    # A ~1B Llama (16 layers of 10.5M attention + 50.3M MLP weights, untied 65.5M embedding and LM head). A step is
    # 8 rows of 4096 tokens, as 2 micro-batches of 4 rows: about 65 GB of activations, params and AdamW state.
    "full": {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate": 8192, "vocab": 32000,
             "seq": 4096, "micro_batch": 4, "accumulation": 2, "steps": 25, "warmup": 5, "num_proc": 4,
             "matmul": 8192, "matmul_repeats": 20},
    "dry-run": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512,
                "seq": 128, "micro_batch": 2, "accumulation": 2, "steps": 3, "warmup": 1, "num_proc": 1,
                "matmul": 256, "matmul_repeats": 3},
}
# The LoRA rows: Llama-3-8B's shapes (untied 128256-word embedding and head), LoRA r=16 on every linear layer but
# the head, the base stored in bf16; a step is 2 micro-batches of one 2048-token row. The activations one row keeps
# without checkpointing come to roughly 200 KB a token a layer, ~13 GB: beside the 16 GB of weights both rows fit an
# 80 GB card.
LORA_SIZES = {
    "full": {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "intermediate": 14336, "vocab": 128256,
             "seq": 2048, "micro_batch": 1, "accumulation": 2, "steps": 8, "warmup": 2, "num_proc": 4},
    "dry-run": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512,
                "seq": 128, "micro_batch": 1, "accumulation": 2, "steps": 3, "warmup": 1, "num_proc": 1},
}
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "lr": 2e-4}
EOS, UNK = "<|endoftext|>", "<unk>"
LR, LR_WARMUP = 1e-4, 2  # speed does not depend on them; both rows use the same
DATA_MARGIN = 1.5  # documents hold this many times the tokens the steps consume, so no row repeats
MATMUL_ROUNDS = 3  # the peak is the best round: a clock still ramping up would lower a single one
FLOPS_FORMULA = "6N + 12 * n_layer * hidden * seq"
# LoRA: the frozen base's forward and activation gradients (no weight gradients), the adapter's full 6 per parameter,
# the attention products as above (their backward is all activation gradients). A checkpointed run computes a
# second forward that this count leaves out (MFU counts the model's FLOPs, not the hardware's).
LORA_FLOPS_FORMULA = "4N + 6 * n_lora + 12 * n_layer * hidden * seq"
SDPA_PACKING = ("; TRL documents padding-free for FlashAttention 2/3: under sdpa, transformers turns the restarting "
                "positions into a block-diagonal mask over the whole flattened micro-batch, run by a masked kernel")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------- hardware

def hardware(work: Path, sizes: dict, mode: str) -> dict:
    import torch

    environment = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "python": platform.python_version(), "cpu_count": os.cpu_count(), "cuda": torch.version.cuda,
                   "gpu": torch.cuda.get_device_name() if cuda() else None,
                   "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
                   if cuda() else None,
                   **{name: version(name) for name in ("torch", "transformers", "accelerate", "trl", "datasets",
                                                       "peft", "tokenizers", "pyarrow", "fsspec", "flash_attn")}}
    log(f"environment: {environment}")
    published = published_peak(environment["gpu"])
    log(f"published dense bf16 peak: {published / 1e12:.4g} TFLOP/s" if published else
        "published dense bf16 peak: not known for this device (bench/gpu_peaks.py)")
    try:
        matmul = matmul_peak(sizes)
    except Exception as exc:  # the environment is still worth recording
        traceback.print_exc()
        matmul = {"status": "error", "error": one_line(exc)}
    return {"status": "ok", "environment": environment, "matmul": matmul}


def matmul_peak(sizes: dict) -> dict:
    """bf16 products: the square one is the peak (the MFU denominator); the model's own shapes show how close its
    matmuls get to it. Timed with CUDA events after warm-up (perf_counter on a CPU)."""
    tokens = sizes["micro_batch"] * sizes["seq"]
    h, f, v, s = sizes["hidden"], sizes["intermediate"], sizes["vocab"], sizes["matmul"]
    shapes = [("square", s, s, s), ("MLP up: tokens x hidden x intermediate", tokens, h, f),
              ("MLP down: tokens x intermediate x hidden", tokens, f, h),
              ("LM head: tokens x hidden x vocab", tokens, h, v)]
    rows = []
    for name, m, k, n in shapes:
        flops = max(time_matmul(m, k, n, sizes["matmul_repeats"]) for _ in range(MATMUL_ROUNDS))
        rows.append({"name": name, "m": m, "k": k, "n": n, "flops_per_s": flops})
        log(f"matmul {m}x{k}x{n} ({name}): {flops / 1e12:.4g} TFLOP/s")
    return {"status": "ok", "peak_flops_per_s": rows[0]["flops_per_s"], "shapes": rows,
            "method": f"bf16 torch.matmul into a preallocated output, random normal inputs; best of "
                      f"{MATMUL_ROUNDS} rounds of {sizes['matmul_repeats']} products after 3 warm-ups"}


def time_matmul(m: int, k: int, n: int, repeats: int) -> float:
    import torch

    device = "cuda" if cuda() else "cpu"
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            torch.matmul(a, b, out=c)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000
    else:
        started = time.perf_counter()
        for _ in range(repeats):
            torch.matmul(a, b, out=c)
        seconds = time.perf_counter() - started
    return 2 * m * k * n * repeats / seconds


# ---------------------------------------------------------------- prepare: tokenizer, data, model size

def model_overrides(sizes: dict) -> dict:
    """The Llama fields both rows set; head_dim too, since the llama defaults fix it at 128 for hidden 4096."""
    return {"hidden_size": sizes["hidden"], "num_hidden_layers": sizes["layers"],
            "num_attention_heads": sizes["heads"], "num_key_value_heads": sizes["kv_heads"],
            "head_dim": sizes["hidden"] // sizes["heads"], "intermediate_size": sizes["intermediate"],
            "max_position_embeddings": sizes["seq"], "tie_word_embeddings": False}


def llama_config(sizes: dict, tokenizer):
    """The model config as `init: from_config` builds it (model/from_config.py): the llama defaults, our fields,
    then the vocabulary and special tokens of the tokenizer."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama")
    for key, value in model_overrides(sizes).items():
        setattr(config, key, value)
    config.vocab_size = len(tokenizer)
    for kind in ("bos", "eos", "pad"):
        setattr(config, f"{kind}_token_id", getattr(tokenizer, f"{kind}_token_id"))
    return config


def prepare(work: Path, sizes: dict, mode: str) -> dict:
    """A word-level tokenizer (one token per word, so a document's length in tokens is exact) and documents of
    random words, enough for every step of both rows; the model's parameter counts from a meta-device build."""
    tokenizer = write_tokenizer(work / "tokenizer", sizes["vocab"])
    documents, tokens = write_documents(work / "data.jsonl", sizes)
    model = meta_model(sizes, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    n_matmul = n_params - model.get_input_embeddings().weight.numel()
    flops_per_token = 6 * n_matmul + 12 * sizes["layers"] * sizes["hidden"] * sizes["seq"]
    log(f"model: {n_params:,} parameters, N = {n_matmul:,} without the input embedding; "
        f"{flops_per_token / 1e9:.2f} GFLOP per token")
    return {"status": "ok", "sizes": sizes, "vocab": len(tokenizer), "documents": documents, "tokens": tokens,
            "n_params": n_params, "n_params_flops": n_matmul, "flops_per_token": flops_per_token,
            "flops_formula": FLOPS_FORMULA, "overrides": model_overrides(sizes)}


def write_tokenizer(path: Path, vocab: int):
    """A word-level tokenizer of `vocab` tokens (EOS, UNK and the words w2...), saved to `path` and loaded back."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(2, vocab)]
    backend = Tokenizer(models.WordLevel({EOS: 0, UNK: 1, **{w: i for i, w in enumerate(words, start=2)}},
                                         unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([EOS, UNK])
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, unk_token=UNK, pad_token=EOS).save_pretrained(
        path)
    return AutoTokenizer.from_pretrained(path)


def write_documents(path: Path, sizes: dict) -> tuple[int, int]:
    """Documents of random words (seq/8 to seq/2 each), DATA_MARGIN times the tokens every step consumes, as JSON
    lines at `path`: their count and tokens."""
    import numpy as np

    seq = sizes["seq"]
    needed = DATA_MARGIN * sizes["steps"] * sizes["micro_batch"] * sizes["accumulation"] * seq
    rng = np.random.default_rng(0)
    records, tokens = [], 0
    while tokens < needed:
        ids = rng.integers(2, sizes["vocab"], size=int(rng.integers(seq // 8, seq // 2 + 1)))
        records.append(json.dumps({"text": " ".join(f"w{i}" for i in ids)}))
        tokens += len(ids)
    path.write_text("\n".join(records) + "\n", encoding="utf-8")
    log(f"data: {len(records)} documents of {seq // 8}-{seq // 2} words, {tokens:,} tokens")
    return len(records), tokens


def meta_model(sizes: dict, tokenizer):
    """The model both the CLI and TRL build, on the meta device: its shapes without its memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(llama_config(sizes, tokenizer))


# ---------------------------------------------------------------- ours: the training CLI

def ours(work: Path, sizes: dict, mode: str) -> dict:
    model = {"init": "from_config", "model_config": "llama", "model_config_overrides": model_overrides(sizes)}
    return train_cli(work, "ours", sizes, model, work / "tokenizer", work / "data.jsonl", {})


def train_cli(work: Path, name: str, sizes: dict, model: dict, tokenizer: Path, data: Path, settings: dict) -> dict:
    """`python3 train.py` on the Llama of `sizes` that the `model` keys give (causal_lm rows of seq tokens, bf16),
    with `settings` over the shared config; the row's throughput from its per-step metrics, copied to
    NAME_metrics.jsonl."""
    import yaml

    output_dir = work / name
    config = {"objective": "causal_lm", **model, "tokenizer_name": str(tokenizer),
              "dtype": "bfloat16", "dataset_path": str(data), "max_length": sizes["seq"],
              "val_fraction": 0.0, "num_proc": sizes["num_proc"], "batch_size": sizes["micro_batch"],
              "gradient_accumulation_steps": sizes["accumulation"], "lr_schedule": "cosine", "lr": LR,
              "warmup_steps": LR_WARMUP, "weight_decay": 0.0, "max_grad_norm": 1.0, "num_epochs": 100,
              "max_steps": sizes["steps"], "seed": 0, "eval_every": None, "save_every": None, "log_every": 1,
              "log_grads_every": None, "output_dir": str(output_dir), "report_to": ["jsonl"], **settings}
    (work / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    output = run_streaming([sys.executable, "train.py", "--config", str(work / f"{name}.yaml")])
    reported = re.search(r"parameters: ([\d,]+) trainable of ([\d,]+)", "\n".join(output))

    rows = [r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())
            if "tokens_per_s" in r]
    (work / f"{name}_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    # log_every 1: each row is one step's window. Its seconds follow from the row's trained tokens (the running
    # total's increase) over its trained tokens/s; its tokens (every position: causal_lm rows have no padding)
    # from tokens/s times those seconds.
    steps, trained_before = [], 0
    for row in rows:
        seconds = (row["trained_tokens"] - trained_before) / row["trained_tokens_per_s"]
        steps.append((row["tokens_per_s"] * seconds, seconds))
        trained_before = row["trained_tokens"]
    memory_key = "peak_gpu_mb" if "peak_gpu_mb" in rows[-1] else "peak_rss_mb"
    return {**timed(steps, sizes["warmup"]), "peak_memory_mb": max(r[memory_key] for r in rows),
            "memory_kind": "torch.cuda.max_memory_allocated" if memory_key == "peak_gpu_mb" else "host peak RSS",
            "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
            "n_params": int(reported.group(2).replace(",", "")) if reported else None,
            "n_trainable": int(reported.group(1).replace(",", "")) if reported else None,
            "attention": "sdpa (transformers' default), one causal sequence per row",
            "command": f"python3 train.py --config {name}.yaml", "config": config}


# ---------------------------------------------------------------- the 8B-shaped LoRA rows

def lora8b(work: Path, sizes: dict, mode: str, checkpointing: bool = False) -> dict:
    """LoRA on every linear layer but the head of a Llama-3-8B-shaped model from random init, its frozen base stored
    in bf16, trained by train.py; with `checkpointing`, activation checkpointing on. The first of the two rows to run
    writes the tokenizer, the documents and the model (train.py adapts only a model it loads, and nothing can be
    downloaded on the GPU machine)."""
    sizes = LORA_SIZES[mode]  # its own, not the 1B rows' sizes the other stages take
    shared = work / "lora8b_base"
    if not (shared / "model").is_dir():
        write_base(shared, sizes)
    from torch import nn
    from transformers import AutoTokenizer

    model = meta_model(sizes, AutoTokenizer.from_pretrained(shared / "tokenizer"))
    n_matmul = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    # PEFT's all-linear: every nn.Linear but the output head, each adapted by A (r x in) and B (out x r).
    n_lora = sum(LORA["r"] * (module.in_features + module.out_features) for module in model.modules()
                 if isinstance(module, nn.Linear) and module is not model.get_output_embeddings())
    flops_per_token = 4 * n_matmul + 6 * n_lora + 12 * sizes["layers"] * sizes["hidden"] * sizes["seq"]
    log(f"lora8b: N = {n_matmul:,}, {n_lora:,} LoRA parameters; {flops_per_token / 1e9:.2f} GFLOP per token")
    name = "lora8b_gc" if checkpointing else "lora8b"
    settings = {"lora": True, "lora_r": LORA["r"], "lora_alpha": LORA["alpha"], "lora_dropout": LORA["dropout"],
                "lr": LORA["lr"], "gradient_checkpointing": checkpointing}  # lora_target_modules unset: all-linear
    row = train_cli(work, name, sizes, {"model_name": str(shared / "model")}, shared / "tokenizer",
                    shared / "data.jsonl", settings)
    return {**row, "sizes": sizes, "gradient_checkpointing": checkpointing, "n_params_flops": n_matmul,
            "n_lora": n_lora, "flops_per_token": flops_per_token, "flops_formula": LORA_FLOPS_FORMULA}


def lora8b_gc(work: Path, sizes: dict, mode: str) -> dict:
    return lora8b(work, sizes, mode, checkpointing=True)


def write_base(path: Path, sizes: dict) -> None:
    """The LoRA rows' tokenizer and documents, and their base: random weights (seeded) built in bf16 on the GPU
    where there is one (seconds; the host takes a minute or more for 8B weights), saved as a model folder."""
    import torch
    from transformers import AutoModelForCausalLM

    path.mkdir(exist_ok=True)
    tokenizer = write_tokenizer(path / "tokenizer", sizes["vocab"])
    write_documents(path / "data.jsonl", sizes)
    torch.manual_seed(0)
    with torch.device("cuda" if cuda() else "cpu"):
        model = AutoModelForCausalLM.from_config(llama_config(sizes, tokenizer), dtype=torch.bfloat16)
    model.save_pretrained(path / "model")
    log(f"lora8b: base of {sum(p.numel() for p in model.parameters()):,} parameters saved in bf16")
    del model
    if cuda():  # the train.py process that follows needs the card, not this one's cached blocks
        torch.cuda.empty_cache()


def run_streaming(command: list[str]) -> list[str]:
    """Run `command`, echoing its output as it comes; its output lines, or a RuntimeError with its error line."""
    output = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        for line in process.stdout:
            print(line, end="", flush=True)
            output.append(line.rstrip())
    if process.returncode != 0:
        lines = [line for line in output if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        raise RuntimeError(f"exit code {process.returncode}: {(errors or lines or [''])[-1][:300]}")
    return output


def timed(steps: list[tuple[float, float]], warmup: int) -> dict:
    """Throughput over the steps after `warmup`: their tokens summed over their seconds summed."""
    measured = steps[warmup:]
    if not measured:
        raise RuntimeError(f"{len(steps)} steps ran, none after the {warmup} warm-up steps")
    tokens = sum(t for t, _ in measured)
    seconds = sum(s for _, s in measured)
    return {"status": "ok", "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "timed_steps": len(measured), "warmup_steps": warmup, "tokens_per_step": tokens / len(measured),
            "step_seconds_median": statistics.median(s for _, s in measured),
            "step_seconds": [round(s, 4) for _, s in steps]}


# ---------------------------------------------------------------- TRL's SFTTrainer, packed

def trl(work: Path, sizes: dict, mode: str, strategy: str = "bfd") -> dict:
    """TRL's SFTTrainer with packing=True: `bfd` (its default, padding-free) or `wrapped` (fixed rows, like ours)."""
    try:
        import trl as trl_package
    except ImportError:
        return {"status": "skipped" if mode == "dry-run" else "error", "error": "trl not installed"}
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(sizes, tokenizer), dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    lines = (work / "data.jsonl").read_text(encoding="utf-8").splitlines()
    data = Dataset.from_list([json.loads(line) for line in lines])
    args = SFTConfig(output_dir=str(work / "trl"), max_steps=sizes["steps"],
                     per_device_train_batch_size=sizes["micro_batch"],
                     gradient_accumulation_steps=sizes["accumulation"], learning_rate=LR, lr_scheduler_type="cosine",
                     warmup_steps=LR_WARMUP, weight_decay=0.0, max_grad_norm=1.0, bf16=True,
                     gradient_checkpointing=False, packing=True, packing_strategy=strategy, max_length=sizes["seq"], dataset_text_field="text",
                     save_strategy="no", report_to="none", logging_steps=sizes["steps"], disable_tqdm=True, seed=0,
                     use_cpu=not cuda())
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)

    micro_tokens: list[int] = []  # every position of each micro-batch, in the order the trainer drew them
    collate = trainer.data_collator

    def counting_collate(examples):
        batch = collate(examples)
        micro_tokens.append(int(batch["input_ids"].numel()))
        return batch

    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if cuda():  # the step's kernels are done: the clock reads the step, not its launch
                torch.cuda.synchronize()
            step_ends.append(time.perf_counter())
            if state.global_step % 5 == 0 or state.global_step == state.max_steps:
                log(f"trl ({strategy}): step {state.global_step}/{state.max_steps}")

    trainer.data_collator = counting_collate
    trainer.add_callback(StepClock())
    started = time.perf_counter()
    result = trainer.train()
    accumulation = sizes["accumulation"]
    steps = [(sum(micro_tokens[i * accumulation:(i + 1) * accumulation]), end - previous)
             for i, (previous, end) in enumerate(zip([started, *step_ends], step_ends))]
    return {**timed(steps, sizes["warmup"]),
            "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda() else peak_rss_mb(),
            "memory_kind": "torch.cuda.max_memory_allocated" if cuda() else "host peak RSS",
            "train_loss": result.training_loss, "n_params": n_params,
            "attention": model.config._attn_implementation, "padding_free": trainer.padding_free,
            "packing_strategy": args.packing_strategy, "optimizer": getattr(args.optim, "value", str(args.optim)),
            "trl": trl_package.__version__}


def trl_wrapped(work: Path, sizes: dict, mode: str) -> dict:
    return trl(work, sizes, mode, strategy="wrapped")


# ---------------------------------------------------------------- report

def report(work: Path, mode: str, out: Path, budget: int, elapsed: int) -> None:
    hardware_result = load(work, "hardware")
    environment = hardware_result.get("environment", hardware_result)
    matmul = hardware_result.get("matmul", hardware_result)
    spec = load(work, "prepare")
    peak = matmul.get("peak_flops_per_s")
    published = published_peak(environment.get("gpu"))
    rows = {name: load(work, name) for name in ROWS}
    for row in rows.values():
        flops_per_token = row.get("flops_per_token", spec.get("flops_per_token"))
        if row["status"] == "ok" and flops_per_token:
            row["achieved_flops_per_s"] = flops_per_token * row["tokens_per_s"]
            row["mfu"] = mfu(row["achieved_flops_per_s"], peak)
            row["mfu_published"] = mfu(row["achieved_flops_per_s"], published)
    both = rows["ours"]["status"] == rows["trl"]["status"] == "ok"
    wrapped = rows["ours"]["status"] == rows["trl_wrapped"]["status"] == "ok"
    results = {"mode": mode, "budget_s": budget, "elapsed_s": elapsed, "environment": environment,
               "matmul": matmul, "published_peak_flops_per_s": published, "cuda_tests": cuda_tests(work),
               "model": spec, "rows": rows,
               "smollm2": {name: smollm2_table(work, name, peak, published) for name in SMOLLM2_ROWS},
               "ours_over_trl": rows["ours"]["tokens_per_s"] / rows["trl"]["tokens_per_s"] if both else None,
               "ours_over_trl_wrapped": (rows["ours"]["tokens_per_s"] / rows["trl_wrapped"]["tokens_per_s"]
                                         if wrapped else None)}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (out / "results.md").write_text(markdown(results), encoding="utf-8")
    for metrics in sorted(work.glob("*_metrics.jsonl")):
        (out / metrics.name).write_bytes(metrics.read_bytes())
    log(f"results: {out / 'results.json'}, {out / 'results.md'}")


def load(work: Path, stage: str) -> dict:
    """A stage's result; where it wrote none (killed, timed out, crashed before its handler), its exit as an error."""
    path = work / f"{stage}.json"
    if path.is_file():
        return json.loads(path.read_text())
    return {"status": "error", "error": exit_error(work, stage)}


def exit_error(work: Path, stage: str) -> str:
    exit_file = work / f"{stage}.exit"
    if not exit_file.is_file():
        return "not run"
    code, limit = exit_file.read_text().split()
    if limit == "0":
        return "not run: the time budget was spent"
    why = {"124": f"timed out after {limit} s",
           "137": f"killed (past its {limit} s, or out of host memory)"}.get(code, f"exit code {code}")
    log_file = work / f"{stage}.log"
    lines = [line for line in log_file.read_text(errors="replace").splitlines() if line.strip()] \
        if log_file.is_file() else []
    return f"{why}: {lines[-1][:300]}" if lines else why


ROWS = ("ours", "trl", "trl_wrapped", "lora8b", "lora8b_gc")
SMOLLM2_ROWS = ("smollm2_lora", "smollm2_full", "smollm2_lora_gc", "smollm2_full_gc", "smollm2_profile")


def smollm2_table(work: Path, stage: str, peak: float | None, published: float | None) -> dict:
    """A bench/train_throughput.py stage: every run's numbers and the markdown table it prints, and per row the
    median model FLOP/s over the measured seconds with its MFU on both peaks; or why there is none."""
    path = work / f"{stage}.json"
    if not path.is_file():
        return {"status": "error", "error": exit_error(work, stage)}
    import train_throughput

    runs = json.loads(path.read_text())
    variants = [v for v, done in runs.items() if done]
    if not variants:
        return {"status": "error", "error": "no run finished: " + exit_error(work, stage)}
    mfus = {}
    for variant in variants:
        achieved = statistics.median(r["model_flops"] / r["measured_seconds"] for r in runs[variant])
        mfus[variant] = {"label": train_throughput.LABELS[variant], "achieved_flops_per_s": achieved,
                         "mfu": mfu(achieved, peak), "mfu_published": mfu(achieved, published)}
    return {"status": "ok", "runs": runs, "table": train_throughput.table(runs, variants), "mfu": mfus}


def cuda_tests(work: Path) -> dict:
    """pytest's JUnit XML: counts, and each test's outcome with its message."""
    path = work / "cuda_tests.xml"
    if not path.is_file():
        return {"status": "error", "error": exit_error(work, "cuda_tests")}
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    tests = []
    for case in suite.iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("skipped", "failure", "error"):
                outcome, message = child.tag, (child.get("message") or "").strip().split("\n")[0][:300]
        tests.append({"name": case.get("name"), "outcome": outcome, "message": message})
    return {"status": "ok", "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"], "tests": tests}


def markdown(results: dict) -> str:
    env, matmul, spec, rows = results["environment"], results["matmul"], results["model"], results["rows"]
    lines = [f"# GPU benchmark ({results['mode']})", ""]
    if "date" in env:
        lines += [f"{env['date']}; GPU: {env['gpu'] or 'none'} ({env['gpu_memory_gib']} GiB); torch {env['torch']} "
                  f"(CUDA {env['cuda']}), transformers {env['transformers']}, accelerate {env['accelerate']}, trl "
                  f"{env['trl']}, datasets {env['datasets']}, pyarrow {env['pyarrow']}, flash_attn "
                  f"{env['flash_attn'] or 'not installed'}; {env['cpu_count']} CPUs. Wall time "
                  f"{results['elapsed_s']} s of a {results['budget_s']} s budget.", ""]
    else:
        lines += [f"environment: {env['error']}", ""]
    lines += ["## bf16 matmul peak (the MFU denominator)", ""]
    if matmul["status"] == "ok":
        lines += ["| product | m x k x n | TFLOP/s |", "|---|---|---|"]
        lines += [f"| {s['name']} | {s['m']} x {s['k']} x {s['n']} | {s['flops_per_s'] / 1e12:.4g} |"
                  for s in matmul["shapes"]]
        lines += ["", f"Peak: **{matmul['peak_flops_per_s'] / 1e12:.4g} TFLOP/s** (the square product). "
                      f"{matmul['method']}.", ""]
    else:
        lines += [f"error: {matmul['error']}", ""]
    published = results["published_peak_flops_per_s"]
    lines += ["Published dense bf16 peak of this GPU (bench/gpu_peaks.py, the yardstick other trainers divide by): "
              + (f"**{published / 1e12:.4g} TFLOP/s**." if published else "not known for this device; the MFU "
                 "column against it is -."), ""]
    tests = results["cuda_tests"]
    lines += ["## CUDA tests (tests/test_cuda.py)", ""]
    if tests["status"] == "ok":
        lines += [f"{tests['passed']} passed, {tests['failed']} failed, {tests['errors']} errors, "
                  f"{tests['skipped']} skipped", ""]
        lines += [f"- {t['name']}: {t['outcome']}" + (f" ({t['message']})" if t["message"] else "")
                  for t in tests["tests"]]
        lines.append("")
    else:
        lines += [f"error: {tests['error']}", ""]
    lines += ["## Training throughput", ""]
    if spec["status"] == "ok":
        s = spec["sizes"]
        lines += [
            f"Model: Llama from random init, hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads "
            f"({s['kv_heads']} KV heads, head dim {s['hidden'] // s['heads']}), MLP {s['intermediate']}, vocab "
            f"{spec['vocab']}, untied embeddings: {spec['n_params']:,} parameters. Full fine-tuning with AdamW, bf16 "
            f"autocast over fp32 weights, no gradient checkpointing.",
            f"Data: {spec['documents']} synthetic documents of random words ({spec['tokens']:,} tokens, "
            f"{s['seq'] // 8}-{s['seq'] // 2} each, one token per word), max_length {s['seq']}; "
            f"{s['micro_batch'] * s['accumulation']} rows per optimizer step (micro-batch {s['micro_batch']} x "
            f"accumulation {s['accumulation']}); {s['steps']} steps, the first {s['warmup']} untimed.",
            f"Model FLOPs per token = {spec['flops_formula']} = {spec['flops_per_token']:,} "
            f"(N = {spec['n_params_flops']:,}: every parameter but the input embedding table, a lookup without "
            f"FLOPs; the attention term counts the full seq x seq score and value products, causal or not).",
            "Tokens/s = the timed steps' tokens (every position the model ran; neither row pads) summed over their "
            "seconds summed. "
            "MFU = FLOPs per token x tokens/s / the measured matmul peak; MFU (published) the same over the "
            "published dense bf16 peak.", ""]
    else:
        lines += [f"prepare: {spec['error']}", ""]
    lora = rows["lora8b"] if rows["lora8b"]["status"] == "ok" else rows["lora8b_gc"]
    if lora["status"] == "ok":
        s = lora["sizes"]
        lines += [f"LoRA rows: a Llama from random init, Llama-3-8B's shapes in the full run (hidden {s['hidden']}, "
                  f"{s['layers']} layers, {s['heads']} heads, {s['kv_heads']} KV heads, MLP {s['intermediate']}, "
                  f"vocab {s['vocab']}, untied), its frozen base stored in bf16, LoRA r={LORA['r']} alpha "
                  f"{LORA['alpha']} on every linear layer but the head ({lora['n_lora']:,} parameters); rows of "
                  f"{s['seq']} tokens, "
                  f"{s['micro_batch'] * s['accumulation']} rows per step; {s['steps']} steps, the first "
                  f"{s['warmup']} untimed. FLOPs per token = {lora['flops_formula']} = {lora['flops_per_token']:,} "
                  f"(N = {lora['n_params_flops']:,}); checkpointing's recomputed forward is not counted.", ""]
    lines += ["| row | tokens/s | tokens / seconds (timed steps) | tokens per step | median step s | peak MiB | "
              "achieved TFLOP/s | MFU | MFU (published) |", "|---|---|---|---|---|---|---|---|---|"]
    names = {"ours": "ours (train.py, causal_lm rows)", "trl": "TRL SFTTrainer, packing=True (bfd, its default)",
             "trl_wrapped": "TRL SFTTrainer, packing=True, packing_strategy wrapped",
             "lora8b": "8B-shaped LoRA (train.py)", "lora8b_gc": "8B-shaped LoRA + activation checkpointing"}
    for name, row in rows.items():
        if row["status"] != "ok":
            lines.append(f"| {names[name]} | {row['status']}: {row['error']} | | | | | | | |")
            continue
        achieved = f"{row['achieved_flops_per_s'] / 1e12:.4g}" if "achieved_flops_per_s" in row else "-"
        lines.append(f"| {names[name]} | **{row['tokens_per_s']:,.0f}** | {row['tokens']:,.0f} / "
                     f"{row['seconds']:.2f} ({row['timed_steps']} steps) | {row['tokens_per_step']:,.0f} | "
                     f"{row['step_seconds_median']:.3f} | {row['peak_memory_mb']:,.0f} ({row['memory_kind']}) | "
                     f"{achieved} | {percent(row.get('mfu'))} | {percent(row.get('mfu_published'))} |")
    if results["ours_over_trl"] is not None:
        lines += ["", f"ours / TRL (bfd): **{results['ours_over_trl']:.2f}x** tokens/s."]
    if results["ours_over_trl_wrapped"] is not None:
        lines += ["", f"ours / TRL (wrapped rows, the same layout as ours): **{results['ours_over_trl_wrapped']:.2f}x** "
                      f"tokens/s."]
    trl_row = rows["trl"]
    if trl_row["status"] == "ok":
        lines += ["", f"TRL {trl_row['trl']}: packing_strategy {trl_row['packing_strategy']}, padding_free "
                      f"{trl_row['padding_free']} (each micro-batch one flattened sequence, documents told apart by "
                      f"restarting position ids), attention {trl_row['attention']}, optimizer {trl_row['optimizer']}"
                      f"{SDPA_PACKING if trl_row['attention'] == 'sdpa' else ''}. "
                      f"Ours: attention {rows['ours'].get('attention', '-')}, optimizer torch.optim.AdamW with its "
                      f"defaults; documents joined with EOS and cut into rows, attention crossing document boundaries "
                      f"inside a row (causal_lm, as in pretraining)."]
    lines += ["", "## bench/train_throughput.py rows", "",
              "SmolLM2-135M's shapes with random weights; the dry run: the tiny GPT-J.", ""]
    for name, table in results["smollm2"].items():
        if table["status"] != "ok":
            lines += [f"### {name}", "", f"{table['status']}: {table['error']}", ""]
            continue
        lines += [f"### {name}", "", table["table"], "", "| run | model TFLOP/s (median) | MFU | MFU (published) |",
                  "|---|---|---|---|"]
        lines += [f"| {m['label']} | {m['achieved_flops_per_s'] / 1e12:.4g} | {percent(m['mfu'])} | "
                  f"{percent(m['mfu_published'])} |" for m in table["mfu"].values()]
        lines.append("")
    return "\n".join(lines) + "\n"


def percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


STAGES = {"hardware": hardware, "prepare": prepare, "ours": ours, "trl": trl, "trl_wrapped": trl_wrapped,
          "lora8b": lora8b, "lora8b_gc": lora8b_gc}


def main() -> None:
    stage, work, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    if stage == "report":
        report(work, mode, Path(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
        return
    try:
        result = STAGES[stage](work, SIZES[mode], mode)
    except Exception as exc:
        traceback.print_exc()
        result = {"status": "error", "error": one_line(exc)}
    (work / f"{stage}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    log(f"{stage}: {result['status']}" + (f" ({result['error']})" if "error" in result else ""))


if __name__ == "__main__":
    main()
PY

if ((qlora)); then
  size=8b
  ((dry_run)) && size=dry-run
  say "QLoRA GPU benchmark, $size: results in $out, budget ${budget} s"
  for row in prepare ours trl; do
    stage "qlora_$row" 240 "$python" bench/qlora.py --gpu-row $row --size $size --work "$work"
    [[ -f $work/qlora_$row.json ]] && cp "$work/qlora_$row.json" "$out/"
  done
  say "done in $SECONDS s"
  exit 0
fi
# smollm2 ROW: bench/train_throughput.py's SmolLM2 stage ROW (lora, full, lora_gc, full_gc); the dry run runs the
# lora one on the tiny GPT-J.
smollm2() {
  local row=$1 model=smollm2 variants=ours-packed,trl-packed
  if ((dry_run)); then
    [[ $row == lora ]] || return 0
    stage smollm2_lora 150 "$python" bench/train_throughput.py --model tiny-gptj --steps 3 --repeats 1 \
      --variants $variants --json "$work/smollm2_lora.json"
    return
  fi
  [[ $row == full* ]] && model=smollm2-full
  [[ $row == *_gc ]] && variants=ours-packed-gc,trl-packed-gc
  stage "smollm2_$row" 120 "$python" bench/train_throughput.py --model $model --init random --scale 8 \
    --repeats 3 --variants $variants --json "$work/smollm2_$row.json"
}

say "GPU benchmark, $mode: results in $out, budget ${budget} s"
# The most important rows first: the budget cuts the last ones. Estimates on one H100 (989 TFLOP/s dense bf16 at
# the MFU measured on the H200) in the header above.
stage hardware 90 "$python" "$work/bench.py" hardware "$work" "$mode"
stage cuda_tests 120 "$python" -m pytest -q -p no:cacheprovider --junitxml="$work/cuda_tests.xml" tests/test_cuda.py
stage prepare 90 "$python" "$work/bench.py" prepare "$work" "$mode"
stage ours 210 "$python" "$work/bench.py" ours "$work" "$mode"
stage lora8b 150 "$python" "$work/bench.py" lora8b "$work" "$mode"
stage lora8b_gc 150 "$python" "$work/bench.py" lora8b_gc "$work" "$mode"
smollm2 lora
stage trl_wrapped 150 "$python" "$work/bench.py" trl_wrapped "$work" "$mode"
smollm2 full
if ((!dry_run)); then
  # Where the time goes on the GPU: the LoRA row profiled (its speeds are the profiler's, not the row's).
  stage smollm2_profile 120 "$python" bench/train_throughput.py --model smollm2 --init random --scale 8 --steps 6 \
    --repeats 1 --variants ours-packed,trl-packed,plain --profile --skip-eval --json "$work/smollm2_profile.json"
fi
stage trl 150 "$python" "$work/bench.py" trl "$work" "$mode"
smollm2 lora_gc
smollm2 full_gc
"$python" "$work/bench.py" report "$work" "$mode" "$out" "$budget" "$SECONDS" 2>&1 | tee -a "$log"
say "done in $SECONDS s"
