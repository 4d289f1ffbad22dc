"""What `actor_rollout_ref.model.enable_gradient_checkpointing` buys and costs: the peak memory
and the time of a Megatron train step at a long sequence with Megatron's full recompute (one
layer at a time) against the same step without it, and whether the two steps are the same.

    python tools/bench_recompute.py [--seq 4096] [--layers 8] [--hidden 256] [--rounds 2]

Each side runs in a fresh process of its own (one rank, CPU): it builds the worker, trains one
step to warm up, resets the process's peak resident memory (Linux `clear_refs`), trains one
more step, and reports that step's peak RSS above the RSS it started from, its time and its
grad norm. The sides alternate for `--rounds` rounds so that load from other work hits both.
A tiny random Qwen2-shaped model of the given width and depth is made in a temporary folder.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megarl.utils.procmem import peak_of

ROOT = Path(__file__).resolve().parent.parent


def measured_step(w, seq: int, *, between=None) -> dict:
    """One sequence of `seq` random tokens: a warm-up train step, `between()` if given, then
    the measured step's peak RSS above its start (MiB), seconds, loss and grad norm."""
    import torch

    def loss_fn(logprobs, entropy, mb):
        mask = mb["loss_mask"].float()
        return -(logprobs * mask).sum() / mask.sum(), {}

    ids = torch.randint(0, w.args.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:, 0] = 0
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    w.train_step(batch, loss_fn, micro_batch_size=1)
    if between is not None:
        between()
    peak, seconds, step = peak_of(lambda: w.train_step(batch, loss_fn, micro_batch_size=1))
    return {"peak_mib": peak, "seconds": seconds, "grad_norm": step["grad_norm"],
            "loss": step["loss"]}


def _side(model: str, seq: int, recompute: bool, out: str) -> None:
    """One process: a warm-up step, then the measured one."""
    import torch

    from megarl.backends.megatron.optim import OptimConfig
    from megarl.backends.megatron.parallel import rank_program
    from megarl.backends.megatron.worker import MegatronWorker

    with rank_program():
        torch.manual_seed(0)
        w = MegatronWorker(model, 1, 1, optim=OptimConfig(lr=1e-4), recompute=recompute)
        Path(out).write_text(json.dumps(measured_step(w, seq)))


def _run(model: str, seq: int, recompute: bool) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_PORT="0")
        cmd = [sys.executable, __file__, "--side", "on" if recompute else "off",
               "--model", model, "--seq", str(seq), "--out", f.name]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"recompute={recompute} failed:\n{p.stderr[-3000:]}")
        return json.loads(Path(f.name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--side", choices=["on", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        _side(a.model, a.seq, a.side == "on", a.out)
        return
    from megarl.utils.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "m", "qwen2", hidden_size=a.hidden,
                                    num_layers=a.layers, num_heads=4, num_kv_heads=2,
                                    intermediate_size=4 * a.hidden,
                                    max_position_embeddings=max(1024, a.seq)))
        runs = {False: [], True: []}
        for _ in range(a.rounds):
            for recompute in (False, True):
                runs[recompute].append(_run(model, a.seq, recompute))
    off, on = runs[False], runs[True]
    peak = {k: statistics.median(r["peak_mib"] for r in v) for k, v in runs.items()}
    secs = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    same = {r["grad_norm"] for r in off} == {r["grad_norm"] for r in on}
    print(f"train step, seq {a.seq}, {a.layers} layers, hidden {a.hidden}, 1 CPU rank "
          f"(median of {a.rounds}):")
    print(f"  {'':10} {'peak MiB':>10} {'seconds':>9}")
    print(f"  {'off':10} {peak[False]:10.0f} {secs[False]:9.2f}")
    print(f"  {'recompute':10} {peak[True]:10.0f} {secs[True]:9.2f}")
    print(f"  ratio recompute/off: memory {peak[True] / peak[False]:.2f}, "
          f"time {secs[True] / secs[False]:.2f}; same step (grad norm): {same}")


if __name__ == "__main__":
    main()
