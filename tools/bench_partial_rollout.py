"""Step time of generation with partial rollout against without it, on long-tailed lengths.

Both sides run the same embedded engine, prompts, sampling seeds and number of steps, in this
one process, their steps alternating, each followed by a version bump (what a weight sync
does to the engine, minus the copy). Besides wall time it reports the engine's batched
forward passes per step, which no other load on the machine can skew. Every step must deliver `--batch` complete prompt groups
of `--n` samples:

- `full`: the step generates its batch and waits for the longest response (today's default);
- `partial`: `megarl.controller.partial.PartialRollout` keeps batch + `--over` groups in flight,
  stops once `--batch` are complete, caches the rest and resumes them next step.

Response lengths are long-tailed the way RL's are: mostly set by the prompt (a hard problem
gets a long answer) plus per-sample noise. Each prompt gets a difficulty drawn log-normally
(median `--median-len` tokens, `--sigma`), each sample that times a log-normal noise
(`--noise`), capped at `--max-new-tokens`; the engine is told that exact budget with
`ignore_eos`, so both sides produce identical lengths for identical prompts. The first step
of each side (empty cache) is not counted.

    python tools/bench_partial_rollout.py [--steps 6 --batch 8 --n 4 --over 4 ...]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.controller.partial import PartialRollout  # noqa: E402
from megarl.controller.trajectory import TrajectoryRunner  # noqa: E402
from megarl.data.dataset import Prompt  # noqa: E402
from megarl.data.loader import PromptLoader  # noqa: E402
from megarl.rollout.engine import EmbeddedEngine  # noqa: E402
from megarl.rollout.manager import RolloutManager  # noqa: E402
from megarl.rollout.protocol import GenerateRequest, SamplingParams  # noqa: E402
from megarl.utils.tiny_model import make_tiny_model  # noqa: E402


def prompts(count: int) -> list[Prompt]:
    return [Prompt(index=i, uid=f"p{i}", prompt_ids=[3 + i % 97, 5, 7 + i % 31], raw_prompt="",
                   data_source="bench", ground_truth="") for i in range(count)]


async def bump(engine, version: int) -> None:
    await engine.begin_weight_update()
    await engine.end_weight_update(weight_version=str(version))


def length_of(args, prompt_index: int, sample: int) -> int:
    """The budget of one sample: prompt difficulty x sample noise (seeded, heavy-tailed)."""
    rp = random.Random(args.seed * 7919 + prompt_index)
    difficulty = math.exp(rp.gauss(math.log(args.median_len), args.sigma))
    rs = random.Random(args.seed * 104_729 + prompt_index * 131 + sample)
    return max(1, min(args.max_new_tokens, round(difficulty * math.exp(rs.gauss(0, args.noise)))))


class Side:
    """One way of generating a step's batch, with its own loader (same prompts, same order)."""

    def __init__(self, engine, args, partial: bool):
        self.engine, self.args, self.partial = engine, args, partial
        self.loader = PromptLoader(prompts(args.batch * (args.steps + 4) * 2), args.batch,
                                   shuffle=False)
        self.mgr = RolloutManager([engine])
        self.pr = PartialRollout(
            TrajectoryRunner(self.mgr, engine.tokenizer), self.loader, n=args.n,
            need=args.batch, over=args.over,
            sampling_for=lambda p, i, sp: dataclasses.replace(
                sp, max_new_tokens=length_of(args, p.index, i))) if partial else None
        self.times, self.model_steps, self.tokens, self.spans, self.ratio = [], [], 0, [], []

    async def full_step(self, k: int, sp: SamplingParams) -> list:
        """Today's GENERATE: every sample of the batch, to the end (same budgets)."""
        async def one(p, i):
            req = GenerateRequest(list(p.prompt_ids), dataclasses.replace(
                sp, n=1, max_new_tokens=length_of(self.args, p.index, i),
                sampling_seed=sp.sampling_seed * 1_000_003 + i), True, f"s{k}-{p.uid}-{i}")
            return await self.mgr.generate(req)
        batch = self.loader.next_batch()
        return await asyncio.gather(*[one(p, i) for p in batch for i in range(self.args.n)])

    async def step(self, k: int, version: int) -> None:
        a, eng = self.args, self.engine
        sp = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=1.0, n=a.n,
                            ignore_eos=True, sampling_seed=a.seed + k)
        steps0 = eng.model_steps
        t0 = time.perf_counter()
        if self.pr is not None:
            samples, _, m, _ = await self.pr.run_step(k, sp, version)
            self.spans.append(m["rollout/partial/versions_spanned_max"])
            self.ratio.append(m["rollout/partial/ratio"])
            lengths = [len(s.response_ids) for s in samples]
        else:
            lengths = [len(o.output_ids) for o in await self.full_step(k, sp)]
        dt = time.perf_counter() - t0
        assert len(lengths) == a.batch * a.n
        if k > 0:  # the first step of partial rollout starts from an empty cache
            self.times.append(dt)
            self.model_steps.append(eng.model_steps - steps0)
            self.tokens += sum(lengths)

    def summary(self) -> dict:
        return {"step_s": statistics.mean(self.times),
                "step_s_median": statistics.median(self.times),
                "model_steps": statistics.mean(self.model_steps),
                "tokens_per_step": self.tokens / len(self.times),
                "versions_spanned_max": max(self.spans, default=1),
                "partial_ratio": statistics.mean(self.ratio) if self.ratio else 0.0}


async def run(engine, args) -> tuple[dict, dict]:
    """Steps alternate between the two sides, so a machine whose load drifts (other jobs)
    slows both alike; each step is followed by a version bump, as after a sync."""
    full, part = Side(engine, args, False), Side(engine, args, True)
    version = 0
    await bump(engine, version)
    for k in range(args.steps):
        for side in (full, part):
            await side.step(k, version)
            version += 1
            await bump(engine, version)
    return full.summary(), part.summary()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8, help="prompt groups a step trains")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--over", type=int, default=8, help="extra groups in flight (partial)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--median-len", type=float, default=48.0)
    p.add_argument("--sigma", type=float, default=0.9, help="log-normal spread over prompts")
    p.add_argument("--noise", type=float, default=0.3, help="log-normal spread per sample")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_model(Path(d) / "m", "qwen2", num_layers=args.layers,
                                hidden_size=args.hidden)
        engine = EmbeddedEngine(model, weight_version="0", seed=1, max_running_requests=256)

        async def go():
            try:
                return await run(engine, args)
            finally:
                await engine.close()

        full, part = asyncio.run(go())
    print(f"workload: {args.steps - 1} counted steps x {args.batch} groups x n={args.n}; "
          f"lengths: median {args.median_len:.0f}, prompt sigma {args.sigma}, sample noise "
          f"{args.noise}, cap {args.max_new_tokens}")
    print(f"{'':10s}{'step s':>10s}{'median':>10s}{'fwd/step':>10s}{'tok/step':>10s}")
    for name, r in (("full", full), ("partial", part)):
        print(f"{name:10s}{r['step_s']:10.3f}{r['step_s_median']:10.3f}"
              f"{r['model_steps']:10.0f}{r['tokens_per_step']:10.0f}")
    print(f"partial: resumed-sample ratio {part['partial_ratio']:.2f}, max versions spanned "
          f"by one trajectory {part['versions_spanned_max']:.0f}")
    print(f"step time ratio partial/full: {part['step_s'] / full['step_s']:.2f} "
          f"(median {part['step_s_median'] / full['step_s_median']:.2f}); model forward "
          f"passes per step ratio: {part['model_steps'] / full['model_steps']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
