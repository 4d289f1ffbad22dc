"""The critic's clipped value loss, and the loss function the Megatron worker trains it with.

Per token, with v the critic's new prediction, v_old its prediction when the batch was made
(the VALUES state, before this update), R the GAE return and c = ``critic.cliprange_value``:

    v_clip = clip(v, v_old - c, v_old + c)
    loss_t = max((v - R)^2, (v_clip - R)^2)
    vf_loss = 0.5 * aggregate(loss_t)                     (verl's `compute_value_loss`)

The max keeps PPO's pessimism: a prediction that moved more than c from v_old is not rewarded
for moving further. ``vf_clipfrac`` is the share of tokens where the clipped branch is larger.
Aggregation and the batch-level `denom` (and `stats_denom` for the diagnostics, the count of
`aggregate.stats_mode`) are as in `megarl.algo.aggregate`, so micro-batch shares sum to the
batch value.
"""
from __future__ import annotations

from typing import Callable

import torch

from .aggregate import aggregate, global_denom, stats_mode


def value_loss(vpreds: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, cliprange_value: float, agg: str = "token-mean",
               denom: float | torch.Tensor | None = None,
               stats_denom: float | torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (module doc) -> (loss, stats); every tensor [b, T], `vpreds` alone
    carries a gradient. Stats: ``vf_loss``, ``vf_clipfrac``, ``vpred_mean`` (shares)."""
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    vpreds = vpreds.float()
    old_values = old_values.detach().float()
    returns = returns.detach().float()
    mask = mask.to(vpreds.dtype)
    clipped = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_sq = (vpreds - returns).square()
    clipped_sq = (clipped - returns).square()
    loss = 0.5 * aggregate(torch.maximum(unclipped_sq, clipped_sq), mask, agg, denom)
    smode = stats_mode(agg)
    with torch.no_grad():
        stats = {"vf_loss": loss.detach(),
                 "vf_clipfrac": aggregate((clipped_sq > unclipped_sq).to(mask.dtype), mask,
                                          smode, stats_denom),
                 "vpred_mean": aggregate(vpreds, mask, smode, stats_denom)}
    return loss, stats


CriticLossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def make_critic_loss(cliprange_value: float, loss_agg_mode: str = "token-mean",
                     denom: float | None = None, stats_denom: float | None = None
                     ) -> CriticLossFn:
    """``loss_fn(vpreds [b, S], mb) -> (loss, metrics)`` for `MegatronWorker.train_values`.

    The micro-batch carries ``response_mask``, ``values`` (the VALUES state's predictions)
    and ``returns`` [b, S], all in the token alignment of `vpreds`. Metrics are named
    ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``."""

    def loss_fn(vpreds: torch.Tensor, mb: dict):
        loss, stats = value_loss(vpreds, mb["values"], mb["returns"], mb["response_mask"],
                                 cliprange_value, loss_agg_mode, denom, stats_denom)
        return loss, {f"critic/{k}": v for k, v in stats.items()}

    return loss_fn


def make_critic_loss_for_batch(cliprange_value: float, mode: str,
                                 mini_batch_mask: torch.Tensor, dp_size: int = 1,
                                 loss_scale_factor: float | None = None) -> CriticLossFn:
    """`make_critic_loss` normalised by the whole mini-batch's mask (every data-parallel
    shard of it; `dp_size` replicas average their gradients, see `aggregate.global_denom`)."""
    return make_critic_loss(
        cliprange_value, mode, global_denom(mini_batch_mask, mode, loss_scale_factor, dp_size),
        global_denom(mini_batch_mask, stats_mode(mode), dp_size=dp_size))
