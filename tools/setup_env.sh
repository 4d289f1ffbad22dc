#!/usr/bin/env bash
# Create .venv (if absent) and install megarl with its test extras. CPU machines take the local
# torch 2.13.0 wheel first, so nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
python -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
bash tools/install_slurm.sh || echo "setup_env: Slurm not installed; the Slurm launch test needs it (see above)" >&2
python -c "import torch, megatron.core, megarl; print('env ok: torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
