#!/usr/bin/env bash
# verl 0.9.1's own code, for the tests that hold megarl's algorithms against it
# (tests/verl_reference.py). Installed with --no-deps into a folder of its own
# (.venv/verl-ref), never into megarl's environment: verl's import configures the root logger
# and sets environment variables, so tests import it only in a child process. Its imports
# beyond what .venv has are five small pure-Python packages, pinned here.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.venv/verl-ref
PKGS="verl==0.9.1 tensordict==0.15.3 pyvers==0.2.3 cloudpickle==3.1.3 orjson==3.13.0 codetiming==1.4.0"
STAMP="$DEST/.megarl-stamp"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PKGS" ]; then
  echo "setup_verl_ref: ok ($DEST)"; exit 0
fi
rm -rf "$DEST.tmp"
# shellcheck disable=SC2086
.venv/bin/python -m pip install -q --no-deps --target "$DEST.tmp" $PKGS 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import sys; sys.path.append('$DEST.tmp'); import verl.trainer.ppo.core_algos" \
  2>/dev/null || { echo "setup_verl_ref: verl 0.9.1 did not import from $DEST.tmp" >&2; exit 1; }
echo "$PKGS" > "$DEST.tmp/.megarl-stamp"
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
echo "setup_verl_ref: ok ($DEST: $PKGS)"
