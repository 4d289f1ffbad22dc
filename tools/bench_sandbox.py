"""What one sandboxed program costs: the hardened sandbox against the one before it and a bare
interpreter, side by side in one process.

Three ways to run the same small program (reads stdin, prints a sum), interleaved
`--repeats` times each, after one warm-up call of each:

- **bare**: `python3 -I -c` in a plain subprocess (no isolation: the floor);
- **before**: `run_program` as it was at `--before` (a git revision; default the last commit
  before the minimal root, nested uid and seccomp layers), loaded from `git show` into a
  temporary directory;
- **now**: this checkout's `run_program`.

Medians are printed in milliseconds, with the ratios now / before and now / bare.

    python tools/bench_sandbox.py [--repeats 40 --before 7fd8c92]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megarl.reward import sandbox as now_mod  # noqa: E402

PROGRAM = "import sys\nprint(sum(map(int, sys.stdin.read().split())))\n"
STDIN = "1 2 3 4 5\n"


def load_before(rev: str, into: Path):
    for name in ("sandbox.py", "_sandbox_init.py"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:megarl/reward/{name}"],
                              check=True, capture_output=True, text=True).stdout
        (into / name).write_text(text)
    spec = importlib.util.spec_from_file_location("sandbox_before", into / "sandbox.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--before", default="7fd8c92")
    args = ap.parse_args()
    python = now_mod.default_python()

    def bare():
        out = subprocess.run([python, "-I", "-c", PROGRAM], input=STDIN, capture_output=True,
                             text=True, check=True).stdout
        assert out == "15\n"

    with tempfile.TemporaryDirectory() as tmp:
        before_mod = load_before(args.before, Path(tmp))

        def via(mod):
            def run():
                r = mod.run_program(PROGRAM, STDIN)
                assert r.status == "ok" and r.stdout == "15\n", (r.status, r.stderr)
            return run

        ways = {"bare": bare, "before": via(before_mod), "now": via(now_mod)}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for fn in ways.values():
            fn()  # warm-up: page cache, imports
        for _ in range(args.repeats):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"one program, median of {args.repeats} (ms): "
          + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    print(f"now / before: {med['now'] / med['before']:.2f}x   now / bare: "
          f"{med['now'] / med['bare']:.2f}x   (before = {args.before})")


if __name__ == "__main__":
    main()
