#!/usr/bin/env bash
# Healing chain for any converted model (mean-pool / aligned GQA, AsymGQA, DHA, MLA in either format; not MoH):
# closed-form refit to the source (done by the conversion itself for DeepSeek's format), layer-wise attention
# transfer, end-to-end KL distillation, then optional continued pre-training.
#   launch/heal.sh <source_hf> <converted_hf> <data_root> <save_root> [nproc] [transfer_recipe] [kl_recipe] [key=value ...]
# key=value overrides go to every training stage. HEAL_NAME names the runs (default <converted folder name>);
# REFIT_ARGS adds refit options (e.g. "--tokens 65536 --device cuda"); CT_RECIPE, when set, runs CT after KL.
# Re-running resumes at any stage: a stage whose exported folder exists is skipped, a killed training stage
# autoresumes from its last checkpoint, and the finished run is exported once.
set -euo pipefail
if [[ $# -lt 4 ]]; then
  echo "usage: $0 <source_hf> <converted_hf> <data_root> <save_root> [nproc] [transfer_recipe] [kl_recipe] [key=value ...]" >&2
  exit 2
fi
SOURCE=$1; CONVERTED=$2; DATA=$3; SAVE=$4
NPROC=${5:-8}
TRANSFER_RECIPE=${6:-yamls/healing/tiny_transfer.yaml}
KL_RECIPE=${7:-yamls/healing/tiny_kl.yaml}
shift $(( $# < 7 ? $# : 7 ))
NAME=${HEAL_NAME:-$(basename "$CONVERTED")}
DHA=${DHA_TRAIN:-dha-train}
COMPOSER_CMD=${COMPOSER:-composer}

REFIT="$SAVE/$NAME-refit"
if grep -q '"model_type": *"deepseek_v3"' "$CONVERTED/config.json" 2>/dev/null; then
  # `refit` has no DeepSeek-format fit: `convert --format deepseek` regresses kv_b_proj on the normed latent itself.
  if [[ -n "${REFIT_ARGS:-}" ]]; then
    echo "heal: REFIT_ARGS does not apply to $CONVERTED: a DeepSeek-format folder has no refit stage (its conversion" \
         "is the refit; give convert more --tokens instead)" >&2
    exit 2
  fi
  echo "heal: $CONVERTED is in DeepSeek's MLA format, whose conversion fits kv_b_proj in closed form" \
       "(--latent-norm-fit regression, the default); attention transfer starts from it, with no refit stage"
  REFIT="$CONVERTED"
elif [[ ! -f "$REFIT/config.json" ]]; then
  # shellcheck disable=SC2086
  $DHA refit "$SOURCE" "$CONVERTED" "$REFIT" --data "$DATA" ${REFIT_ARGS:-}
fi

# stage <name> <recipe> <model>: train (autoresume) then export to $SAVE/$NAME-<name>-hf, unless that exists
stage() {
  local name=$1 recipe=$2 model=$3
  local out="$SAVE/$NAME-$name-hf"
  if [[ ! -f "$out/config.json" ]]; then
    # shellcheck disable=SC2086
    $COMPOSER_CMD -n "$NPROC" -m dha_train.train "$recipe" \
      variables.model_path="$model" variables.source_path="$SOURCE" variables.data_root="$DATA" \
      variables.save_root="$SAVE" run_name="$NAME-$name" "${OVERRIDES[@]}"
    $DHA export "$SAVE/$NAME-$name" "$out" --start "$model"  # the start may lie outside $SAVE (a converted folder)
  fi
  LAST=$out
}

OVERRIDES=("$@")
stage transfer "$TRANSFER_RECIPE" "$REFIT"
stage kl "$KL_RECIPE" "$LAST"
if [[ -n "${CT_RECIPE:-}" ]]; then
  $COMPOSER_CMD -n "$NPROC" -m dha_train.train "$CT_RECIPE" \
    variables.model_path="$LAST" variables.data_root="$DATA" variables.save_root="$SAVE" run_name="$NAME-ct" \
    "${OVERRIDES[@]}"
fi
echo "heal: $LAST"
