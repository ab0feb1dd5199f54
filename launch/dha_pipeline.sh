#!/usr/bin/env bash
# DHA end to end (seed 000): Search -> Fusion -> export (bake) -> continued pre-training -> export.
#   launch/dha_pipeline.sh <mha_hf_dir> <recipe_dir> <data_root> <save_root> <kv_budget> [nproc] [key=value ...]
# e.g. launch/dha_pipeline.sh /models/Llama-2-7b-hf yamls/dha/llama2-7b /data/rp-llama2-4096 /checkpoints 0.25
#      launch/dha_pipeline.sh quickstart_run/export/hf yamls/dha/tiny quickstart_run/data runs 0.25 2
# <recipe_dir> holds search.yaml, fusion.yaml and ct.yaml. Every stage writes under <save_root>/<name>-<stage>,
# name = $DHA_NAME or <model folder name>-dha<budget %>; each stage reads the previous stage's output from there:
#   <name>-search/search/head_map.json   the Search's grouping and per-layer K/V budget
#   <name>-fusion/hf                     the baked DHA model after fusion
#   <name>-ct/hf                         the final DHA model (loads with trust_remote_code=True)
# Re-running resumes: a stage whose output exists is skipped, and a stage cut short autoresumes from its last
# checkpoint. Extra key=value overrides apply to every stage (loggers, batch sizes, ...).
set -euo pipefail
source "$(dirname "$0")/chain_args.sh"
parse_chain_args kv_budget "$@"
BUDGET=$TARGET
need_recipes search fusion ct
PERCENT=$(awk -v b="$BUDGET" 'BEGIN { if (b <= 0 || b > 1) exit 1; printf "%d", b * 100 + 0.5 }') \
  || die "kv_budget must be a fraction in (0, 1], got $BUDGET"
NAME=${DHA_NAME:-$(basename "$MODEL")-dha$PERCENT}
COMPOSER=${COMPOSER:-composer}
DHA_TRAIN=${DHA_TRAIN:-dha-train}
COMMON=(variables.data_root="$DATA" variables.save_root="$SAVE" variables.name="$NAME")

say() { echo "[dha_pipeline] $*"; }

if [[ -f "$SAVE/$NAME-search/search/head_map.json" ]]; then
  say "search: done ($SAVE/$NAME-search/search/head_map.json)"
else
  say "search: $NAME at a $BUDGET K+V budget"
  $COMPOSER -n "$NPROC" -m dha_train.train "$RECIPES/search.yaml" variables.model_path="$MODEL" \
    variables.kv_budget="$BUDGET" "${COMMON[@]}" "${EXTRA[@]}"
fi

if [[ -f "$SAVE/$NAME-fusion/hf/config.json" ]]; then
  say "fusion: done ($SAVE/$NAME-fusion/hf)"
else
  say "fusion"
  $COMPOSER -n "$NPROC" -m dha_train.train "$RECIPES/fusion.yaml" variables.model_path="$MODEL" "${COMMON[@]}" "${EXTRA[@]}"
  # --start: the source may lie outside <save_root>, and an export follows a run's recorded start only inside it
  $DHA_TRAIN export "$SAVE/$NAME-fusion" "$SAVE/$NAME-fusion/hf" --overwrite --start "$MODEL"
fi

if [[ -f "$SAVE/$NAME-ct/hf/config.json" ]]; then
  say "ct: done ($SAVE/$NAME-ct/hf)"
else
  say "continued pre-training"
  $COMPOSER -n "$NPROC" -m dha_train.train "$RECIPES/ct.yaml" "${COMMON[@]}" "${EXTRA[@]}"
  $DHA_TRAIN export "$SAVE/$NAME-ct" "$SAVE/$NAME-ct/hf" --overwrite
fi
say "finished: $SAVE/$NAME-ct/hf"
