"""What context parallelism (`<section>.megatron.context_parallel_size`) buys: the peak memory
per rank of one Megatron train step on one long sequence at CP=1 and CP=2, side by side with
the dry run's activation estimate for each, and whether the two steps are the same.

    python tools/bench_cp_memory.py [--seq 4096] [--layers 4] [--hidden 512]

Each side is a torchrun job of its own (CP ranks, CPU, gloo): every rank builds the worker,
trains one step to warm up (the optimizer's state and the gradient buffers exist from then
on), resets its peak resident memory (Linux `clear_refs`), trains one more step, and reports
that step's peak RSS above the RSS it started from (activations and temporaries) and its grad
norm; a side's figure is its largest rank's. A random Qwen2-shaped model of the given width
and depth with a small vocabulary (so activations, not logits, dominate) is made in a
temporary folder.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_recompute import measured_step  # tools/, this script's own folder

ROOT = Path(__file__).resolve().parent.parent


def _rank(model: str, seq: int, cp: int, out: str) -> None:
    """One rank of a side: a warm-up step, then the measured one."""
    import torch
    import torch.distributed as dist

    from megarl.backends.megatron.optim import OptimConfig
    from megarl.backends.megatron.parallel import rank_program
    from megarl.backends.megatron.worker import MegatronWorker

    with rank_program():
        torch.manual_seed(0)
        w = MegatronWorker(model, 1, 1, optim=OptimConfig(lr=1e-4), context_parallel=cp)
        Path(f"{out}.{dist.get_rank()}").write_text(json.dumps(
            measured_step(w, seq, between=dist.barrier)))


def _side(model: str, seq: int, cp: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank")
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={cp}", __file__, "--rank-of", str(cp), "--model", model,
               "--seq", str(seq), "--out", out]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"CP={cp} failed:\n{p.stderr[-3000:]}")
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(cp)]
    return {"peak_mib": max(r["peak_mib"] for r in ranks),
            "seconds": max(r["seconds"] for r in ranks),
            "grad_norm": ranks[0]["grad_norm"], "loss": ranks[0]["loss"]}


def _estimate_mib(model: str, seq: int, cp: int) -> float:
    """The dry run's activation estimate of this step (controller/memory.py's formula)."""
    from megarl.backends.megatron.hf.model_config import read_model_args
    from megarl.config import load_config
    from megarl.controller import memory

    A, M = "actor_rollout_ref", "actor_rollout_ref.actor.megatron"
    cfg = load_config(None, [f"{A}.model.path={model}", "data.max_prompt_length=1",
                             f"data.max_response_length={seq - 1}",
                             f"{A}.actor.ppo_micro_batch_size_per_gpu=1",
                             f"{A}.rollout.log_prob_micro_batch_size_per_gpu=1",
                             f"{A}.model.enable_gradient_checkpointing=false",
                             f"{M}.params_dtype=float32", f"{M}.context_parallel_size={cp}",
                             f"trainer.n_gpus_per_node={max(2, cp)}"])
    return memory._activation_bytes(cfg, read_model_args(model)) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--rank-of", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_of:
        _rank(a.model, a.seq, a.rank_of, a.out)
        return
    from megarl.utils.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "m", "qwen2", hidden_size=a.hidden,
                                    num_layers=a.layers, num_heads=8, num_kv_heads=8,
                                    intermediate_size=4 * a.hidden,
                                    max_position_embeddings=max(1024, a.seq)))
        runs = {cp: _side(model, a.seq, cp) for cp in (1, 2)}
        est = {cp: _estimate_mib(model, a.seq, cp) for cp in (1, 2)}
    print(f"train step, one sequence of {a.seq} tokens, {a.layers} layers, hidden {a.hidden}, "
          f"fp32, CPU ranks (peak RSS above the step's start, largest rank):")
    print(f"  {'':6} {'peak MiB/rank':>14} {'dry-run MiB':>12} {'seconds':>9} {'grad norm':>11}")
    for cp, r in runs.items():
        print(f"  CP={cp:<3} {r['peak_mib']:14.0f} {est[cp]:12.0f} {r['seconds']:9.2f} "
              f"{r['grad_norm']:11.6f}")
    print(f"  ratio CP2/CP1: measured {runs[2]['peak_mib'] / runs[1]['peak_mib']:.2f}, "
          f"dry run {est[2] / est[1]:.2f}; same step (loss, grad norm within 1e-5): "
          f"{abs(runs[1]['loss'] - runs[2]['loss']) <= 1e-5 * abs(runs[1]['loss']) and abs(runs[1]['grad_norm'] - runs[2]['grad_norm']) <= 1e-5 * runs[1]['grad_norm']}")


if __name__ == "__main__":
    main()
