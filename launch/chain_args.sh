# Sourced by the chain launchers (dha_pipeline.sh, aligned_gqa.sh): their common arguments,
#   <mha_hf_dir> <recipe_dir> <data_root> <save_root> <target> [nproc] [key=value ...]
# checked before anything runs. Sets MODEL RECIPES DATA SAVE TARGET NPROC and EXTRA (the overrides).
die() { echo "$0: $*" >&2; exit 2; }

parse_chain_args() {  # parse_chain_args <name of the target argument> "$@"
  local target_name=$1; shift
  [[ $# -ge 5 ]] || die "usage: $0 <mha_hf_dir> <recipe_dir> <data_root> <save_root> <$target_name> [nproc] [key=value ...]"
  MODEL=$1; RECIPES=$2; DATA=$3; SAVE=$4; TARGET=$5; NPROC=${6:-8}
  shift $(( $# < 6 ? $# : 6 ))
  EXTRA=("$@")
  [[ -f "$MODEL/config.json" ]] || die "$MODEL is not a HF model folder (no config.json)"
}

need_recipes() {  # need_recipes <stage> ...: $RECIPES/<stage>.yaml must exist
  local stage
  for stage in "$@"; do [[ -f "$RECIPES/$stage.yaml" ]] || die "$RECIPES/$stage.yaml not found"; done
}
