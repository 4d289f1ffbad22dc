"""Loss aggregation: per-token values [b, T] + mask -> one number, micro-batch-safe.

Modes (verl's names and formulas, verl's ``agg_loss`` applied to the whole mini-batch):
- ``token-mean``:              sum_{i,t} v[i,t] m[i,t] / D,  D = valid tokens in the whole batch
- ``seq-mean-token-sum``:      sum_i (sum_t v[i,t] m[i,t]) / D,  D = sequences in the whole batch
- ``seq-mean-token-mean``:     sum_i (sum_t v[i,t] m[i,t] / max(1, sum_t m[i,t])) / D,  D as above
- ``seq-mean-token-sum-norm``: sum_i (sum_t v[i,t] m[i,t]) / D,  D = (sequences in the whole
  batch) * C: the mean over sequences of each sequence's token sum, divided by a constant C
  (``loss_scale_factor``; verl's fallback is the padded response width, mask.shape[-1]).
  verl >= 0.9.1's definition (core_algos.agg_loss); older verl releases divided the plain
  sum by C alone. With C = the maximum response length this is Dr. GRPO's normaliser.
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
"""Modes whose loss normaliser D is not the count its diagnostics are averaged over
(`stats_mode`): ``token-sum``'s D is the constant 1 (a sum, not a mean), and
``seq-mean-token-sum-norm``'s is (sequences) * C, the sequence count times a constant. So a
batch `denom` of these modes cannot serve as the stats' normaliser: callers pass
``stats_denom`` as well."""


def _check(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose from {AGG_MODES}")


def global_denom(mask: torch.Tensor, mode: str, loss_scale_factor: float | None = None,
                 dp_size: int = 1) -> float:
    """The normaliser D of `mode` for a whole batch's mask [B, T], divided by `dp_size` (the
    data-parallel replicas that average their gradients; see the module docstring).

    Count modes: the count, at least 1. ``seq-mean-token-sum-norm``: (sequences, at least 1)
    * C, C = `loss_scale_factor`, or mask.shape[-1] when None (verl's fallback; pass a
    constant, since a padded width changes from batch to batch). ``token-sum``: 1."""
    _check(mode)
    if mode == "token-sum":
        d = 1.0
    elif mode == "seq-mean-token-sum-norm":
        c = float(mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        if c <= 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {c}")
        d = max(1.0, float((mask.sum(-1) > 0).sum())) * c
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
    if mode in ("token-mean", "token-sum", "seq-mean-token-sum-norm"):
        return masked.sum() / denom  # sum_i sum_t v m / D (D counts sequences * C for -norm)
    per_seq = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / denom


def stats_denom_for(mode: str, denom: float | None, stats_denom: float | None
                    ) -> float | None:
    """The diagnostics' normaliser of a loss under `mode`: `stats_denom` when given, else the
    loss's `denom`, which only the count modes allow (`CONSTANT_DENOM_MODES` divide the loss by
    something that is not the stats' count: they must be given theirs)."""
    if stats_denom is None and denom is not None and mode in CONSTANT_DENOM_MODES:
        raise ValueError(f"loss_agg_mode {mode!r} with a batch denom needs stats_denom "
                         f"(global_denom(batch_mask, {stats_mode(mode)!r})): its denom is not "
                         "the stats' count")
    return denom if stats_denom is None else stats_denom


def stats_mode(mode: str) -> str:
    """The mode used for diagnostics under loss mode `mode`: a mean per token (token-mean,
    token-sum) or per sequence (the seq-* modes), so fractions stay fractions. Its
    normaliser is `global_denom(mask, stats_mode(mode))`: the loss's own D for the count
    modes, a count of its own for `CONSTANT_DENOM_MODES` (for ``seq-mean-token-sum-norm``
    the loss's D divided by C)."""
    _check(mode)
    return "token-mean" if mode in ("token-mean", "token-sum") else "seq-mean-token-mean"
