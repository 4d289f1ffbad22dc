"""Loss aggregation: per-token values [b, T] + mask -> one number, micro-batch-safe.

Modes (verl's names and formulas, verl's ``agg_loss`` applied to the whole mini-batch):
- ``token-mean``:              sum_{i,t} v[i,t] m[i,t] / D,  D = valid tokens in the whole batch
- ``seq-mean-token-sum``:      sum_i (sum_t v[i,t] m[i,t]) / D,  D = sequences in the whole batch
- ``seq-mean-token-mean``:     sum_i (sum_t v[i,t] m[i,t] / max(1, sum_t m[i,t])) / D,  D as above
- ``seq-mean-token-sum-norm``: sum_{i,t} v[i,t] m[i,t] / C,  C a constant (``loss_scale_factor``;
  verl's fallback is the padded response width, mask.shape[-1]); no division by a count, so
  the value grows with the batch (Dr. GRPO's constant normaliser)
- ``token-sum``:               sum_{i,t} v[i,t] m[i,t]  (D = 1)

A "sequence" is a row with at least one valid token (all-masked padding rows never count).
With ``denom=None`` D is taken from the tensors given, i.e. the plain mean of this micro-batch.
With ``denom`` set to `global_denom(mask_of_the_whole_batch, mode)`, each micro-batch returns
its *share* of the batch value, and summing the shares over micro-batches gives exactly the
value computed on the whole batch at once (the Megatron worker sums them). Across n
data-parallel replicas, whose gradients (and metrics) are *averaged*, each replica uses
`global_denom(mask_of_the_whole_batch, mode, dp_size=n)` = D / n on its shard, so the average
of the replicas' sums is again the whole-batch value (verl's ``* dp_size``).
All-masked inputs give 0, never NaN.
"""
from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm", "token-sum")
CONSTANT_DENOM_MODES = ("seq-mean-token-sum-norm", "token-sum")
"""Modes whose normaliser is a constant, not a count of the batch: sums, not means."""


def _check(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose from {AGG_MODES}")


def global_denom(mask: torch.Tensor, mode: str, loss_scale_factor: float | None = None,
                 dp_size: int = 1) -> float:
    """The normaliser D of `mode` for a whole batch's mask [B, T], divided by `dp_size` (the
    data-parallel replicas that average their gradients; see the module docstring).

    Count modes: the count, at least 1. ``seq-mean-token-sum-norm``: C = `loss_scale_factor`,
    or mask.shape[-1] when None (verl's fallback; pass a constant, since a padded width
    changes from batch to batch). ``token-sum``: 1."""
    _check(mode)
    if mode == "token-sum":
        d = 1.0
    elif mode == "seq-mean-token-sum-norm":
        d = float(mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        if d <= 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {d}")
    elif mode == "token-mean":
        d = max(1.0, float(mask.sum()))
    else:
        d = max(1.0, float((mask.sum(-1) > 0).sum()))
    return d / dp_size


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              denom: float | torch.Tensor | None = None) -> torch.Tensor:
    """Aggregate per-token `values` [b, T] over `mask` [b, T] (see the module docstring)."""
    _check(mode)
    mask = mask.to(values.dtype)
    if denom is None:
        denom = global_denom(mask, mode)
    masked = values * mask
    if mode in ("token-mean", *CONSTANT_DENOM_MODES):
        return masked.sum() / denom
    per_seq = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / denom


def stats_mode(mode: str) -> str:
    """The mode used for diagnostics under loss mode `mode`: a mean per token (token-mean,
    token-sum) or per sequence (the seq-* modes), so fractions stay fractions. Its
    normaliser is `global_denom(mask, stats_mode(mode))`: the loss's own D for the count
    modes, a count of its own for `CONSTANT_DENOM_MODES`."""
    _check(mode)
    return "token-mean" if mode in ("token-mean", "token-sum") else "seq-mean-token-mean"
