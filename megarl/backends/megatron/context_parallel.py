"""Context parallelism (CP): each sequence split over the CP ranks, attention over the group.

Layout (Megatron's and Transformer Engine's causal-balance layout): a sequence of length L,
a multiple of 2·CP, is cut into 2·CP chunks of c = L / (2·CP) tokens; CP rank r holds chunks
r and 2·CP-1-r, back to back, so every rank holds an early and a late chunk and does the same
causal work. A packed micro-batch (THD) is split sequence by sequence, each sequence padded
to a multiple of 2·CP on its right (the padding is part of its segment, after its real
tokens, so causal attention keeps it from every real token); a rank's packed row is its
chunks of every sequence in pack order. Megatron's RoPE computes the positions of exactly
this layout (`get_pos_emb_on_this_cp_rank`, `_apply_rotary_pos_emb_thd`).

Attention: every rank all-gathers K and V over the CP group (the simple exact form; backward
reduce-scatters their gradients, summing every rank's queries' share), puts them back in
sequence order and attends its own query chunks to the keys at or before each query
(`attention.py`). Per-token outputs (log-probs, entropy, values) are all-gathered the same
way, so every CP rank computes the whole loss, identical on all; the backward of that
gather keeps each rank's own positions (not a sum), and Megatron's schedule (loss × CP) with
its gradient all-reduce over DP × CP (÷ DP·CP) adds the ranks' partial gradients: the CP=1
gradient exactly.

Everything here is layout arithmetic (pure functions) and the two autograd gathers.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def chunk_index(length: int, cp: int, rank: int, offset: int = 0) -> torch.Tensor:
    """Positions (offset + [0, length)) that CP rank `rank` holds, in its order."""
    if length % (2 * cp):
        raise ValueError(f"context parallelism: length {length} is not a multiple of "
                         f"2·CP = {2 * cp}")
    c = length // (2 * cp)
    lo = torch.arange(rank * c, (rank + 1) * c)
    hi = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)
    return torch.cat([lo, hi]) + offset


@functools.lru_cache(maxsize=256)
def _layout(segments: tuple[int, ...], cp: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    offsets = [0]
    for n in segments[:-1]:
        offsets.append(offsets[-1] + n)
    per_rank = tuple(torch.cat([chunk_index(n, cp, r, o) for n, o in zip(segments, offsets)])
                     if segments else torch.zeros(0, dtype=torch.long) for r in range(cp))
    return per_rank, torch.argsort(torch.cat(per_rank))


def local_index(segments: tuple[int, ...], cp: int, rank: int) -> torch.Tensor:
    """Positions of the packed (or single, `segments` = (L,)) sequence(s) that `rank` holds:
    its chunks of each segment, segment after segment."""
    return _layout(tuple(int(n) for n in segments), cp)[0][rank]


def restore_order(segments: tuple[int, ...], cp: int) -> torch.Tensor:
    """Index that puts the rank-major concatenation of every rank's positions (what an
    all-gather returns) back into sequence order."""
    return _layout(tuple(int(n) for n in segments), cp)[1]


def cp_group():
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


class _Gather(torch.autograd.Function):
    """All-gather along dim 0 over `group`; the subclasses say what backward does."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out


class _GatherKeepOwn(_Gather):
    """Backward: this rank's slice of the gradient, not summed (every CP rank computed the
    same loss from the gathered tensor)."""

    @staticmethod
    def backward(ctx, grad):
        r, n = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(n)[r].contiguous(), None


class _GatherSumBack(_Gather):
    """Backward: reduce-scatter (each rank's K/V gradient is the sum of every rank's queries'
    share)."""

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // n, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_sequence(x: torch.Tensor, segments: tuple[int, ...], dim: int, group=None,
                    sum_grads: bool = False) -> torch.Tensor:
    """Every CP rank's positions of `x` (this rank's, along `dim`) in sequence order.
    `sum_grads`: the backward sums the ranks' gradients (K/V inside attention); else each
    rank keeps its own (outputs every rank turns into the same loss)."""
    group = group or cp_group()
    cp = dist.get_world_size(group)
    moved = x.movedim(dim, 0)
    fn = _GatherSumBack if sum_grads else _GatherKeepOwn
    full = fn.apply(moved, group)
    full = full.index_select(0, restore_order(segments, cp).to(full.device))
    return full.movedim(0, dim)


def packed_segments(lengths: list[int], cp: int) -> list[int]:
    """Each sequence's segment in a CP-packed row: its length rounded up to 2·CP."""
    return [round_up(max(1, n), 2 * cp) for n in lengths]
