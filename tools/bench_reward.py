"""Streaming rewards against score-after-generate, with a slow (50 ms) verifier.

One seeded workload: `--prompts` prompts × `--n` samples from the real embedded engine, each
response's length drawn from a long-tailed distribution (most short, a few long, like RL
rollouts), scored by `megarl.reward.testing:slow_verifier` (sleeps 50 ms, then scores) in a
`RewardPool` of `--workers` processes. Two ways, interleaved, `--repeats` times each:

- **streaming**: each response is submitted to the pool the moment it finishes, so scoring runs
  while the long tail is still generating (what `controller.generation.rollout` does);
- **after**: generate everything, then submit every response to the same pool and wait.

Also timed: generation alone. Medians are printed, with the ratio streaming / after.

    python tools/bench_reward.py [--prompts 16 --n 4 --max-new-tokens 96 --workers 2 ...]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.controller.batch import Sample  # noqa: E402
from megarl.reward.pool import RewardPool  # noqa: E402
from megarl.rollout.engine import EmbeddedEngine  # noqa: E402
from megarl.rollout.protocol import GenerateRequest, SamplingParams  # noqa: E402
from megarl.utils.tiny_model import make_tiny_model  # noqa: E402


def workload(args, vocab: int):
    """(prompt ids, budget, seed) per sample; budgets long-tailed (Pareto, capped)."""
    rng = random.Random(args.seed)
    jobs = []
    for p in range(args.prompts):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(8, 32))]
        for k in range(args.n):
            budget = min(args.max_new_tokens, int(args.min_new_tokens * rng.paretovariate(1.2)))
            jobs.append((prompt, budget, args.seed * 100_000 + p * 100 + k))
    return jobs


async def generate(engine, jobs, on_done=None) -> list[Sample]:
    async def one(prompt, budget, seed):
        sp = SamplingParams(max_new_tokens=budget, temperature=1.0, ignore_eos=True,
                            sampling_seed=seed)
        out = await engine.generate(GenerateRequest(list(prompt), sp, return_logprob=True))
        s = Sample(uid=str(seed), prompt_ids=list(prompt), response_ids=out.output_ids,
                   rollout_logprobs=[], weight_version=0, token_versions=[], finish="length",
                   data_source="bench/slow", response_text=out.text or "", ground_truth=None)
        if on_done is not None:
            on_done(s)
        return s

    return list(await asyncio.gather(*[one(*j) for j in jobs]))


async def run_streaming(engine, pool, jobs) -> float:
    t0 = time.perf_counter()
    futs = []
    await generate(engine, jobs, on_done=lambda s: futs.append(pool.submit(s)))
    await asyncio.gather(*futs)
    return time.perf_counter() - t0


async def run_after(engine, pool, jobs) -> float:
    t0 = time.perf_counter()
    samples = await generate(engine, jobs)
    await asyncio.gather(*[pool.submit(s) for s in samples])
    return time.perf_counter() - t0


async def run_generate_only(engine, jobs) -> float:
    t0 = time.perf_counter()
    await generate(engine, jobs)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--min-new-tokens", type=int, default=8, help="the Pareto scale")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2, help="reward.num_workers")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    tmp = tempfile.TemporaryDirectory()
    model_dir = make_tiny_model(Path(tmp.name) / "model", hidden_size=args.hidden,
                                num_layers=args.layers, intermediate_size=args.hidden * 4,
                                vocab_size=1000)
    engine = EmbeddedEngine(model_dir, max_running_requests=max(64, args.prompts * args.n))
    jobs = workload(args, engine.vocab_size)
    budgets = sorted(b for _, b, _ in jobs)
    pool = RewardPool("megarl.reward.testing:slow_verifier", args.workers, timeout_s=60)

    async def bench():
        await run_after(engine, pool, jobs[:4])  # warm-up: engine kernels, workers started
        times = {"generate only": [], "streaming": [], "after": []}
        for _ in range(args.repeats):  # interleaved: machine load hits every side alike
            times["generate only"].append(await run_generate_only(engine, jobs))
            times["streaming"].append(await run_streaming(engine, pool, jobs))
            times["after"].append(await run_after(engine, pool, jobs))
        return times

    try:
        times = asyncio.run(bench())
        stats = pool.pop_stats()
    finally:
        pool.close()
        asyncio.run(engine.close())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"threads={torch.get_num_threads()} layers={args.layers} hidden={args.hidden} "
          f"samples={len(jobs)} ({args.prompts}x{args.n}) tokens={sum(budgets)} "
          f"len min/median/max={budgets[0]}/{budgets[len(budgets) // 2]}/{budgets[-1]} "
          f"verifier=50ms workers={args.workers} repeats={args.repeats}")
    serial_score = len(jobs) * 0.05 / args.workers
    print(f"scoring alone (ideal, {len(jobs)} x 50 ms / {args.workers} workers): "
          f"{serial_score:.2f}s")
    for k, v in times.items():
        print(f"{k:14} median {med[k]:7.2f}s   runs {' '.join(f'{x:.2f}' for x in v)}")
    paired = statistics.median(a / b for a, b in zip(times["streaming"], times["after"]))
    print(f"ratio streaming/after = {med['streaming'] / med['after']:.2f} (of medians), "
          f"{paired:.2f} (median of interleaved pairs)")
    print(f"reward overhead over generation: "
          f"streaming {med['streaming'] - med['generate only']:+.2f}s, "
          f"after {med['after'] - med['generate only']:+.2f}s")
    print(f"pool: calls={stats['reward/calls']} failures={stats['reward/failures']} "
          f"latency_mean={stats['reward/latency_mean_s'] * 1e3:.1f}ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
