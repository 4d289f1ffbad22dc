"""Rewards: built-in scorers (quickstart, math exact-match, sandboxed code execution, and
verl 0.9.1's scorers for its data sources), the ``reward.reward_fn`` registry, synchronous
batch scoring, and the streaming process pool."""
from megarl.reward.pool import RewardPool
from megarl.reward.registry import (DATA_SOURCES, default_compute_score, load_reward_fn,
                                    score_batch)

__all__ = ["DATA_SOURCES", "RewardPool", "default_compute_score", "load_reward_fn",
           "score_batch"]
