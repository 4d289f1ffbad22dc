#!/usr/bin/env bash
# The GPU path in one command, on a machine with one or more CUDA GPUs (docs/gpu.md).
#
#   bash tools/gpu_check.sh [--wheels DIR] [--out DIR]
#
# 1. Refuses (exit 2) where torch sees no CUDA device.
# 2. Makes megarl importable without touching the machine's torch: megarl itself is used from
#    this checkout (PYTHONPATH), and each Python package it needs that is missing is installed
#    with --no-deps, from --wheels DIR when given (a machine without a registry: make the
#    folder with `pip download` elsewhere, docs/gpu.md), else from the index. Ray is not
#    needed: the end-to-end part runs under trainer.launcher=torchrun.
# 3. Runs the GPU tests (`pytest -m gpu`: bf16 against fp32 training, the CUDA engine against
#    transformers, the quickstart on one GPU) and tools/bench_train.py.
# 4. Writes OUT/report.json and OUT/report.md (tools/gpu_report.py); exit 1 if a test failed.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
OUT="gpu_report"
WHEELS=""
usage() { echo "usage: bash tools/gpu_check.sh [--wheels DIR] [--out DIR]" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) [[ $# -ge 2 ]] || usage; WHEELS="$2"; shift 2 ;;
    --out) [[ $# -ge 2 ]] || usage; OUT="$2"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "tools/gpu_check.sh: unknown argument $1" >&2; usage ;;
  esac
done
[[ -z "$WHEELS" || -d "$WHEELS" ]] || { echo "tools/gpu_check.sh: --wheels $WHEELS is not a directory" >&2; exit 2; }

source "$HERE/tools/gpu_common.sh"
gpu_require_cuda tools/gpu_check.sh
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

gpu_install_missing tools/gpu_check.sh "$WHEELS"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
gpu_env_json "$OUT/env.json"

cd "$HERE"
status=0
# tests/contract and tests/stock read the stock SGLang wheel and its environment (msgspec, ...),
# which a GPU machine without a registry lacks; none of their tests is a GPU test
MEGARL_GPU_REPORT_DIR="$OUT" "$PY" -m pytest -m gpu -p no:cacheprovider -rs \
  --ignore=tests/contract --ignore=tests/stock \
  --junitxml="$OUT/pytest.xml" tests 2>&1 | tee "$OUT/pytest.txt" || status=1
PEAK=$(gpu_peak_tflops)
# the real Qwen2.5-1.5B shape (configs/models/qwen2_5_1_5b.json: vocab 151936), random init
# in memory, bf16, Megatron side only (the model held once); shorten --seq or --micro-batch if
# it does not fit. tools/gpu_session.sh runs the fuller set (packed, kernels, profile).
timeout 600 "$PY" tools/bench_train.py --shape qwen2.5-1.5b --seq 4096 --batch 4 \
  --micro-batch 1 --steps 6 --warmup 2 --dtype bfloat16 ${PEAK:+--peak-tflops $PEAK} \
  > "$OUT/bench_train.txt" 2>&1 || echo "bench_train.py failed (exit $?): see $OUT/bench_train.txt"
"$PY" tools/gpu_report.py "$OUT" || status=1
exit $status
