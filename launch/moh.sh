#!/usr/bin/env bash
# MoH continue-tuning of an MHA (or GQA) LLaMA, then export:
#   launch/moh.sh <llama_hf_dir> <data_root> <save_root> [nproc] [recipe] [key=value ...]
# e.g. launch/moh.sh /models/Meta-Llama-3-8B /data/rp-llama3-8192 /checkpoints 8 yamls/moh/llama3-8b-continue.yaml
# The recipe's mixture_of_heads algorithm does the surgery at start-up, so there is no separate conversion stage.
# Re-running resumes (autoresume); the export runs once the run has finished and is skipped when it exists.
# MOH_NAME overrides the run name (default <model folder name>-moh).
set -euo pipefail
if [[ $# -lt 3 ]]; then
  echo "usage: $0 <llama_hf_dir> <data_root> <save_root> [nproc] [recipe] [key=value ...]" >&2
  exit 2
fi
MODEL=$1; DATA=$2; SAVE=$3
NPROC=${4:-8}
RECIPE=${5:-yamls/moh/llama3-8b-continue.yaml}
shift $(( $# < 5 ? $# : 5 ))
die() { echo "$0: $*" >&2; exit 2; }
[[ -f "$MODEL/config.json" ]] || die "$MODEL is not a HF model folder (no config.json)"
[[ -f "$RECIPE" ]] || die "recipe $RECIPE not found"
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die "nproc must be a positive integer, got $NPROC"
NAME=${MOH_NAME:-$(basename "$MODEL")-moh}
${COMPOSER:-composer} -n "$NPROC" -m dha_train.train "$RECIPE" \
  variables.model_path="$MODEL" variables.data_root="$DATA" variables.save_root="$SAVE" run_name="$NAME" "$@"
if [[ ! -f "$SAVE/$NAME/hf/config.json" ]]; then
  ${DHA_TRAIN:-dha-train} export "$SAVE/$NAME" "$SAVE/$NAME/hf"
fi
