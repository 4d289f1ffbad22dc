"""Rewards: built-in scorers (quickstart, math exact-match), the ``reward.reward_fn``
registry, and synchronous batch scoring."""
from megarl.reward.registry import (DATA_SOURCES, default_compute_score, load_reward_fn,
                                    score_batch)

__all__ = ["DATA_SOURCES", "default_compute_score", "load_reward_fn", "score_batch"]
