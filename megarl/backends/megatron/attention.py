"""Core attention on `torch.nn.functional.scaled_dot_product_attention`.

Megatron's local `DotProductAttention` allocates its score buffer on `cuda`, and Transformer
Engine is a GPU-only extra, so this module is the core attention wherever TE is absent: on the
CPU and on a GPU without TE. It is plugged in through the layer spec, so no Megatron layer code
changes. Supports causal self-attention with GQA; padding is on the right, so a causal mask
alone keeps real tokens from attending to pads. Multi-latent attention (DeepSeek-V3) hands
keys wider than values (`k_channels`, `v_channels`): the output is heads × v_channels. Packed sequences (Megatron's THD layout,
`PackedSeqParams.cu_seqlens_q`) attend causally within their own sequence: one batched SDPA
call per distinct length, so the work is the sum of the squared lengths, not the square of
the pack's.

Context parallelism (context_parallel.py): each rank holds two chunks of every sequence; K and
V are all-gathered over the CP group and each local query chunk attends to the keys at or
before it (one SDPA call per chunk with an explicit causal mask offset by the chunk's start).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from . import context_parallel as cpar


@functools.lru_cache(maxsize=8)
def _offset_causal_mask(c: int, offset: int, device, dtype) -> torch.Tensor:
    """Additive mask [c, offset + c]: query i (at position offset + i) sees keys 0..offset+i.
    One tensor per shape, shared by every layer and call: SDPA keeps its mask for backward,
    and a mask made per call (or a boolean one, which SDPA converts per call) would be kept
    once per layer, as large as the layer's activations at long sequences."""
    allowed = torch.arange(offset + c, device=device).unsqueeze(0) \
        <= (offset + torch.arange(c, device=device)).unsqueeze(1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
        ~allowed, float("-inf"))


class SDPAttention(MegatronModule):
    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, k_channels=None, v_channels=None):
        super().__init__(config=config)
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(
                required_pgs=["tp", "cp"] if config.context_parallel_size > 1 else ["tp"])
        tp = pg_collection.tp.size()
        self.cp_group = pg_collection.cp if config.context_parallel_size > 1 else None
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = k_channels or config.kv_channels
        # the output's per-head width: the values' (MLA's v_head_dim), else the keys'
        self.v_dim = v_channels or self.head_dim
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention: attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        s, b = query.shape[0], query.shape[1]
        if self.cp_group is not None:
            cp = self.cp_group.size()
            segs = (s * cp,)
            key, value = (cpar.gather_sequence(t, segs, 0, self.cp_group, sum_grads=True)
                          for t in (key, value))
            out = self._cp_causal(*(t.permute(1, 2, 0, 3) for t in (query, key, value)))
            return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v_dim)
        # Megatron hands [s, b, heads, dim]; SDPA wants [b, heads, s, dim].
        out = self._causal(*(t.permute(1, 2, 0, 3) for t in (query, key, value)))
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v_dim)

    def _causal(self, q, k, v, mask=None):
        """Causal SDPA on [b, heads, s, dim] (k, v with the query groups' heads); `mask`: an
        explicit boolean mask [s_q, s_k] instead of the square causal one."""
        if self.heads != self.groups:
            rep = self.heads // self.groups
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0)

    def _cp_causal(self, q, k, v):
        """Context parallelism: q [n, heads, 2c, dim] this rank's two chunks (r and
        2·CP-1-r) of n sequences of length L = 2c·CP, k and v [n, groups, L, dim] whole, in
        sequence order. Chunk j's queries see the keys [0, (j+1)·c), causally."""
        cp, r = self.cp_group.size(), self.cp_group.rank()
        c = q.shape[2] // 2
        outs = []
        for half, j in ((0, r), (1, 2 * cp - 1 - r)):
            end = (j + 1) * c
            mask = _offset_causal_mask(c, j * c, q.device, q.dtype) if j else None
            outs.append(self._causal(q[:, :, half * c:(half + 1) * c], k[:, :, :end],
                                     v[:, :, :end], mask))
        return torch.cat(outs, dim=2)

    def _packed(self, query, key, value, params):
        """THD: [t, heads, dim] tensors, sequences delimited by cu_seqlens -> [t, heads*dim].
        Sequences of one length go through one batched SDPA call (RL batches repeat lengths,
        short ones especially), each attending causally to itself only."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"SDPAttention: packed format {params.qkv_format!r}")
        if params.cu_seqlens_q_padded is not None and not torch.equal(
                params.cu_seqlens_q_padded, params.cu_seqlens_q):
            raise NotImplementedError("SDPAttention: padded packed sequences")
        bounds = params.cu_seqlens_q.tolist()
        cp = self.cp_group.size() if self.cp_group is not None else 1
        if cp > 1:
            # the row's segments (whole, over the group); this rank holds 1/CP of each
            segs = tuple(b - a for a, b in zip(bounds, bounds[1:]))
            key, value = (cpar.gather_sequence(t, segs, 0, self.cp_group, sum_grads=True)
                          for t in (key, value))
            return self._packed_cp(query, key, value, bounds, cp)
        starts_of: dict[int, list[int]] = {}
        for a, b in zip(bounds, bounds[1:]):
            if b > a:
                starts_of.setdefault(b - a, []).append(a)
        order, outs = [], []
        for length, starts in starts_of.items():
            n = len(starts)
            if n == 1:  # a slice, not a gather
                a = starts[0]
                idx = torch.arange(a, a + length, device=query.device)
                q, k, v = (t[a:a + length].unsqueeze(0).transpose(1, 2)
                           for t in (query, key, value))
            else:
                # [n·L] positions of the n sequences of this length, sequence by sequence
                idx = (torch.tensor(starts, device=query.device).unsqueeze(1)
                       + torch.arange(length, device=query.device)).reshape(-1)
                # [n·L, heads, dim] -> [n, heads, L, dim]
                q, k, v = (t[idx].view(n, length, *t.shape[1:]).transpose(1, 2)
                           for t in (query, key, value))
            o = self._causal(q, k, v)
            outs.append(o.transpose(1, 2).reshape(n * length, self.heads * self.v_dim))
            order.append(idx)
        # back to packed order
        return torch.cat(outs)[torch.argsort(torch.cat(order))]

    def _packed_cp(self, query, key, value, bounds, cp):
        """THD under context parallelism: `query` [t/CP, heads, dim] this rank's chunks of
        each segment, key/value [t, groups, dim] the whole row in sequence order; segments of
        one length in one batched call, as `_packed` does."""
        groups: dict[int, list[tuple[int, int]]] = {}  # length -> (global start, local start)
        local = 0
        for a, b in zip(bounds, bounds[1:]):
            if b > a:
                groups.setdefault(b - a, []).append((a, local))
            local += (b - a) // cp
        order, outs = [], []
        dev = query.device
        for length, starts in groups.items():
            n, m = len(starts), length // cp
            gidx = (torch.tensor([g for g, _ in starts], device=dev).unsqueeze(1)
                    + torch.arange(length, device=dev)).reshape(-1)
            lidx = (torch.tensor([lo for _, lo in starts], device=dev).unsqueeze(1)
                    + torch.arange(m, device=dev)).reshape(-1)
            q = query[lidx].view(n, m, *query.shape[1:]).transpose(1, 2)
            k, v = (t[gidx].view(n, length, *t.shape[1:]).transpose(1, 2) for t in (key, value))
            o = self._cp_causal(q, k, v)
            outs.append(o.transpose(1, 2).reshape(n * m, self.heads * self.v_dim))
            order.append(lidx)
        return torch.cat(outs)[torch.argsort(torch.cat(order))]
