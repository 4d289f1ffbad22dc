"""A Megatron checkpoint's first save in a process, and the saves after it: megarl's writer
(results through an in-process queue) against Megatron's default (a queue served by a
spawn-method multiprocessing Manager, started at a process's first save).

    python tools/bench_checkpoint.py [--model DIR] [--saves N] [--rounds R]

Each side runs in fresh processes of its own (one rank under torch.distributed.run), since
the Manager is made once per process: R rounds, the sides alternating, so load from other
work on the machine hits both alike. Each process builds the worker, then saves N times; the
first save and the mean of the others are reported, and the ratio megatron / megarl. Without
--model a tiny Qwen2 is made in a temporary folder.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rank(model: str, saves: int, side: str, out: str) -> None:
    """One process's saves; `side` megatron keeps Megatron's default results queue."""
    from megarl.backends.megatron import checkpoint
    from megarl.backends.megatron.parallel import destroy_distributed
    from megarl.backends.megatron.worker import MegatronWorker

    if side == "megatron":
        checkpoint._in_process_write_results = lambda: None
    w = MegatronWorker(model, 1, 1, trainable=True)
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(saves):
            t = time.perf_counter()
            checkpoint.save_checkpoint(w, os.path.join(tmp, f"s{i}"), step=i)
            times.append(time.perf_counter() - t)
    Path(out).write_text(json.dumps(times))
    destroy_distributed()


def _run_side(model: str, saves: int, side: str) -> list[float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=1", __file__, "--rank", side, "--model", model,
               "--saves", str(saves), "--out", f.name]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{side} side failed:\n{p.stderr[-3000:]}")
        return json.loads(Path(f.name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="an HF model directory (default: a tiny Qwen2)")
    ap.add_argument("--saves", type=int, default=3, help="saves per process (>= 2)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per side")
    ap.add_argument("--rank", choices=("megarl", "megatron"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.saves < 2 or args.rounds < 1:
        ap.error("--saves must be at least 2 and --rounds at least 1")
    if args.rank:
        _rank(args.model, args.saves, args.rank, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from megarl.utils.tiny_model import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny", arch="qwen2"))
        got = {"megarl": [], "megatron": []}
        for _ in range(args.rounds):
            for side in ("megatron", "megarl"):
                got[side].append(_run_side(model, args.saves, side))
    print(f"model {model}  {args.rounds} process(es) per side, {args.saves} saves each")
    print(f"{'side':10s} {'first save s':>13s} {'later saves s':>14s}")
    row = {}
    for side, runs in got.items():
        first = statistics.median(r[0] for r in runs)
        later = statistics.mean(t for r in runs for t in r[1:])
        row[side] = (first, later)
        print(f"{side:10s} {first:13.3f} {later:14.3f}")
    print(f"ratio megatron/megarl: first save {row['megatron'][0] / row['megarl'][0]:.1f}x, "
          f"later saves {row['megatron'][1] / row['megarl'][1]:.2f}x")


if __name__ == "__main__":
    main()
