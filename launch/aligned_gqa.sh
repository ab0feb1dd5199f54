#!/usr/bin/env bash
# Aligned GQA end to end (seed 001): align (calibrate, Procrustes similarity, grouping, alignment folded into the
# weights, heads made contiguous) -> pruning training with L0 gates and distillation -> export as standard HF GQA.
#   launch/aligned_gqa.sh <mha_hf_dir> <recipe_dir> <data_root> <save_root> <num_groups> [nproc] [key=value ...]
# e.g. launch/aligned_gqa.sh /models/Llama-2-7b-hf yamls/aligned_gqa/llama2-7b /data/rp-llama2-2048 /checkpoints 8
#      launch/aligned_gqa.sh quickstart_run/export/hf yamls/aligned_gqa/tiny quickstart_run/data runs 2 2
# <recipe_dir> holds prune.yaml. Every stage writes under <save_root>/<name>-<stage>, name = $AGQA_NAME or
# <model folder name>-agqa<num_groups>:
#   <name>-aligned      the aligned MHA model (same function as the input), target_head_map.json, alignment.json
#   <name>-prune/hf     the GQA model (LlamaForCausalLM, num_key_value_heads = num_groups)
# ALIGN_ARGS passes options to `dha-train align` (default: --criterion cos --group-by value --tokens 262144; on a
# GPU add --device cuda). Re-running resumes: a stage whose output exists is skipped, a cut-short pruning run
# autoresumes. Extra key=value overrides apply to the pruning run.
set -euo pipefail
source "$(dirname "$0")/chain_args.sh"
parse_chain_args num_groups "$@"
NUM_GROUPS=$TARGET
need_recipes prune
[[ "$NUM_GROUPS" =~ ^[1-9][0-9]*$ ]] || die "num_groups must be a positive integer, got $NUM_GROUPS"
NAME=${AGQA_NAME:-$(basename "$MODEL")-agqa$NUM_GROUPS}
COMPOSER=${COMPOSER:-composer}
DHA_TRAIN=${DHA_TRAIN:-dha-train}
read -r -a ALIGN <<< "${ALIGN_ARGS:---criterion cos --group-by value --tokens 262144}"

say() { echo "[aligned_gqa] $*"; }

if [[ -f "$SAVE/$NAME-aligned/alignment.json" ]]; then
  say "align: done ($SAVE/$NAME-aligned)"
else
  say "align: $NAME, GQA-$NUM_GROUPS"
  $DHA_TRAIN align "$MODEL" "$SAVE/$NAME-aligned" --num-groups "$NUM_GROUPS" --data "$DATA" "${ALIGN[@]}" --overwrite
fi

if [[ -f "$SAVE/$NAME-prune/hf/config.json" ]]; then
  say "prune: done ($SAVE/$NAME-prune/hf)"
else
  say "prune"
  $COMPOSER -n "$NPROC" -m dha_train.train "$RECIPES/prune.yaml" variables.model_path="$SAVE/$NAME-aligned" \
    variables.teacher_path="$MODEL" variables.num_groups="$NUM_GROUPS" variables.data_root="$DATA" \
    variables.save_root="$SAVE" variables.name="$NAME" "${EXTRA[@]}"
  $DHA_TRAIN export "$SAVE/$NAME-prune" "$SAVE/$NAME-prune/hf" --overwrite
fi
say "done: $SAVE/$NAME-prune/hf (standard HF GQA, $NUM_GROUPS K/V heads per layer)"
