"""Pipeline benchmark: colocated synchronous training vs the async pipeline on separated
groups, the same work side by side (same model, data, batch, steps, seed).

    python tools/bench_pipeline.py [--steps 12 --hidden 128 --layers 4 --response 32]

Prints, per mode, the mean step time (steps after warm-up), the mean GENERATE time and the
train side (REF_LOGP + LOGP + TRAIN + SYNC); then the step-time ratio async/sync and the
overlap efficiency of the async pipeline, max(generate, train side) / async step time
(1.0: one side fully hidden behind the other). On a CPU machine both modes share the same
cores, so overlap is bounded by compute contention; the figure is most telling on GPUs.
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

MODES = {
    "colocated-sync": ["trainer.separated_node_tasks=[[logp,actor-train,ref_logp,generate]]",
                       "trainer.separated_node_ratios=[1.0]", "trainer.n_gpus_per_node=1",
                       "trainer.generate_ahead_steps=1"],
    "async-separated": ["trainer.separated_node_tasks=[[logp,actor-train,ref_logp],[generate]]",
                        "trainer.separated_node_ratios=[0.5,0.5]", "trainer.n_gpus_per_node=2",
                        "trainer.generate_ahead_steps=2"],
}
TRAIN_SIDE = ("timing/ref_logp", "timing/logp", "timing/train", "timing/sync")


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def mean_after(series: dict[int, float], warmup: int) -> float:
    vals = [v for s, v in sorted(series.items()) if s > warmup]
    return sum(vals) / max(1, len(vals))


def run_mode(name: str, base: list[str], work: Path, warmup: int) -> dict:
    from megarl.config import load_config
    from megarl.controller.driver import run

    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"),
                      base + MODES[name] + [f"trainer.experiment_name={name}",
                                            f"trainer.default_local_dir={work}"])
    run(cfg)
    sc = read_scalars(work / "megarl" / name / "tensorboard")
    step = mean_after(sc["timing/step"], warmup)
    gen = mean_after(sc["timing/generate"], warmup)
    train = sum(mean_after(sc[k], warmup) for k in TRAIN_SIDE if k in sc)
    return {"step_s": step, "generate_s": gen, "train_side_s": train}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from megarl.data.synthetic import make_quickstart_task
    from megarl.utils.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench_pipeline-"))
    make_tiny_model(work / "model", "qwen2", hidden_size=a.hidden, num_layers=a.layers,
                    num_heads=4, num_kv_heads=2, intermediate_size=a.hidden * 3)
    make_quickstart_task(work / "data")
    base = [f"actor_rollout_ref.model.path={work / 'model'}",
            f"data.train_files={work / 'data' / 'train.jsonl'}", "data.val_files=null",
            f"data.max_response_length={a.response}", f"data.train_batch_size={a.batch}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={a.batch}",
            f"trainer.total_training_steps={a.steps}", "trainer.save_freq=-1",
            "trainer.test_freq=-1", "trainer.val_before_train=False",
            "trainer.logger=[tensorboard]",
            # always generate the full length, so both modes do exactly the same work
            "actor_rollout_ref.rollout.temperature=1.0"]
    res = {name: run_mode(name, base, work, a.warmup) for name in MODES}
    sync, asy = res["colocated-sync"], res["async-separated"]
    res["step_time_ratio_async_vs_sync"] = asy["step_s"] / sync["step_s"]
    res["overlap_efficiency"] = max(asy["generate_s"], asy["train_side_s"]) / asy["step_s"]
    for name in MODES:
        r = res[name]
        print(f"{name:16s} step {r['step_s']:.3f} s  generate {r['generate_s']:.3f} s  "
              f"train side {r['train_side_s']:.3f} s")
    print(f"step time ratio async/sync: {res['step_time_ratio_async_vs_sync']:.2f}")
    print(f"overlap efficiency (max(generate, train side) / async step): "
          f"{res['overlap_efficiency']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
