# Shell shared by tools/gpu_check.sh and tools/gpu_session.sh (sourced, not run). Each
# function takes the calling script's name for its messages; PY is the Python to use.
#
#   gpu_require_cuda NAME       exit 2 where torch sees no CUDA device (before any work)
#   gpu_install_missing NAME W  pip-install megarl's missing requirements with --no-deps, from
#                               the wheel folder W when given (a machine without a registry)
#   gpu_env_json FILE           the machine: GPU, count, memory, torch and CUDA versions
#   gpu_peak_tflops             the GPU's dense bf16 peak in TFLOP/s, when known (else empty)

gpu_require_cuda() {
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null || {
    echo "$1: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine" >&2
    exit 2
  }
}

gpu_install_missing() {
  local name="$1" wheels="$2" missing
  # module to import -> the distribution that provides it (megarl's requirements, less torch
  # and Ray, plus the test runner)
  missing=$("$PY" - <<'PYEOF'
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
PYEOF
)
  [[ -n "$missing" ]] || return 0
  echo "$name: installing (no dependencies, the machine's torch untouched): $missing"
  if [[ -n "$wheels" ]]; then
    # every wheel in the folder: the packages above and what they need themselves
    "$PY" -m pip install --no-deps --no-index "$wheels"/*.whl
  else
    "$PY" -m pip install --no-deps $missing
  fi
}

gpu_env_json() {
  "$PY" - "$1" <<'PYEOF'
import json, sys, torch
p = torch.cuda.get_device_properties(0)
json.dump({"gpu": p.name, "count": torch.cuda.device_count(),
           "memory_gib": round(p.total_memory / 2**30, 1), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()},
          open(sys.argv[1], "w"))
PYEOF
}

gpu_peak_tflops() {
  # Peak dense bf16 FLOP/s of the GPU for MFU (NVIDIA's datasheets; SXM parts), when known.
  "$PY" -c 'import torch; n = torch.cuda.get_device_name(0)
print(next((p for k, p in (("H100", 989), ("H200", 989), ("A100", 312)) if k in n), ""))'
}
