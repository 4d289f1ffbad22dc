#!/usr/bin/env bash
# The project's test command (README): unit tests, then the multi-process integration tests,
# on MEGARL_TEST_WORKERS pytest-xdist workers (default 2; 1 or 0: this process, in order).
# Most of an end-to-end test's time is process start-up and waiting on other processes, so
# two workers keep two cores busy; tests that share an expensive fixture or a machine-wide
# name stay together (`--dist loadgroup`, groups in tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
workers=${MEGARL_TEST_WORKERS:-2}
xdist=()
[ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadgroup)
python -m pytest tests -q -p no:cacheprovider --timeout=900 --durations=40 "${xdist[@]}" "$@"
