#!/usr/bin/env bash
# Validation only, on the weights of one checkpoint: the same Ray bring-up and teardown as
# launch/slurm_ray.sh, then `megarl validate` resuming from CHECKPOINT_DIR.
#
#   sbatch launch/slurm_validate.sh CONFIG CHECKPOINT_DIR [key=value overrides...]
#
# CHECKPOINT_DIR is a step directory (`.../global_step_<k>`, the state after k completed steps,
# holding driver_state.json and the actor's Megatron checkpoint) or a run directory holding
# latest_checkpointed_iteration.txt, which then names the step. The run sets
# trainer.resume_mode=resume_path and trainer.resume_from_path to it: the engines serve that
# checkpoint's weights (logged as "validation of weights v<k>: val/..."; v<k+1> for a
# checkpoint written before megarl named them by completed steps) and nothing is trained or
# saved.
# #SBATCH defaults, environment and exit status: as launch/slurm_ray.sh.
#
#SBATCH --job-name=megarl-validate
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=01:00:00
#SBATCH --output=megarl-%x-%j.out
set -euo pipefail

MEGARL_LAUNCHER=slurm_validate
if [ $# -lt 2 ] || [ "${1:0:1}" = - ]; then
    echo "usage: sbatch $0 CONFIG CHECKPOINT_DIR [key=value overrides...]" >&2
    exit 2
fi
_cmd=$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
MEGARL_HOME=${MEGARL_HOME:-$(cd "$(dirname "${_cmd:-$0}")/.." && pwd)}
# shellcheck source=launch/_ray_cluster.sh
. "$MEGARL_HOME/launch/_ray_cluster.sh"
megarl_require_slurm

CONFIG=$1 CKPT=$2; shift 2
[ -f "$CONFIG" ] || _megarl_die 2 "CONFIG $CONFIG: no such file (relative to $PWD)"
[ -d "$CKPT" ] || _megarl_die 2 "CHECKPOINT_DIR $CKPT: no such directory"
if [ ! -f "$CKPT/driver_state.json" ] && [ -f "$CKPT/latest_checkpointed_iteration.txt" ]; then
    CKPT="$CKPT/global_step_$(tr -d '[:space:]' <"$CKPT/latest_checkpointed_iteration.txt")"
fi
[ -f "$CKPT/driver_state.json" ] || _megarl_die 2 "CHECKPOINT_DIR $CKPT: not a megarl" \
    "checkpoint (no driver_state.json, no latest_checkpointed_iteration.txt)"
CKPT=$(cd "$CKPT" && pwd)
OVERRIDES=("$@" "trainer.nnodes=$SLURM_NNODES" trainer.resume_mode=resume_path
           "trainer.resume_from_path=$CKPT")

megarl_setup_env
# `megarl validate` adds trainer.val_only=True itself; check the config the same way.
megarl_read_config "$CONFIG" "${OVERRIDES[@]}" trainer.val_only=True
megarl_ray_start
_megarl_log "validating checkpoint $CKPT"
megarl_run python -m megarl.cli validate --config "$CONFIG" "${OVERRIDES[@]}"
