"""Per-step scalar metrics under hierarchical names, and the arithmetic behind the pipeline ones.

Owns metric *names* and the math that turns a pipeline timeline into them (timing per state
and per group, idle ratio, weight-sync time) or turns sample versions into staleness. Values
come from elsewhere: the driver feeds rewards, lengths and the trainer's `actor/*` dict in.

Names:
  timing/<state>             seconds of that state's work for the step (generate, reward,
                             ref_logp, logp, train, sync, val_generate, val_score)
  timing/step                the step's period: previous SYNC's end to this SYNC's end
  timing_group/<group>/busy  seconds the group worked inside the step's period
  perf/idle_ratio/<group>    1 - busy / period
  weight_sync/time_s         seconds of SYNC (the trainer's part: the snapshot with dual buffer)
  rollout/staleness_min|mean|max   trainer version - sample version, over the step's samples
  perf/throughput_tokens_per_s     tokens (prompt + response) / seconds of the step's TRAIN
  reward/mean, response/length_mean, actor/* (kl, entropy, clip fraction, log-prob mismatch)
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping, Sequence

TIMING_NAME = {"generate": "generate", "reward": "reward", "ref_logp": "ref_logp",
               "logp": "logp", "actor-train": "train", "sync": "sync", "checkpoint": "checkpoint",
               "val-generate": "val_generate", "val-score": "val_score",
               "tool": "tool"}  # multi-turn: the step's tool calls (their union)
"""Pipeline task -> the `timing/<name>` it reports under."""


def merge_spans(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def busy_time(intervals: Iterable, window: tuple[float, float]) -> dict[str, float]:
    """group -> seconds it was busy inside `window`; intervals have .group, .start, .end."""
    lo, hi = window
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for iv in intervals:
        s, e = max(iv.start, lo), min(iv.end, hi)
        spans[iv.group].append((s, max(s, e)))
    return {g: sum(e - s for s, e in merge_spans(sp)) for g, sp in spans.items()}


def idle_ratio(intervals: Iterable, window: tuple[float, float],
               groups: Iterable[str] = ()) -> dict[str, float]:
    """group -> idle time / window length inside `window` (groups never busy: 1.0).

    Overlapping intervals of one group count once. An empty window gives 0.0.
    """
    intervals = list(intervals)
    busy = busy_time(intervals, window)
    length = window[1] - window[0]
    names = set(busy) | set(groups)
    if length <= 0:
        return {g: 0.0 for g in names}
    return {g: 1.0 - busy.get(g, 0.0) / length for g in names}


def timing_metrics(intervals: Sequence, step: int, window: tuple[float, float],
                   groups: Iterable[str] = ()) -> dict[str, float]:
    """timing/*, timing_group/*/busy, perf/idle_ratio/* and weight_sync/time_s for `step`."""
    out: dict[str, float] = {}
    for iv in intervals:
        if iv.step == step:
            name = f"timing/{TIMING_NAME.get(iv.task, iv.task)}"
            out[name] = out.get(name, 0.0) + (iv.end - iv.start)
    out["timing/step"] = window[1] - window[0]
    if "timing/sync" in out:
        out["weight_sync/time_s"] = out["timing/sync"]
    busy = busy_time(intervals, window)
    for g, ratio in sorted(idle_ratio(intervals, window, groups).items()):
        out[f"timing_group/{g}/busy"] = busy.get(g, 0.0)
        out[f"perf/idle_ratio/{g}"] = ratio
    return out


def pipeline_step_metrics(pipeline, step: int) -> dict[str, float]:
    """`timing_metrics` for a finished SYNC(step) of a `megarl.controller.machine.Pipeline`."""
    groups = {g for t, g in pipeline.groups.items() if not t.startswith("val-")}
    return timing_metrics(pipeline.timeline, step, pipeline.step_window(step), groups)


def staleness_metrics(trainer_version: int, sample_versions: Iterable[int]) -> dict[str, float]:
    """rollout/staleness_* : versions the trainer is ahead of each sample's (first) version."""
    behind = [trainer_version - v for v in sample_versions]
    if not behind:
        return {}
    return {"rollout/staleness_min": float(min(behind)),
            "rollout/staleness_mean": sum(behind) / len(behind),
            "rollout/staleness_max": float(max(behind))}


def throughput(tokens: int, seconds: float) -> dict[str, float]:
    return {"perf/throughput_tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


class MetricsTracker:
    """Collects scalar metrics per step.

    `set` records a value (last wins); `add` accumulates values whose mean is reported (e.g.
    `actor/*` per micro-batch). `pop(step)` returns the step's metrics, sorted by name, and
    forgets them.
    """

    def __init__(self):
        self._set: dict[int, dict[str, float]] = defaultdict(dict)
        self._sum: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))

    def set(self, step: int, name: str, value: float) -> None:
        self._set[step][name] = float(value)

    def update(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
        for name, value in metrics.items():
            self.set(step, prefix + name, value)

    def add(self, step: int, name: str, value: float) -> None:
        self._sum[step][name].append(float(value))

    def get(self, step: int) -> dict[str, float]:
        out = {n: sum(v) / len(v) for n, v in self._sum.get(step, {}).items() if v}
        out.update(self._set.get(step, {}))
        return dict(sorted(out.items()))

    def pop(self, step: int) -> dict[str, float]:
        out = self.get(step)
        self._set.pop(step, None)
        self._sum.pop(step, None)
        return out

    def steps(self) -> list[int]:
        return sorted(set(self._set) | set(self._sum))
