#!/usr/bin/env bash
# The GQA baseline in two stages: mean-pool an MHA checkpoint, then continued pre-training.
#   launch/gqa_baseline.sh <mha_hf_dir> <kv_heads> <data_root> <save_root> [nproc] [recipe] [key=value ...]
# Re-running resumes: the conversion is skipped when its output exists, and CT autoresumes.
# HEAD_MAP=<head_map.json> mean-pools to that map instead of contiguous groups (launch/asym_gqa.sh uses it), and
# GQA_NAME overrides the run name (default <model folder name>-gqa<kv_heads>).
set -euo pipefail
if [[ $# -lt 4 ]]; then
  echo "usage: $0 <mha_hf_dir> <kv_heads> <data_root> <save_root> [nproc] [recipe] [key=value ...]" >&2
  exit 2
fi
MODEL=$1; KV_HEADS=$2; DATA=$3; SAVE=$4
NPROC=${5:-8}
RECIPE=${6:-yamls/gqa/llama2_7b_ct.yaml}
shift $(( $# < 6 ? $# : 6 ))
NAME=${GQA_NAME:-$(basename "$MODEL")-gqa${KV_HEADS}}
INIT="$SAVE/$NAME-init"
if [[ ! -f "$INIT/head_map.json" ]]; then
  if [[ -n "${HEAD_MAP:-}" ]]; then
    ${DHA_TRAIN:-dha-train} convert "$MODEL" "$INIT" --head-map "$HEAD_MAP"
  else
    ${DHA_TRAIN:-dha-train} convert "$MODEL" "$INIT" --kv-heads "$KV_HEADS"
  fi
fi
exec ${COMPOSER:-composer} -n "$NPROC" -m dha_train.train "$RECIPE" \
  variables.model_path="$INIT" variables.data_root="$DATA" variables.save_root="$SAVE" \
  run_name="$NAME-ct" "$@"
