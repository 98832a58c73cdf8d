#!/usr/bin/env bash
# Compile the DeepSpeed ops that training on the CPU loads (CPU Adam, the shared-memory allreduce) into
# TORCH_EXTENSIONS_DIR, the two side by side, with the given Python (default .venv/bin/python). Idempotent: an op
# already built there loads in a second.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${1:-.venv/bin/python}
build() {
    "$python" -c "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('$1').load()"
}
build CPUAdamBuilder & adam=$!
build ShareMemCommBuilder & shm=$!
status=0
wait "$adam" || status=$?
wait "$shm" || status=$?
exit "$status"
