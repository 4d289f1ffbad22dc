"""RL algorithm math as pure tensor functions: advantages, KL estimators, policy losses.

Nothing here knows about processes, Ray, Megatron or config objects (except the one
``make_actor_loss_from_config`` adapter); every function takes tensors and returns tensors, so
tests check them against hand-computed numbers. See docs/algorithms.md.
"""
from .advantages import broadcast_to_tokens, grpo_advantages, group_index
from .aggregate import AGG_MODES, aggregate, global_denom
from .kl import KL_KINDS, kl_penalty
from .losses import MAX_STATS, aggregate_entropy, ppo_policy_loss

__all__ = ["AGG_MODES", "KL_KINDS", "MAX_STATS", "aggregate", "aggregate_entropy",
           "broadcast_to_tokens", "global_denom", "group_index", "grpo_advantages", "kl_penalty",
           "ppo_policy_loss"]
