#!/usr/bin/env bash
# Checkpoint conversion as a Slurm job: `megarl convert hf2mcore|mcore2hf ARGS...` on one node.
#
#   sbatch --cpus-per-task=4 launch/slurm_convert.sh hf2mcore --hf-dir HF --out CKPT --tp 2 --pp 2
#   sbatch launch/slurm_convert.sh mcore2hf --ckpt RUN/global_step_10/actor --out HF_OUT
#
# The converter re-launches itself under `torchrun --standalone` with PP × lcm(TP, EP×ETP)
# ranks on this node (TP×PP for a dense model; a mixture of experts' --ep/--etp take their
# ranks from each stage's; no Ray, no srun), so one task with that many CPUs is enough; on a
# GPU node every rank takes a GPU (NCCL), so also ask for --gpus-per-node=that many. It is
# checked against the allocation before anything starts. Environment: MEGARL_HOME, MEGARL_VENV (as launch/slurm_ray.sh).
# Exit status: the converter's (2 for bad arguments or an allocation too small).
#
#SBATCH --job-name=megarl-convert
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --time=02:00:00
#SBATCH --output=megarl-%x-%j.out
set -euo pipefail

MEGARL_LAUNCHER=slurm_convert
if [ $# -lt 1 ] || { [ "$1" != hf2mcore ] && [ "$1" != mcore2hf ]; }; then
    echo "usage: sbatch $0 hf2mcore|mcore2hf [converter args, see megarl convert <mode> --help]" >&2
    exit 2
fi
_cmd=$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
MEGARL_HOME=${MEGARL_HOME:-$(cd "$(dirname "${_cmd:-$0}")/.." && pwd)}
# shellcheck source=launch/_ray_cluster.sh
. "$MEGARL_HOME/launch/_ray_cluster.sh"
megarl_require_slurm

# TP, PP, EP and ETP as the converter will parse them (--tp N or --tp=N; default 1, ETP: TP).
tp=1 pp=1 ep=1 etp= prev=
for arg in "$@"; do
    case "$prev" in --tp) tp=$arg ;; --pp) pp=$arg ;; --ep) ep=$arg ;; --etp) etp=$arg ;; esac
    case "$arg" in
        --tp=*) tp=${arg#--tp=} ;; --pp=*) pp=${arg#--pp=} ;;
        --ep=*) ep=${arg#--ep=} ;; --etp=*) etp=${arg#--etp=} ;;
    esac
    prev=$arg
done
etp=${etp:-$tp}
for v in "$tp" "$pp" "$ep" "$etp"; do
    [[ $v =~ ^[1-9][0-9]*$ ]] || _megarl_die 2 "--tp/--pp/--ep/--etp must be positive" \
        "integers (got --tp $tp --pp $pp --ep $ep --etp $etp)"
done
# each stage's ranks split over TP and, for the experts, over EP×ETP: the least common multiple
a=$tp b=$((ep * etp))
while [ "$b" -ne 0 ]; do t=$((a % b)); a=$b; b=$t; done
ranks=$((pp * tp * ep * etp / a))
[ "${SLURM_NNODES:-1}" -eq 1 ] || _megarl_log "warning: conversion runs on one node;" \
    "the other $((SLURM_NNODES - 1)) node(s) of this job stay idle"
cpus=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}
gpus=${SLURM_GPUS_ON_NODE:-0}
if [ "$gpus" -gt 0 ] && [ "$gpus" -lt "$ranks" ]; then
    _megarl_die 2 "TP×PP=$tp×$pp (EP×ETP=$ep×$etp) needs $ranks GPUs (one per rank) but" \
        "the job has $gpus on its node: resubmit with --gpus-per-node=$ranks"
fi
if [ "$cpus" -lt "$ranks" ]; then
    _megarl_die 2 "TP×PP=$tp×$pp (EP×ETP=$ep×$etp) needs $ranks ranks but the job has" \
        "$cpus CPU(s): resubmit with --cpus-per-task=$ranks"
fi

megarl_setup_env
_megarl_log "converting ($1) with $ranks rank(s) on ${SLURMD_NODENAME:-$(hostname -s)}"
rc=0
python -m megarl.cli convert "$@" || rc=$?
_megarl_log "megarl convert exited with status $rc"
exit "$rc"
