#!/usr/bin/env bash
# megarl on several nodes without Ray: one process per device, started by torchrun.
# Run it once on every node, with the same settings except NODE_RANK:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC_PER_NODE=8 \
#       bash launch/torchrun.sh CONFIG [key=value ...]
#
# or with flags: --nnodes N --node-rank R --master-addr HOST --master-port PORT
#                --nproc-per-node P [--rdzv-backend static|c10d] CONFIG [key=value ...]
#
# Global rank = NODE_RANK × NPROC_PER_NODE + local rank is device rank; the task groups of
# trainer.separated_node_tasks/ratios get the rank ranges of their devices, and rank 0 runs
# the driver (docs/launch.md, "Multi-node torchrun"). The default rendezvous is `static`, which
# honours NODE_RANK (node 0 hosts the driver and the store at MASTER_ADDR:MASTER_PORT);
# `c10d` lets the rendezvous assign node ranks instead.
#
# Restarts: torchrun's `--max-restarts` is the config's `trainer.max_restarts` (read from
# CONFIG and the overrides): when a process fails, every node's agent restarts its processes
# and the run resumes from its newest checkpoint (docs/checkpoints.md).
#
# The ranks sign their commands with MEGARL_CONTROL_SECRET (docs/security.md): a one-node job
# gets a fresh one here; a multi-node job needs the same one exported on every node, e.g.
#   export MEGARL_CONTROL_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')
# once, kept in a file only the job's user can read.
set -euo pipefail

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
RDZV_BACKEND=${RDZV_BACKEND:-static}
PYTHON=${PYTHON:-python}

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --nnodes) NNODES=$2; shift 2 ;;
    --node-rank|--node_rank) NODE_RANK=$2; shift 2 ;;
    --master-addr|--master_addr) MASTER_ADDR=$2; shift 2 ;;
    --master-port|--master_port) MASTER_PORT=$2; shift 2 ;;
    --nproc-per-node|--nproc_per_node) NPROC_PER_NODE=$2; shift 2 ;;
    --rdzv-backend) RDZV_BACKEND=$2; shift 2 ;;
    -h|--help) usage ;;
    --) shift; break ;;
    -*) echo "launch/torchrun.sh: unknown flag $1" >&2; usage ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { echo "launch/torchrun.sh: missing CONFIG" >&2; usage; }
CONFIG=$1; shift
[[ -f "$CONFIG" ]] || { echo "launch/torchrun.sh: config $CONFIG not found" >&2; exit 2; }
for v in NNODES NODE_RANK MASTER_PORT NPROC_PER_NODE; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || { echo "launch/torchrun.sh: $v=${!v} is not a number" >&2; exit 2; }
done
(( NODE_RANK < NNODES )) || { echo "launch/torchrun.sh: NODE_RANK=$NODE_RANK but NNODES=$NNODES" >&2; exit 2; }

if [[ -z "${MEGARL_CONTROL_SECRET:-}" ]]; then
  if (( NNODES > 1 )); then
    echo "launch/torchrun.sh: MEGARL_CONTROL_SECRET is not set; a job of $NNODES nodes needs" \
      "the same secret exported on every node (see the top of this script)" >&2
    exit 2
  fi
  MEGARL_CONTROL_SECRET=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')
fi
export MEGARL_CONTROL_SECRET

# Keep the repository importable however the package was installed.
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

# One source for the restart limit: the config (a bad config fails here, before torchrun).
MAX_RESTARTS=$("$PYTHON" -m megarl.cli config --config "$CONFIG" --get trainer.max_restarts \
  trainer.launcher=torchrun trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$NPROC_PER_NODE" \
  "$@") \
  || { echo "launch/torchrun.sh: the config does not load (above)" >&2; exit 2; }

# The config overrides come last so the command line can still change anything.
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend "$RDZV_BACKEND" --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
  --max-restarts "$MAX_RESTARTS" \
  -m megarl.cli train --config "$CONFIG" \
  trainer.launcher=torchrun trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$NPROC_PER_NODE" \
  "$@"
