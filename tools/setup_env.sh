#!/usr/bin/env bash
# Create .venv (if absent) and install megarl with its test extras. CPU machines take the local
# torch 2.13.0 wheel first, so nothing pulls a multi-GB CUDA build.
#   bash tools/setup_env.sh            megarl, its tests, Slurm for the launch test
#   bash tools/setup_env.sh --sglang   also the stock SGLang server's own environment
#                                      (tools/setup_sglang_env.sh: rollout.name=sglang on CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG=0
for arg in "$@"; do
  case "$arg" in
    --sglang) SGLANG=1 ;;
    *) echo "setup_env: unknown argument $arg (known: --sglang)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if [ "$SGLANG" = 1 ]; then
  # The stock server's environment needs nothing of .venv (its own venv from $PY, its own
  # pip), and each build is one busy process: built beside megarl's, not after it, it takes
  # no wall time of its own on two cores (cold, 2026-11-29: ~2 min of the CI's ~3.5 min of
  # set-up; the two ways side by side on one loaded machine: 845 s here, 961 s one after the
  # other). Its output is held back and printed whole when it is waited for, below.
  sglang_log=$(mktemp -t megarl-sglang-env.XXXXXX)
  PYTHON="$PY" bash tools/setup_sglang_env.sh >"$sglang_log" 2>&1 &
  sglang_pid=$!
  trap 'kill "$sglang_pid" 2>/dev/null || true' EXIT  # megarl's set-up failed: stop it too
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
python -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
# verl 0.9.1's code, beside (not in) the environment: the tests that compare with it
bash tools/setup_verl_ref.sh
bash tools/install_slurm.sh || echo "setup_env: Slurm not installed; the Slurm launch test needs it (see above)" >&2
python -c "import torch, megatron.core, megarl; print('env ok: torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
if [ "$SGLANG" = 1 ]; then
  # megarl is set up whatever happens here; without this environment the stock SGLang tests
  # skip, saying why, and rollout.name=sglang on a CPU names the command that builds it.
  sglang_rc=0
  wait "$sglang_pid" || sglang_rc=$?
  trap - EXIT
  cat "$sglang_log" && rm -f "$sglang_log"
  [ "$sglang_rc" = 0 ] || echo "setup_env: the stock SGLang environment was not built (see above)" >&2
fi
