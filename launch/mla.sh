#!/usr/bin/env bash
# MLA in two stages: convert an MHA or GQA checkpoint to multi-head latent attention, then continued pre-training.
#   launch/mla.sh <hf_dir> <cache_fraction> <data_root> <save_root> [nproc] [recipe] [key=value ...]
# The conversion calibrates on <data_root>; MLA_ARGS adds conversion options (e.g. "--rope-pairs 4 --device cuda").
# Re-running resumes: the conversion is skipped when its output exists, and CT autoresumes. MLA_NAME overrides the
# run name (default <model folder name>-mla<cache_fraction>).
set -euo pipefail
if [[ $# -lt 4 ]]; then
  echo "usage: $0 <hf_dir> <cache_fraction> <data_root> <save_root> [nproc] [recipe] [key=value ...]" >&2
  exit 2
fi
MODEL=$1; FRACTION=$2; DATA=$3; SAVE=$4
NPROC=${5:-8}
RECIPE=${6:-yamls/mla/llama2_7b_ct.yaml}
shift $(( $# < 6 ? $# : 6 ))
NAME=${MLA_NAME:-$(basename "$MODEL")-mla${FRACTION}}
INIT="$SAVE/$NAME-init"
if [[ ! -f "$INIT/config.json" ]]; then
  # shellcheck disable=SC2086
  ${DHA_TRAIN:-dha-train} convert "$MODEL" "$INIT" --method mla --cache-fraction "$FRACTION" --data "$DATA" \
    ${MLA_ARGS:-}
fi
exec ${COMPOSER:-composer} -n "$NPROC" -m dha_train.train "$RECIPE" \
  variables.model_path="$INIT" variables.data_root="$DATA" variables.save_root="$SAVE" \
  run_name="$NAME-ct" "$@"
