"""Core attention on `torch.nn.functional.scaled_dot_product_attention`.

Megatron's local `DotProductAttention` allocates its score buffer on `cuda`, and Transformer
Engine is a GPU-only extra, so this module is the core attention wherever TE is absent: on the
CPU and on a GPU without TE. It is plugged in through the layer spec, so no Megatron layer code
changes. Supports causal self-attention with GQA; padding is on the right, so a causal mask
alone keeps real tokens from attending to pads. Packed sequences (Megatron's THD layout,
`PackedSeqParams.cu_seqlens_q`) attend causally within their own sequence: one SDPA call per
sequence, so the work is the sum of the squared lengths, not the square of the pack's.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class SDPAttention(MegatronModule):
    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention: attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        # Megatron hands [s, b, heads, dim]; SDPA wants [b, heads, s, dim].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.heads != self.groups:
            rep = self.heads // self.groups
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)

    def _packed(self, query, key, value, params):
        """THD: [t, heads, dim] tensors, sequences delimited by cu_seqlens -> [t, heads*dim]."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"SDPAttention: packed format {params.qkv_format!r}")
        if params.cu_seqlens_q_padded is not None and not torch.equal(
                params.cu_seqlens_q_padded, params.cu_seqlens_q):
            raise NotImplementedError("SDPAttention: padded packed sequences")
        bounds = params.cu_seqlens_q.tolist()
        outs = []
        for a, b in zip(bounds, bounds[1:]):
            if b == a:
                continue
            # [L, heads, dim] -> [1, heads, L, dim]
            q, k, v = (t[a:b].permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
            if self.heads != self.groups:
                rep = self.heads // self.groups
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale,
                dropout_p=self.dropout if self.training else 0.0)
            outs.append(o[0].permute(1, 0, 2).reshape(b - a, self.heads * self.head_dim))
        return torch.cat(outs)
