"""Token-budget micro-batches and packed sequences: compute spent on real tokens only.

A batch is right-padded [B, S] (`attention_mask` marks the real tokens). With a token budget
(`TokenBudget`, verl's ``use_dynamic_bsz`` + ``*_max_token_len_per_gpu``) the worker splits
its rows into micro-batches whose real tokens stay under the budget, balanced by tokens, the
same number on every data-parallel rank (Megatron's schedules run in lockstep), and packs each
micro-batch into one row: the sequences' real tokens back to back, with cumulative lengths
(`cu_seqlens`) that keep rotary positions and attention inside each sequence (Megatron's THD
layout, `PackedSeqParams`). Outputs are unpacked to the [rows, S] layout the losses use, so
a loss function cannot tell a packed micro-batch from a padded one.
"""
from __future__ import annotations

import dataclasses
import heapq

import torch


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    """Micro-batching by tokens: at most `max_tokens` real tokens per micro-batch (one row
    longer than that travels alone)."""
    max_tokens: int

    def __post_init__(self):
        if int(self.max_tokens) < 1:
            raise ValueError(f"TokenBudget.max_tokens must be >= 1, got {self.max_tokens}")


def micro_batching(size: int, dynamic: bool, max_tokens: int | None) -> "int | TokenBudget":
    """What a config section asks for: `size` rows per micro-batch, or a token budget."""
    return TokenBudget(int(max_tokens)) if dynamic else int(size)


def row_lengths(batch: dict) -> list[int]:
    """Real tokens per row (at least 1: an all-padding filler row still occupies a slot).
    Rows must be right-padded: a hole in `attention_mask` would be packed as a token."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if mask is None:
        return [ids.shape[1]] * ids.shape[0]
    mask = mask.to(torch.bool)
    lengths = mask.sum(dim=1)
    prefix = torch.arange(ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    if not torch.equal(prefix, mask.cpu()):
        bad = int((prefix != mask.cpu()).any(dim=1).nonzero()[0])
        raise ValueError(f"packing needs right-padded rows: attention_mask row {bad} has a "
                         "padding position before a real token")
    return [max(1, int(n)) for n in lengths]


def balanced_partition(weights: list[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of `weights` in `k` parts with sums as even as the greedy rule makes them:
    heaviest first, each to the currently lightest part (LPT; the largest part is within 4/3
    of the best possible). `equal_size`: part sizes differ by at most one (data parallel
    shards keep equal row counts). Each part's indices are in ascending order."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = len(weights)
    cap = [n // k + (1 if i < n % k else 0) for i in range(k)] if equal_size else [n] * k
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, i) for i in range(k)]
    for j in sorted(range(n), key=lambda j: (-weights[j], j)):
        load, i = heapq.heappop(heap)
        while len(parts[i]) >= cap[i]:  # a full part leaves the heap for good
            load, i = heapq.heappop(heap)
        parts[i].append(j)
        heapq.heappush(heap, (load + weights[j], i))
    return [sorted(p) for p in parts]


def count_micro_batches(lengths: list[int], max_tokens: int) -> int:
    """The fewest parts whose balanced partition keeps every part within `max_tokens` (a row
    over the budget alone in its part)."""
    if not lengths:
        return 1
    # a lower bound: rows over the budget alone, the rest at least budget-full
    rest = sum(n for n in lengths if n <= max_tokens)
    k = max(1, sum(n > max_tokens for n in lengths) + -(-rest // max_tokens))
    while k < len(lengths):
        parts = balanced_partition(lengths, k)
        if all(sum(lengths[j] for j in p) <= max_tokens or len(p) == 1 for p in parts):
            return k
        k += 1
    return len(lengths)


@dataclasses.dataclass
class Packed:
    """One packed micro-batch: `input_ids` [1, T], positions restarting at each sequence,
    `cu_seqlens` (int32; a tail of padding, if any, is a segment of its own), the longest
    segment, and the real sequences' `lengths` (row i of the micro-batch is segment i)."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    lengths: list[int]
    seq_segments: list[int] | None = None
    """Each sequence's segment when it is longer than the sequence (context parallelism pads
    every sequence to a multiple of 2·CP); None: the sequences' own lengths."""

    @property
    def segments(self) -> tuple[int, ...]:
        """Every segment of the row, the padding tail included."""
        bounds = self.cu_seqlens.tolist()
        return tuple(b - a for a, b in zip(bounds, bounds[1:]))

    def params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens,
                               cu_seqlens_kv=self.cu_seqlens, max_seqlen_q=self.max_seqlen,
                               max_seqlen_kv=self.max_seqlen)


def pack(input_ids: torch.Tensor, lengths: list[int], total: int | None = None,
         seq_segments: list[int] | None = None) -> Packed:
    """Pack the rows of `input_ids` [b, S] (row i's first lengths[i] tokens) into one row of
    `total` tokens (default: their sum; more: a padding segment at the end). `seq_segments`:
    each sequence's segment, its tokens followed by padding (context parallelism)."""
    seq_segs = list(lengths) if seq_segments is None else list(seq_segments)
    if any(g < n for g, n in zip(seq_segs, lengths)):
        raise ValueError(f"pack: segments {seq_segs} shorter than sequences {lengths}")
    used = sum(seq_segs)
    total = used if total is None else total
    if total < used:
        raise ValueError(f"pack: {used} tokens do not fit in {total}")
    segs = seq_segs + ([total - used] if total > used else [])
    ids = torch.cat([torch.cat([input_ids[i, :n], input_ids.new_zeros(g - n)])
                     for i, (n, g) in enumerate(zip(lengths, seq_segs))]
                    + ([input_ids.new_zeros(total - used)] if total > used else []))
    pos = torch.cat([torch.arange(n, device=input_ids.device) for n in segs])
    cu = torch.tensor([0] + segs, dtype=torch.int32, device=input_ids.device).cumsum(0)
    return Packed(ids.unsqueeze(0), pos.unsqueeze(0), cu.to(torch.int32), max(segs),
                  list(lengths), None if seq_segments is None else seq_segs)


def shifted_index(lengths: list[int], device=None, segments: list[int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the packed next-token outputs go in [rows, S]: output j of the packed row (the
    prediction of packed token j + 1) is (row, col) = (i, t) for token t >= 1 of row i.
    Returns (src j, row i, col t); the first token of each row has no prediction.
    `segments`: each row's segment in the pack, when longer than the row (`pack`)."""
    src, row, col = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.long)], \
        [torch.zeros(0, dtype=torch.long)]
    start = 0
    for i, n in enumerate(lengths):
        src.append(torch.arange(start, start + n - 1))
        row.append(torch.full((n - 1,), i, dtype=torch.long))
        col.append(torch.arange(1, n))
        start += n if segments is None else segments[i]
    return tuple(torch.cat(x).to(device) for x in (src, row, col))


def unpack_shifted(values: torch.Tensor, lengths: list[int], width: int,
                   segments: list[int] | None = None) -> torch.Tensor:
    """Packed per-position outputs [T'] (T' >= sum(lengths) - 1, output j belonging to
    packed position j) -> [rows, width] in token alignment: out[i, t] = values at the packed
    position of token t - 1 of row i; column 0 and the padding are 0. Differentiable."""
    src, row, col = shifted_index(lengths, values.device, segments)
    out = values.new_zeros(len(lengths), width)
    return out.index_put((row, col), values[src])
