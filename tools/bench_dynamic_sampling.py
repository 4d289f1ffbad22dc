"""What dynamic sampling (DAPO's `algorithm.filter_groups`) buys on the main job's task: steps,
samples and seconds to a validation score, side by side with the same run without it.

    python tools/bench_dynamic_sampling.py [--variants grpo,grpo+filter,dapo] [--seeds 0,1]
                                           [--target 0.9] [--steps 400]

Each variant is `megarl train` on the last-digit task (configs/quickstart_solve.yaml, the
README's main job) as the config has it, validated every 25 steps:

    grpo         configs/quickstart_solve.yaml                  (the baseline)
    grpo+filter  the same with algorithm.filter_groups.enable=true
    dapo         configs/dapo_solve.yaml (clip-higher, token-mean, dynamic sampling on the
                 score, overlong penalty, no KL)

For every run: the first validated step with `val/exact_frac` >= target, the responses
generated up to it (prompts drawn x rollout.n: with filtering, every prompt of every
generation batch, dropped ones included), and the seconds of training to it (from the
per-step `timing/step`); then each variant's figures as ratios to the baseline's on the same
seed. Runs go one after another in this process's children, so they share the machine.
The task's data and the tiny model are made by the first run, in a temporary folder, and shared.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = {
    "grpo": ("configs/quickstart_solve.yaml", []),
    "grpo+filter": ("configs/quickstart_solve.yaml", ["algorithm.filter_groups.enable=true"]),
    "dapo": ("configs/dapo_solve.yaml", []),
}


def _scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = next(run_dir.rglob("tensorboard"))
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def run(variant: str, seed: int | None, work: Path, steps: int) -> dict:
    config, extra = VARIANTS[variant]
    out = work / f"{variant}-s{seed}"
    args = [sys.executable, "-m", "megarl.cli", "train", "--config", str(ROOT / config),
            f"actor_rollout_ref.model.path={work / 'tiny'}",
            f"data.train_files={work / 'data' / 'train.jsonl'}",
            f"data.val_files={work / 'data' / 'val.jsonl'}",
            f"trainer.default_local_dir={out}", "trainer.logger=[console,tensorboard]",
            "trainer.test_freq=25", f"trainer.total_training_steps={steps}", *extra]
    if seed is not None:
        args += [f"trainer.seed={seed}", f"data.seed={seed}"]
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if p.returncode != 0:
        raise SystemExit(f"{variant} seed {seed} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return _scalars(out)


def summarise(s: dict, target: float, batch: int, n: int) -> dict:
    exact = s.get("val/exact_frac", {})
    reached = next((k for k in sorted(exact) if exact[k] >= target), None)
    upto = reached if reached is not None else max(exact, default=0)
    consumed = s.get("rollout/filter_groups/prompts_consumed", {})
    # metrics are logged at the 1-based step; validation of weights vK after K steps
    prompts = int(sum(consumed.get(k, batch) for k in range(1, upto + 1)))
    seconds = sum(v for k, v in s.get("timing/step", {}).items() if k <= upto)
    return {"step": reached, "last": upto, "exact": exact.get(upto, float("nan")),
            "samples": prompts * n, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="grpo,grpo+filter,dapo")
    ap.add_argument("--seeds", default="0", help="0 is the configs' own seed")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--steps", type=int, default=400)
    a = ap.parse_args()
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    seeds = [None if s == "0" else int(s) for s in a.seeds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-dynsamp-") as d:
        # the first run makes the tiny model and the task here (the configs' make_tiny and
        # data.synthetic_task, as on a fresh machine); the others share them
        work = Path(d)
        for seed in seeds:
            for v in variants:
                r = summarise(run(v, seed, work, a.steps), a.target, batch=8, n=16)
                rows.append((v, seed, r))
                print(f"{v:12s} seed {seed if seed is not None else 'default'}: "
                      f"exact >= {a.target} at step {r['step']}, {r['samples']} responses, "
                      f"{r['seconds']:.1f} s of steps (exact {r['exact']:.3f} at v{r['last']})",
                      flush=True)
    base = {seed: r for v, seed, r in rows if v == variants[0]}
    print(f"\nratios to {variants[0]} on the same seed (steps, responses, seconds to "
          f"exact >= {a.target}; None: not reached in {a.steps} steps)")
    for v, seed, r in rows:
        b = base.get(seed)
        if b is None or b["step"] is None or r["step"] is None:
            print(f"{v:12s} seed {seed}: step {r['step']} vs {b and b['step']}")
            continue
        print(f"{v:12s} seed {seed if seed is not None else 'default'}: "
              f"steps {r['step'] / b['step']:.2f}x  responses {r['samples'] / b['samples']:.2f}x"
              f"  seconds {r['seconds'] / b['seconds']:.2f}x")


if __name__ == "__main__":
    main()
