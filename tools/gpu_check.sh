#!/usr/bin/env bash
# The GPU check (docs/developing.md, "GPU check"): on a lent GPU machine, from the repository root, after tools/gpu_wheels.sh
# here and .whl/ carried there. Installs the carried wheels without their dependencies (the image keeps its torch
# 2.11), puts the GGUF parts back together and runs tools/gpu_check.py, which writes $OUT/gpu_check.{json,md}.
#   tools/gpu_check.sh [--minutes 25] [other tools/gpu_check.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
if ls .whl/wheels/*.whl >/dev/null 2>&1; then
  # Into a folder of their own, first on the path: the image's transformers 5.x and tokenizers stay installed.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/wheels/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
source_args=()
if ls .whl/gguf/smollm2-135m.gguf.part* >/dev/null 2>&1; then
  cat .whl/gguf/smollm2-135m.gguf.part* > .whl/smollm2-135m.gguf
  source_args=(--source .whl/smollm2-135m.gguf)
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 tools/gpu_check.py --out "$OUT" "${source_args[@]}" "$@"
