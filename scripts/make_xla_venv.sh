#!/usr/bin/env bash
# Build .venv-xla for the XLA tests (tests/xla/, PJRT_DEVICE=CPU): torch 2.9.0 with torch_xla 2.9.0, which only
# import next to each other, plus the rest of requirements.txt. It is kept apart from .venv because accelerate
# switches itself into XLA mode as soon as torch_xla is importable. PyPI's torch 2.9.0 is the CUDA build: about
# 4.2 GB of downloads the first time (cached by uv afterwards) and a 7 GB venv. Installed with uv, as the Makefile
# installs .venv (the same version, byte-compiled the same way). Idempotent: a stamp file newer than the requirements
# and this script means the venv is complete.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${XLA_VENV:-.venv-xla}
STAMP="$VENV/.installed"
if [[ -f $STAMP && $STAMP -nt requirements.txt && $STAMP -nt requirements-dev.txt && $STAMP -nt $0 ]]; then
    exit 0
fi
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "uv==$(sed -n 's/^UV_VERSION := //p' Makefile)"
# --compile-bytecode: see the Makefile (where PYTHONDONTWRITEBYTECODE is set, every process would compile from source).
INSTALL=("$VENV/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python")
# requirements.txt without torch (pinned below to the release torch_xla needs) and deepspeed (no XLA support).
grep -v -E '^(torch|deepspeed)==' requirements.txt > "$VENV/requirements-xla.txt"
"${INSTALL[@]}" torch==2.9.0 torch_xla==2.9.0 -r "$VENV/requirements-xla.txt" -r requirements-dev.txt
"${INSTALL[@]}" --no-deps -e .
touch "$STAMP"
