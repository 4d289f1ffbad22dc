#!/usr/bin/env bash
# Train with megarl on a Slurm allocation: a Ray head on the first node, a Ray worker on every
# other node, then `megarl train` on the head; Ray is torn down however the job ends.
#
#   sbatch launch/slurm_ray.sh CONFIG [key=value overrides...]
#   sbatch --nodes=4 --gpus-per-node=8 --cpus-per-task=64 --time=24:00:00 \
#          launch/slurm_ray.sh configs/my_run.yaml trainer.n_gpus_per_node=8
#
# Submit from the repository root (relative CONFIG and data paths resolve against the submit
# directory). trainer.nnodes is set to the allocation's node count ($SLURM_NNODES).
# The #SBATCH lines below are defaults; options given to sbatch on its command line win.
# On GPU clusters add --gpus-per-node=N (N = trainer.n_gpus_per_node) and usually --exclusive.
#
# Environment (see launch/_ray_cluster.sh for the full list): MEGARL_HOME (checkout to use;
# default: the one this script was submitted from), MEGARL_VENV, RAY_PORT, RAY_HEAD_IP,
# RAY_NUM_CPUS, RAY_NUM_GPUS, RAY_TMPDIR, RAY_START_TIMEOUT, RAY_STOP_ON_NODES.
# Exit status: megarl's (2 for a bad config, before Ray starts); 143/130 when cancelled.
#
# Restarts: a lost worker or host restarts the run inside this job (trainer.max_restarts).
# When Slurm itself ends the job for a node that failed (or preempts it, or an admin runs
# `scontrol requeue`), --requeue puts it back in the queue: the script runs again, megarl
# resumes from the newest checkpoint, and every requeue counts against trainer.max_restarts;
# the log goes on in the same output file (--open-mode=append).
#
#SBATCH --job-name=megarl-train
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=04:00:00
#SBATCH --output=megarl-%x-%j.out
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail

MEGARL_LAUNCHER=slurm_ray
if [ $# -lt 1 ] || [ "${1:0:1}" = - ]; then
    echo "usage: sbatch $0 CONFIG [key=value overrides...]" >&2
    exit 2
fi
# sbatch runs a spool copy of this file: find the checkout from the path Slurm recorded.
_cmd=$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
MEGARL_HOME=${MEGARL_HOME:-$(cd "$(dirname "${_cmd:-$0}")/.." && pwd)}
# shellcheck source=launch/_ray_cluster.sh
. "$MEGARL_HOME/launch/_ray_cluster.sh"
megarl_require_slurm

CONFIG=$1; shift
[ -f "$CONFIG" ] || _megarl_die 2 "CONFIG $CONFIG: no such file (relative to $PWD)"
OVERRIDES=("$@" "trainer.nnodes=$SLURM_NNODES")

megarl_setup_env
megarl_read_config "$CONFIG" "${OVERRIDES[@]}"
megarl_requeued
megarl_ray_start
megarl_run python -m megarl.cli train --config "$CONFIG" "${OVERRIDES[@]}"
