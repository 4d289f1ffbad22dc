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
# The project's own sources, byte-compiled once before the suite starts its hundreds of Python
# processes (xdist workers, `megarl train` drivers, Ray workers, torchrun ranks, spawned gloo
# ranks). pip compiles what it installs, but not an editable install's sources, and where
# PYTHONDONTWRITEBYTECODE is set (as on the CI machine) no process ever writes them: each
# one compiled megarl again from source: 0.13 s of CPU in each process that imports a run's 78
# modules (measured 2026-11-29). A stale .pyc is never used (checked against the source's
# mtime and size); a file that does not compile is left to pytest to report.
python -m compileall -q -j 0 megarl tests >/dev/null 2>&1 || true
python -m pytest tests -q -p no:cacheprovider --timeout=900 --durations=40 "${xdist[@]}" "$@"
