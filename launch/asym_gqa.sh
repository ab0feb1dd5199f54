#!/usr/bin/env bash
# AsymGQA (seed 004): activation-informed grouping with unequal group sizes, then mean-pooling to it and continued
# pre-training, as the GQA baseline does with contiguous groups.
#   launch/asym_gqa.sh <mha_hf_dir> <kv_heads> <data_root> <save_root> [nproc] [recipe] [key=value ...]
# e.g. launch/asym_gqa.sh /models/Llama-2-7b-hf 8 /data/rp-llama2-4096 /checkpoints
# 1. `dha-train search --method asym` (options through SEARCH_ARGS; default: 16384 calibration tokens, the LM-loss
#    fitness, 50 fitness calls per layer) -> <save_root>/<name>-search/head_map.json, K and V sharing one map whose
#    groups may differ in size;
# 2. launch/gqa_baseline.sh with HEAD_MAP set: mean-pool to that map (the DHA model class serves unequal groups),
#    then CT with the recipe (default yamls/asym_gqa/llama2-7b/ct.yaml), <name> = <model folder name>-asym<kv_heads>.
# Export afterwards: dha-train export <save_root>/<name>-ct <save_root>/<name>-ct/hf (trust_remote_code=True).
# Re-running resumes: the search and the conversion are skipped when their outputs exist, and CT autoresumes.
set -euo pipefail
if [[ $# -lt 4 ]]; then
  echo "usage: $0 <mha_hf_dir> <kv_heads> <data_root> <save_root> [nproc] [recipe] [key=value ...]" >&2
  exit 2
fi
MODEL=$1; KV_HEADS=$2; DATA=$3; SAVE=$4
NAME=${ASYM_NAME:-$(basename "$MODEL")-asym$KV_HEADS}
read -r -a SEARCH <<< "${SEARCH_ARGS:---tokens 16384 --fitness loss --iterations 50}"
if [[ ! -f "$SAVE/$NAME-search/head_map.json" ]]; then
  ${DHA_TRAIN:-dha-train} search "$MODEL" "$SAVE/$NAME-search" --method asym --kv-heads "$KV_HEADS" --data "$DATA" \
    "${SEARCH[@]}" --overwrite
fi
if [[ $# -lt 6 ]]; then  # the AsymGQA CT recipe unless one is given
  set -- "$1" "$2" "$3" "$4" "${5:-8}" yamls/asym_gqa/llama2-7b/ct.yaml
fi
HEAD_MAP="$SAVE/$NAME-search/head_map.json" GQA_NAME="$NAME" exec "$(dirname "$0")/gqa_baseline.sh" "$@"
