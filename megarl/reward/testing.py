"""Reward functions for tests and benchmarks (importable by the pool's worker processes)."""
from __future__ import annotations

import os
import time

from megarl.reward.registry import default_compute_score

SLOW_VERIFIER_S = 0.05


def slow_verifier(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """A stand-in for an expensive verifier: sleeps 50 ms, then scores by data source (or by
    response length when the data source has no built-in scorer)."""
    time.sleep(SLOW_VERIFIER_S)
    try:
        value = default_compute_score(data_source, solution_str, ground_truth, extra_info)
        return float(value["score"] if isinstance(value, dict) else value)  # math_dapo: a dict
    except ValueError:
        return min(1.0, len(solution_str) / 100.0)


def length_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return float(len(solution_str))


def raises(data_source, solution_str, ground_truth, extra_info=None) -> float:
    raise RuntimeError(f"verifier broke on {solution_str!r}")


def sleeps(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Sleeps ``float(ground_truth)`` seconds, then scores 1: a hung verifier on demand."""
    time.sleep(float(ground_truth))
    return 1.0


def hard_exit(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Kills its own process when asked to ("exit"); a crash the pool must survive."""
    if solution_str == "exit":
        os._exit(3)
    return 2.0


def returns_junk(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float("nan")} if solution_str == "nan" else "not a number"


def constant_for_even(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 whatever the response when ``ground_truth`` is an even number (every group of such a
    prompt has no spread), else the response's length: for dynamic sampling's tests."""
    return 1.0 if int(ground_truth) % 2 == 0 else float(len(solution_str))


def scored_in_parts(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """The built-in score and a brevity term as a dict of components (GDPO's input, as verl's
    reward functions return them): ``acc`` the built-in score, ``brevity`` 1 / (1 + characters);
    ``score`` their sum."""
    value = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    acc = float(value["score"] if isinstance(value, dict) else value)
    brevity = 1.0 / (1.0 + len(solution_str))
    return {"score": acc + brevity, "acc": acc, "brevity": brevity}
