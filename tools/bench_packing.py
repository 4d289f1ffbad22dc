"""Packed token-budget micro-batches against padded ones: log-prob pass and train step.

    python tools/bench_packing.py                   # tiny Qwen2 (hidden 256, 4 layers), CPU
    python tools/bench_packing.py --batch 128 --cap 1024

One process, one Megatron worker per side, both from the same HF weights, on the same batch:
a long-tailed length mix as RL responses have (median about cap/8, a tenth of the rows at the
cap; rows right-padded to the cap). The padded side splits the batch into micro-batches of
`--micro-batch` rows, each the full padded width (what megarl does without
``use_dynamic_bsz``); the packed side uses a token budget of micro-batch × cap tokens (the
same largest micro-batch), each micro-batch packed into one row. The sides alternate pass by
pass, so load from other work hits both alike. Tokens/s counts real tokens (the attention
mask). A sanity check: the first log-probs and the first train step's loss and grad norm of
the two sides agree.

Peak memory: each side's pass runs once more in a child process of its own, which reports
how far its resident set rose above what it held after building the worker (Linux VmHWM -
VmRSS; on CUDA, the allocator's peak).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

from megarl.utils.procmem import status_kib


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model directory (default: make a tiny one in a temp dir)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--cap", type=int, default=512, help="the length cap (padded width)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-of", choices=("padded", "packed"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def long_tail(n: int, cap: int, seed: int) -> list[int]:
    """A tenth of the rows at the cap (those that ran out of budget); the rest log-normal
    with median cap/8, clipped to [2, cap]; in random order."""
    rng = random.Random(seed)
    mu = math.log(cap / 8)
    at_cap = round(n / 10)
    lengths = [cap] * at_cap + [max(2, min(cap, int(rng.lognormvariate(mu, 0.6))))
                                for _ in range(n - at_cap)]
    rng.shuffle(lengths)
    return lengths


def make_batch(lengths: list[int], cap: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    attn = (torch.arange(cap).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    ids = torch.randint(1, vocab, (len(lengths), cap), generator=g) * attn
    loss_mask = attn.clone()
    loss_mask[:, 0] = 0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}


def setup(args):
    from megarl.backends.megatron.optim import OptimConfig
    from megarl.backends.megatron.packing import TokenBudget
    from megarl.backends.megatron.worker import MegatronWorker
    from megarl.utils.launch import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.set_num_threads(args.threads or os.cpu_count())
    lengths = long_tail(args.batch, args.cap, args.seed)
    batch = make_batch(lengths, args.cap, args.vocab, args.seed)
    tokens = float(batch["loss_mask"].sum())

    def loss_fn(logprobs, entropy, mb):
        return -(logprobs * mb["loss_mask"]).sum() / tokens, {}

    def worker():
        return MegatronWorker(args.model, 1, 1, optim=OptimConfig(lr=1e-4, weight_decay=0.0))

    micro = {"padded": args.micro_batch, "packed": TokenBudget(args.micro_batch * args.cap)}
    return lengths, batch, loss_fn, worker, micro


def memory_child(args) -> None:
    """One side's log-prob pass and train step; print the peak rise in MiB as JSON."""
    _, batch, loss_fn, worker, micro = setup(args)
    w = worker()
    m = micro[args.memory_of]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = status_kib("VmRSS") * 1024
    w.compute_logp(batch, 1.0, m)
    w.train_step(batch, loss_fn, m)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() \
        else status_kib("VmHWM") * 1024
    print(json.dumps({"peak_mib": (peak - base) / 2**20}))


def main(argv=None):
    args = parse_args(argv)
    tmp = None
    if not args.model:
        from megarl.utils.tiny_model import make_tiny_model

        tmp = tempfile.mkdtemp(prefix="bench_packing_")
        args.model = str(make_tiny_model(os.path.join(tmp, "model"), vocab_size=args.vocab,
                                         hidden_size=args.hidden, num_layers=args.layers,
                                         num_heads=4, num_kv_heads=2,
                                         intermediate_size=3 * args.hidden,
                                         max_position_embeddings=max(1024, args.cap)))
    if args.memory_of:
        return memory_child(args)
    lengths, batch, loss_fn, worker, micro = setup(args)
    real = sum(lengths)
    sides = {"padded": worker(), "packed": worker()}
    first = {n: w.compute_logp(batch, 1.0, micro[n])["logprobs"] for n, w in sides.items()}
    mask = batch["attention_mask"].bool()
    lp_diff = float((first["padded"] - first["packed"])[mask].abs().max())
    t = {(n, op): [] for n in sides for op in ("logp", "train")}
    steps = {}
    for r in range(args.repeats + 1):  # the first round warms up
        for n, w in sides.items():
            t0 = time.perf_counter()
            w.compute_logp(batch, 1.0, micro[n])
            t1 = time.perf_counter()
            s = w.train_step(batch, loss_fn, micro[n])
            t2 = time.perf_counter()
            steps.setdefault(n, s)
            if r:
                t[(n, "logp")].append(t1 - t0)
                t[(n, "train")].append(t2 - t1)
    mem = {}
    for n in sides:
        cmd = [sys.executable, __file__, "--model", args.model, "--memory-of", n,
               "--batch", str(args.batch), "--cap", str(args.cap), "--vocab", str(args.vocab),
               "--micro-batch", str(args.micro_batch), "--seed", str(args.seed)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # a port of its own
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
        mem[n] = json.loads(out.strip().splitlines()[-1])["peak_mib"]
    srt = sorted(lengths)
    print(f"batch {args.batch} rows, cap {args.cap}: median length {srt[len(srt) // 2]}, "
          f"{sum(n == args.cap for n in lengths)} rows at the cap; {real} real tokens of "
          f"{args.batch * args.cap} padded ({real / (args.batch * args.cap):.0%})")
    print(f"padded: micro-batches of {args.micro_batch} rows; packed: token budget "
          f"{args.micro_batch * args.cap}; threads {torch.get_num_threads()}")
    print(f"sanity: first log-probs differ by {lp_diff:.2e} at most; first step loss "
          f"{steps['padded']['loss']:.6f} vs {steps['packed']['loss']:.6f}, grad norm "
          f"{steps['padded']['grad_norm']:.6f} vs {steps['packed']['grad_norm']:.6f}")
    print(f"{'pass':<8}{'padded tok/s':>14}{'packed tok/s':>14}{'packed/padded':>15}")
    for op in ("logp", "train"):
        pad, pk = (real / min(t[(n, op)]) for n in ("padded", "packed"))
        print(f"{op:<8}{pad:>14.0f}{pk:>14.0f}{pk / pad:>14.2f}x")
    print(f"{'peak MiB':<8}{mem['padded']:>14.1f}{mem['packed']:>14.1f}"
          f"{mem['packed'] / max(mem['padded'], 1e-9):>14.2f}x")
    from megarl.backends.megatron.parallel import destroy_distributed

    destroy_distributed()
    if tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
