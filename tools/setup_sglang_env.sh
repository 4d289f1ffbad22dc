#!/usr/bin/env bash
# Build the stock SGLang server's own environment for CPU machines (laptops, CI):
#   bash tools/setup_sglang_env.sh [VENV]
# VENV defaults to $MEGARL_SGLANG_VENV, else ~/.cache/megarl/venvs/sglang-<version>-cpu (under
# $MEGARL_CACHE_DIR when set), where megarl looks for it (megarl/backends/sglang/cpu_env.py;
# override with actor_rollout_ref.rollout.server_python). It holds the local CPU torch 2.13.0,
# the exact set in megarl/backends/sglang/cpu/requirements.lock and sglang itself, all with
# --no-deps: sglang's CUDA pins never enter it, and megarl's .venv is not touched. A current
# environment (same lock) is kept as it is; a stale or broken one is rebuilt. ~2.5 min cold,
# ~2.8 GB. GPU machines do not need it: `pip install -e .[gpu]` puts sglang beside megarl.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=$(sed -n 's/^SGLANG_VERSION = "\(.*\)"/\1/p' megarl/backends/sglang/__init__.py)
CACHE=${MEGARL_CACHE_DIR:-$HOME/.cache/megarl}
VENV=${1:-${MEGARL_SGLANG_VENV:-$CACHE/venvs/sglang-$VERSION-cpu}}
LOCK=megarl/backends/sglang/cpu/requirements.lock
STAMP="sglang==$VERSION $("$PY" -c "import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],'rb').read()).hexdigest()[:16])" "$LOCK")"

# One build at a time per environment (the test suite's two workers may both ask for it): a
# second caller waits here, then finds the first one's environment current.
mkdir -p "$(dirname "$VENV")"
if command -v flock >/dev/null; then
  exec 9>"$VENV.lock"
  flock 9
fi
# Current: the stamp matches and sglang is installed (its version read from its metadata, not
# by `import sglang`, which on a CPU succeeds only under megarl's shim).
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.megarl-sglang-stamp" 2>/dev/null)" = "$STAMP" ] \
   && "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('sglang') == '$VERSION'" \
      2>/dev/null; then
  echo "setup_sglang_env: current environment at $VENV ($STAMP)"
  exit 0
fi
echo "setup_sglang_env: building $VENV ($STAMP)"
# The stamp is written last: an interrupted build never looks current, and is built anew.
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
filter() { grep -v -e "^WARNING: Location" -e "is ignored: it is neither" || true; }
"${PIP[@]}" "torch==2.13.0" 2>&1 | filter
"${PIP[@]}" --no-deps -r "$LOCK" 2>&1 | filter
"${PIP[@]}" --no-deps "sglang==$VERSION" 2>&1 | filter
"$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('sglang') == '$VERSION'"
echo "$STAMP" > "$VENV/.megarl-sglang-stamp"
echo "setup_sglang_env: ok ($VENV/bin/python, sglang $VERSION)"
