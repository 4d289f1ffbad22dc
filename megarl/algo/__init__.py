"""RL algorithm math as pure tensor functions: advantages, KL estimators, policy losses.

Nothing here knows about processes, Ray, Megatron or config objects (except the one
``make_actor_loss_from_config`` adapter); every function takes tensors and returns tensors, so
tests check them against hand-computed numbers. See docs/algorithms.md.
"""
from .advantages import (ADV_ESTIMATORS, broadcast_to_tokens, compute_advantages,
                         drgrpo_advantages, group_index, grpo_advantages,
                         reinforce_plus_plus_advantages,
                         reinforce_plus_plus_baseline_advantages, rloo_advantages)
from .aggregate import AGG_MODES, aggregate, global_denom
from .kl import KL_KINDS, adaptive_kl_coef, apply_kl_in_reward, kl_penalty
from .losses import MAX_STATS, TIS_LEVELS, aggregate_entropy, ppo_policy_loss
from .staleness import sample_staleness, staleness_mask

__all__ = ["ADV_ESTIMATORS", "AGG_MODES", "KL_KINDS", "MAX_STATS", "TIS_LEVELS",
           "adaptive_kl_coef", "aggregate", "aggregate_entropy", "apply_kl_in_reward",
           "broadcast_to_tokens", "compute_advantages", "drgrpo_advantages", "global_denom",
           "group_index", "grpo_advantages", "kl_penalty", "ppo_policy_loss",
           "reinforce_plus_plus_advantages", "reinforce_plus_plus_baseline_advantages",
           "rloo_advantages", "sample_staleness", "staleness_mask"]
