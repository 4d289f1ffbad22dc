"""Routing replay (R3) against none: the train-rollout log-prob mismatch of one run each.

    python tools/bench_routing_replay.py [--steps 20] [--ep 2] [--out DIR] [override ...]

Runs the quickstart task on a tiny Qwen3-MoE twice, the same config and seeds, on-policy
(generate_ahead_steps=1, so the mismatch is the engine's and the trainer's computations, not
staleness), with the trainer in bfloat16 and the engines in float32 (where routers split near
ties differently): once with every router routing by itself, once replaying the engines'
experts (`rollout.enable_rollout_routing_replay` + `actor.router_replay.mode=R3`). Prints each
run's mean `rollout/logp_mismatch_mean` and `_max` over its steps, and their ratio. Extra
arguments are config overrides for both runs (e.g. a model path of your own).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "megarl" / "t" / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def run(work: Path, name: str, steps: int, ep: int, extra: list[str]) -> dict[str, float]:
    run_dir = work / name
    args = [sys.executable, "-m", "megarl.cli", "train", "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            f"actor_rollout_ref.model.path={work / 'moe'}",
            "actor_rollout_ref.model.make_tiny=qwen3_moe",
            f"data.train_files={work / 'data' / 'train.jsonl'}",
            f"data.val_files={work / 'data' / 'val.jsonl'}",
            f"trainer.default_local_dir={run_dir}", "trainer.experiment_name=t",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
            "trainer.val_before_train=False", "trainer.save_freq=-1",
            "trainer.generate_ahead_steps=1", f"trainer.n_gpus_per_node={2 * ep}",
            f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep}",
            "actor_rollout_ref.actor.megatron.params_dtype=bfloat16",
            "actor_rollout_ref.ref.megatron.params_dtype=bfloat16",
            "actor_rollout_ref.rollout.dtype=float32"]
    if name == "replay":
        args += ["actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                 "actor_rollout_ref.actor.router_replay.mode=R3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(args + extra, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    mean = scalars(run_dir, "rollout/logp_mismatch_mean")
    peak = scalars(run_dir, "rollout/logp_mismatch_max")
    return {"mean": sum(mean.values()) / len(mean), "max": sum(peak.values()) / len(peak)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--out", help="work directory (default: a temporary one)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    work = Path(a.out or tempfile.mkdtemp(prefix="megarl-r3-"))
    got = {name: run(work, name, a.steps, a.ep, a.overrides) for name in ("none", "replay")}
    print(f"{'routing':<8} {'logp_mismatch_mean':>20} {'logp_mismatch_max':>18}  "
          f"({a.steps} on-policy steps, EP={a.ep}, trainer bf16, engines fp32)")
    for name, r in got.items():
        print(f"{name:<8} {r['mean']:>20.5f} {r['max']:>18.5f}")
    print(f"{'ratio':<8} {got['replay']['mean'] / got['none']['mean']:>20.3f} "
          f"{got['replay']['max'] / got['none']['max']:>18.3f}  (replay / none)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
