#!/usr/bin/env bash
# One node, all its GPUs:  launch/single_node.sh <recipe.yaml> [key=value ...]
# NPROC overrides the process count (default: the number of visible GPUs).
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 <recipe.yaml> [key=value ...]" >&2
  exit 2
fi
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
if [[ "$NPROC" -lt 1 ]]; then
  echo "no GPU visible; set NPROC to run on CPU processes" >&2
  exit 2
fi
exec ${COMPOSER:-composer} -n "$NPROC" -m dha_train.train "$@"
