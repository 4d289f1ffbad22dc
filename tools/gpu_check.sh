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

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null || {
  echo "tools/gpu_check.sh: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine" >&2
  exit 2
}
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

# module to import -> the distribution that provides it (megarl's requirements, less torch and
# Ray, plus the test runner)
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"megatron.core": "megatron-core", "omegaconf": "omegaconf", "yaml": "pyyaml",
        "tensorboard": "tensorboard", "numpy": "numpy", "transformers": "transformers",
        "tokenizers": "tokenizers", "safetensors": "safetensors", "pyarrow": "pyarrow",
        "psutil": "psutil", "einops": "einops", "aiohttp": "aiohttp", "PIL": "pillow",
        "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
def have(mod):
    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        return False
print(" ".join(dist for mod, dist in need.items() if not have(mod)))
EOF
)
if [[ -n "$missing" ]]; then
  echo "tools/gpu_check.sh: installing (no dependencies, the machine's torch untouched): $missing"
  if [[ -n "$WHEELS" ]]; then
    # every wheel in the folder: the packages above and what they need themselves
    "$PY" -m pip install --no-deps --no-index "$WHEELS"/*.whl
  else
    "$PY" -m pip install --no-deps $missing
  fi
fi
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - "$OUT/env.json" <<'EOF'
import json, sys, torch
p = torch.cuda.get_device_properties(0)
json.dump({"gpu": p.name, "count": torch.cuda.device_count(),
           "memory_gib": round(p.total_memory / 2**30, 1), "torch": torch.__version__,
           "cuda": torch.version.cuda}, open(sys.argv[1], "w"))
EOF

cd "$HERE"
status=0
# tests/contract and tests/stock read the stock SGLang wheel and its environment (msgspec, ...),
# which a GPU machine without a registry lacks; none of their tests is a GPU test
MEGARL_GPU_REPORT_DIR="$OUT" "$PY" -m pytest -m gpu -p no:cacheprovider -rs \
  --ignore=tests/contract --ignore=tests/stock \
  --junitxml="$OUT/pytest.xml" tests 2>&1 | tee "$OUT/pytest.txt" || status=1
# Peak dense bf16 FLOP/s of the GPU for MFU (NVIDIA's datasheets; SXM parts), when known.
PEAK=$("$PY" -c 'import torch; n = torch.cuda.get_device_name(0)
print(next((p for k, p in (("H100", 989), ("H200", 989), ("A100", 312)) if k in n), ""))')
# a Qwen2.5-1.5B-shaped random model (hidden 1536, 28 layers, 12 heads, 2 KV heads, FFN 8960,
# vocab 151936) in bf16, Megatron side only (the model held once); shorten --seq or
# --micro-batch if it does not fit
timeout 600 "$PY" tools/bench_train.py --hidden 1536 --layers 28 --heads 12 --kv-heads 2 \
  --ffn 8960 --vocab 151936 --seq 4096 --batch 4 --micro-batch 1 --steps 6 --warmup 2 \
  --dtype bfloat16 --no-baseline ${PEAK:+--peak-tflops $PEAK} \
  > "$OUT/bench_train.txt" 2>&1 || echo "bench_train.py failed (exit $?): see $OUT/bench_train.txt"
"$PY" tools/gpu_report.py "$OUT" || status=1
exit $status
