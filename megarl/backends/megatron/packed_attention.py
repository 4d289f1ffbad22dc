"""Packed (THD) attention, planned once per micro-batch and shared by every layer.

Every layer's core attention receives the same `PackedSeqParams` object for a micro-batch
(recompute's second forward too). What attention derives from its `cu_seqlens` is computed
by the first layer that asks and kept on that object (`plan_of`), so the other layers reuse
it: one host read of `cu_seqlens` per micro-batch instead of one (and a `.tolist()` sync on a
GPU) per layer, and one block mask.

Two ways to run a pack's sequences:
- per length (`PackedPlan.groups`): the sequences of one length gathered into one batched
  causal SDPA call, so the work is the sum of the squared lengths; exact, what the CPU runs.
- FlexAttention (`flex`): one call per layer over the whole pack with a document-causal
  `BlockMask` (a token sees the tokens of its own sequence at or before it); blocks outside
  every sequence's causal triangle are skipped, so the work is that sum at block granularity,
  and without CP no host read of `cu_seqlens`. Compiled on CUDA (`torch.compile`); on the
  CPU torch's eager reference runs (it materialises the [T, T] scores: for tests), and its
  backward only because `_patches.flex_backward_on_cpu` lifts torch's up-front refusal.
Under context parallelism (context_parallel.py) a rank's queries are its chunks of each
segment and the keys the whole row (gathered): the per-length groups hold both positions,
and the block mask maps each local query to its position in the row.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import torch

from . import context_parallel as cpar

_ATTR = "_megarl_packed_plan"


@dataclasses.dataclass
class PackedPlan:
    """What attention needs from one packed micro-batch's `cu_seqlens`.

    `groups`: per distinct segment length L, (L, n, q, kv): `n` segments; `q` this rank's
    query positions of them ([n·L/CP] local indices, segment by segment) or, for a lone
    segment without CP, its start (an int: a slice, not a gather); `kv` their key positions
    in the whole row ([n·L], None without CP: the same as `q`). `inverse` puts the
    concatenated per-length outputs back in packed order."""
    key: tuple
    segments: tuple[int, ...]
    groups: list[tuple[int, int, "torch.Tensor | int", "torch.Tensor | None"]]
    inverse: torch.Tensor
    q_positions: torch.Tensor | None = None  # under CP: each local query's row position
    block_mask: object = None  # FlexAttention's, built on first use


def plan_of(params, cp: int = 1, rank: int = 0, device=None, flex: bool = False
            ) -> PackedPlan:
    """The plan of the micro-batch `params` describes, built once and kept on `params`.
    `flex` without CP: only the block mask is wanted, so `cu_seqlens` is never read to the
    host (no sync at all); under CP the gather needs the segments on the host anyway."""
    key = (cp, rank, str(device), flex and cp == 1)
    plan = getattr(params, _ATTR, None)
    if plan is None or plan.key != key:
        if key[-1]:
            plan = PackedPlan(key, (), [], torch.zeros(0, dtype=torch.long))
        else:
            plan = _build(params.cu_seqlens_q, cp, rank, device, key)
        setattr(params, _ATTR, plan)
    return plan


def _build(cu_seqlens: torch.Tensor, cp: int, rank: int, device, key) -> PackedPlan:
    bounds = cu_seqlens.tolist()  # the one host read of this micro-batch
    segments = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    by_length: dict[int, list[tuple[int, int]]] = {}  # length -> (row start, local start)
    local = 0
    for a, n in zip(bounds, segments):
        if n > 0:
            by_length.setdefault(n, []).append((a, local))
        local += n // cp
    groups, order = [], []
    for length, starts in by_length.items():
        n, m = len(starts), length // cp
        if cp == 1 and n == 1:
            a = starts[0][0]
            groups.append((length, 1, a, None))
            order.append(torch.arange(a, a + length))
            continue
        q = (torch.tensor([lo for _, lo in starts]).unsqueeze(1) + torch.arange(m)).reshape(-1)
        kv = None if cp == 1 else (torch.tensor([g for g, _ in starts]).unsqueeze(1)
                                   + torch.arange(length)).reshape(-1).to(device)
        groups.append((length, n, q.to(device), kv))
        order.append(q)
    inverse = torch.argsort(torch.cat(order)) if order else torch.zeros(0, dtype=torch.long)
    q_positions = cpar.local_index(segments, cp, rank).to(device) if cp > 1 else None
    return PackedPlan(key, segments, groups, inverse.to(device), q_positions)


def document_block_mask(plan: PackedPlan, cu_seqlens: torch.Tensor, total: int):
    """FlexAttention's document-causal mask of a packed row of `total` tokens (keys; the
    queries: all of them, or under CP this rank's `plan.q_positions`), kept on the plan:
    built once per micro-batch, read by every layer."""
    if plan.block_mask is None:
        from torch.nn.attention.flex_attention import create_block_mask

        dev = cu_seqlens.device
        cu = cu_seqlens.to(device=dev, dtype=torch.long)
        # each token's segment: zero-length segments take no token
        doc = torch.searchsorted(cu[1:], torch.arange(total, device=dev), right=True)
        pos = plan.q_positions

        if pos is None:
            def same_sequence_causal(b, h, q, kv):
                return (doc[q] == doc[kv]) & (q >= kv)
        else:
            def same_sequence_causal(b, h, q, kv):
                return (doc[pos[q]] == doc[kv]) & (pos[q] >= kv)

        q_len = total if pos is None else pos.numel()
        plan.block_mask = create_block_mask(same_sequence_causal, None, None, q_len, total,
                                            device=dev, _compile=dev.type == "cuda")
    return plan.block_mask


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # without compile, flex materialises the scores; dynamic: packed rows change length
    return torch.compile(flex_attention, dynamic=True)


def flex(q, k, v, block_mask, scale: float) -> torch.Tensor:
    """FlexAttention on [1, heads, T, dim] (k, v with the query groups' heads: GQA)."""
    from torch.nn.attention.flex_attention import flex_attention

    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        return _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    from ._patches import flex_backward_on_cpu

    with warnings.catch_warnings(), flex_backward_on_cpu():
        # the CPU runs flex's eager reference on purpose (tests), not by oversight
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)

