#!/usr/bin/env bash
# The project's test command (README): unit tests, then the multi-process integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
python -m pytest tests -q -p no:cacheprovider --timeout=900 --durations=25 "$@"
