#!/usr/bin/env bash
# Runs once per node under srun: turns SLURM's environment into composer's multi-node flags.
#   world size = nodes x GPUs per node, node rank = SLURM_NODEID, master = the job's first host.
set -euo pipefail
: "${SLURM_JOB_NODELIST:?run this under srun (see launch/slurm_multinode.sbatch)}"
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:?SLURM_NNODES is not set}}
NODE_RANK=${SLURM_NODEID:?SLURM_NODEID is not set}
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
# A port derived from the job id, so two jobs sharing a node do not collide.
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))
exec ${COMPOSER:-composer} --world_size "$WORLD_SIZE" --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" -n "$GPUS_PER_NODE" \
  -m dha_train.train "$@"
