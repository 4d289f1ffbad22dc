"""Idle ratio and timing arithmetic, staleness, the tracker."""
from collections import namedtuple

import pytest

from megarl.controller.machine import Pipeline, simulate, task_groups
from megarl.observability.metrics import (MetricsTracker, busy_time, idle_ratio,
                                          pipeline_step_metrics, staleness_metrics, throughput,
                                          timing_metrics)

I = namedtuple("I", "group task step start end")


def test_idle_ratio_by_hand():
    tl = [I("gen", "generate", 0, 0, 4), I("gen", "generate", 1, 4, 8),
          I("train", "actor-train", 0, 5, 7), I("train", "sync", 0, 7, 8),
          I("train", "logp", 1, 9, 12)]          # clipped to the window
    ratio = idle_ratio(tl, (2, 10), groups=["reward"])
    assert ratio == pytest.approx({"gen": 1 - 6 / 8, "train": 1 - 4 / 8, "reward": 1.0})


def test_overlapping_intervals_count_once_and_empty_window():
    tl = [I("g", "a", 0, 0, 3), I("g", "b", 0, 2, 5), I("g", "c", 0, 7, 8)]
    assert busy_time(tl, (0, 10)) == {"g": 6}
    assert idle_ratio(tl, (3, 3)) == {"g": 0.0}


def test_timing_metrics_names():
    tl = [I("gen", "generate", 1, 0, 4), I("train", "actor-train", 1, 4, 6),
          I("train", "sync", 1, 6, 6.5), I("gen", "generate", 2, 4, 8)]
    m = timing_metrics(tl, 1, (0, 8))
    assert m["timing/generate"] == 4 and m["timing/train"] == 2 and m["timing/sync"] == 0.5
    assert m["weight_sync/time_s"] == 0.5 and m["timing/step"] == 8
    assert m["timing_group/gen/busy"] == 8 and m["perf/idle_ratio/gen"] == 0
    assert m["timing_group/train/busy"] == 2.5
    assert m["perf/idle_ratio/train"] == pytest.approx(1 - 2.5 / 8)


def test_pipeline_metrics_show_overlap():
    groups = task_groups([["logp", "actor-train", "ref_logp"], "generate"])
    dur = {"generate": 4, "actor-train": 2, "sync": 1, "logp": 1}
    p = Pipeline(2, 5, groups=groups, clock=lambda: 0.0)
    simulate(p, dur)
    m = pipeline_step_metrics(p, 3)          # steady state: generate-bound, period 4 s
    assert m["timing/step"] == 4 and m["perf/idle_ratio/generate"] == 0
    assert m["perf/idle_ratio/logp+actor-train+ref_logp"] == pytest.approx(0)  # 1+2+1 of 4
    assert m["perf/idle_ratio/reward"] == 1.0


def test_staleness_and_throughput():
    assert staleness_metrics(5, [4, 4, 3, 5]) == {
        "rollout/staleness_min": 0, "rollout/staleness_mean": 1.0, "rollout/staleness_max": 2}
    assert staleness_metrics(5, []) == {}
    assert throughput(1000, 4) == {"perf/throughput_tokens_per_s": 250}
    assert throughput(10, 0)["perf/throughput_tokens_per_s"] == 0


def test_tracker():
    t = MetricsTracker()
    t.add(1, "actor/kl", 1.0)
    t.add(1, "actor/kl", 3.0)
    t.set(1, "reward/mean", 0.5)
    t.update(1, {"generate": 2.0}, prefix="timing/")
    t.set(2, "reward/mean", 0.7)
    assert t.steps() == [1, 2]
    assert t.pop(1) == {"actor/kl": 2.0, "reward/mean": 0.5, "timing/generate": 2.0}
    assert t.steps() == [2] and t.get(1) == {}
