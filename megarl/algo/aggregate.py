"""Loss aggregation: per-token values [b, T] + mask -> one number, micro-batch-safe.

Modes (verl's names):
- ``token-mean``:          sum_{i,t} v[i,t] m[i,t] / D,  D = valid tokens in the whole batch
- ``seq-mean-token-sum``:  sum_i (sum_t v[i,t] m[i,t]) / D,  D = sequences in the whole batch
- ``seq-mean-token-mean``: sum_i (sum_t v[i,t] m[i,t] / max(1, sum_t m[i,t])) / D,  D as above

A "sequence" is a row with at least one valid token (all-masked padding rows never count).
With ``denom=None`` D is taken from the tensors given, i.e. the plain mean of this micro-batch.
With ``denom`` set to `global_denom(mask_of_the_whole_batch, mode)`, each micro-batch returns
its *share* of the batch value, and summing the shares over micro-batches gives exactly the
value computed on the whole batch at once (the Megatron worker sums them). All-masked inputs
give 0, never NaN.
"""
from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def _check(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose from {AGG_MODES}")


def global_denom(mask: torch.Tensor, mode: str) -> float:
    """The normaliser D of `mode` for a whole batch's mask [B, T] (at least 1)."""
    _check(mode)
    if mode == "token-mean":
        return max(1.0, float(mask.sum()))
    return max(1.0, float((mask.sum(-1) > 0).sum()))


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              denom: float | torch.Tensor | None = None) -> torch.Tensor:
    """Aggregate per-token `values` [b, T] over `mask` [b, T] (see the module docstring)."""
    _check(mode)
    mask = mask.to(values.dtype)
    if denom is None:
        denom = global_denom(mask, mode)
    masked = values * mask
    if mode == "token-mean":
        return masked.sum() / denom
    per_seq = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / denom


def stats_mode(mode: str) -> str:
    """The mode used for diagnostics under loss mode `mode`: a mean per token (token-mean) or
    per sequence (seq-mean-token-mean), so fractions stay fractions; same D as the loss."""
    _check(mode)
    return "token-mean" if mode == "token-mean" else "seq-mean-token-mean"
