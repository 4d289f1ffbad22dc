"""The planner against real runs: predicted vs measured step time of task-group layouts.

    python tools/bench_planner.py                 # the quickstart on 4 CPU devices
    python tools/bench_planner.py --steps 16 --devices 4

One profiling run (the quickstart's own layout) gives the per-task durations, as `megarl plan`
takes them; then every layout below is both predicted by `planner.predict` and run for real
with the same config, and its measured step time (median `timing/step` past the warm-up) is
set beside the predictions under both device scalings (`planner.SCALINGS`: "linear", for
accelerators, and "none", which `megarl plan` uses for CPU devices). The report says, per
layout, predicted / measured and whether it is inside ±15%, and whether each scaling's first
choice is the fastest measured.

The layouts: the colocated one, the quickstart's, and both layouts of the seed's usage example
(`[[logp,actor-train],ref_logp,generate]` and the fully separated
`[logp,ref_logp,actor-train,generate]`, where logp runs on a frozen replica of its own).
On one 2-core machine the "devices" are processes sharing two cores: more of them make no task
faster, which is why `megarl plan` does not scale CPU devices; the report checks both models.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megarl.controller import planner  # noqa: E402

LAYOUTS = {
    "colocated, ahead 1": ([["logp", "actor-train", "ref_logp", "generate"]], [1.0], 1),
    "trainer | generate, ahead 2 (quickstart)": (
        [["logp", "actor-train", "ref_logp"], ["generate"]], [0.5, 0.5], 2),
    "trainer+ref 3/4 | generate 1/4, ahead 2": (
        [["logp", "actor-train", "ref_logp"], ["generate"]], [0.75, 0.25], 2),
    "[logp,actor-train] | ref_logp | generate (seed), ahead 2": (
        [["logp", "actor-train"], ["ref_logp"], ["generate"]], [0.5, 0.25, 0.25], 2),
    "logp | ref_logp | actor-train | generate (seed), ahead 2": (
        [["logp"], ["ref_logp"], ["actor-train"], ["generate"]], [0.25] * 4, 2),
}


def _run(out: Path, name: str, groups, ratios, ahead: int, steps: int, devices: int) -> Path:
    tasks = ",".join(f"[{','.join(g)}]" for g in groups)
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config",
           str(ROOT / "configs" / "quickstart.yaml"), f"trainer.default_local_dir={out}",
           f"trainer.experiment_name={name}", f"trainer.total_training_steps={steps}",
           f"trainer.n_gpus_per_node={devices}", f"trainer.separated_node_tasks=[{tasks}]",
           f"trainer.separated_node_ratios=[{','.join(map(str, ratios))}]",
           f"actor_rollout_ref.async_pipeline={ahead > 1}",
           f"trainer.generate_ahead_steps={ahead}", "trainer.save_freq=-1",
           "trainer.test_freq=-1", "trainer.val_before_train=False",
           f"trainer.timeline_freq={steps}", "trainer.logger=[console]",
           "trainer.resume_mode=disable"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return out / "megarl" / name  # the quickstart's project_name is megarl


def _measured_step(run: Path) -> float:
    """Median step period past the warm-up: the same SYNC-to-SYNC window as timing/step."""
    events = [e for e in json.loads((run / "timeline.json").read_text())["traceEvents"]
              if e.get("ph") == "X" and e["cat"] == "sync"]
    ends = sorted((e["args"]["step"], (e["ts"] + e["dur"]) / 1e6) for e in events)
    periods = [b - a for (_, a), (_, b) in zip(ends, ends[1:])][planner.WARMUP_STEPS:]
    return statistics.median(periods)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--devices", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as tmp:
        out = Path(tmp)
        groups, ratios, ahead = LAYOUTS["trainer | generate, ahead 2 (quickstart)"]
        m = planner.measure(_run(out, "profile", groups, ratios, ahead, args.steps,
                                 args.devices))
        print("measured:", ", ".join(f"{t} {s:.3f}s" for t, s in sorted(m.seconds.items())))
        rows = []
        for i, (label, (groups, ratios, ahead)) in enumerate(LAYOUTS.items()):
            devices = [round(r * args.devices) for r in ratios]
            layout = [tuple(g) for g in groups]
            linear, _ = planner.predict(m, layout, devices, ahead, scaling="linear")
            none, _ = planner.predict(m, layout, devices, ahead, scaling="none")
            measured = _measured_step(_run(out, f"l{i}", groups, ratios, ahead, args.steps,
                                           args.devices))
            rows.append((label, linear, none, measured))
    print(f"\n{'layout':<58} {'measured s':>10} {'linear s':>8} {'ratio':>5} "
          f"{'none s':>6} {'ratio':>5}  ±15% (none)")
    for label, lin, none, q in rows:
        print(f"{label:<58} {q:>10.3f} {lin:>8.3f} {lin / q:>5.2f} {none:>6.3f} "
              f"{none / q:>5.2f}  {'yes' if abs(none / q - 1) <= 0.15 else 'no'}")
    fastest = min(rows, key=lambda r: r[3])[0]
    print(f"\nfastest measured: {fastest}")
    for name, col in (("linear", 1), ("none", 2)):
        low = min(r[col] for r in rows)
        tied = [r[0] for r in rows if r[col] <= low * 1.005]  # equal to the simulation's grain
        print(f"first choice, scaling {name:<6}: {' = '.join(tied)} "
              f"({'includes' if fastest in tied else 'misses'} the fastest)")
    print(f"(megarl plan uses scaling {planner.default_scaling('cpu')!r} for trainer.device=cpu)")

if __name__ == "__main__":
    main()
