"""Core attention on `torch.nn.functional.scaled_dot_product_attention` (and FlexAttention).

Megatron's local `DotProductAttention` allocates its score buffer on `cuda`, and Transformer
Engine is a GPU-only extra, so this module is the core attention wherever TE's is not used:
on the CPU and on a GPU without TE. It is plugged in through the layer spec, so no Megatron
layer code changes. Causal self-attention; grouped query heads (GQA) go to SDPA as they are
(`enable_gqa`), not repeated to the query heads' count. Padding is on the right, so a causal
mask alone keeps real tokens from attending to pads. Multi-latent attention (DeepSeek-V3)
hands keys wider than values (`k_channels`, `v_channels`): the output is heads × v_channels.

`backend` (the config's `override_transformer_config.attention_backend`, Megatron's names
where they apply; `BACKENDS`): `auto` lets SDPA choose its kernel (flash / cuDNN / memory-
efficient on CUDA, never forced to the math one); `flash` and `fused` (cuDNN's fused
attention) put that kernel first, the others behind it; `unfused` allows only the math
kernel (the plain reference). On CUDA torch gives GQA to the flash and math kernels
only, so with grouped heads `fused` (cuDNN) runs flash. Packed sequences (Megatron's
THD layout, `PackedSeqParams.cu_seqlens_q`) attend causally within their own sequence, by
a plan made once per micro-batch (packed_attention.py): FlexAttention with a document mask
(`flex`, and `auto` on CUDA; under CP each rank's query chunks against the gathered row),
or one batched SDPA call per distinct length (the other backends, and `auto` on the CPU).

Context parallelism (context_parallel.py): each rank holds two chunks of every sequence; K and
V are all-gathered over the CP group and each local query chunk attends to the keys at or
before it (one SDPA call per chunk with an explicit causal mask offset by the chunk's start).
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from . import context_parallel as cpar
from . import packed_attention as packed


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


# The SDPA kernels each backend allows, in priority order (None: SDPA's own choice). `flash`
# and `fused` (Megatron's name for cuDNN's fused attention) put their kernel first and keep
# the others behind it, so verl's default (`flash`) runs wherever its kernel does not (the
# CPU, fp32, a mask); `unfused` allows the math kernel alone, the plain reference.
def _kernels(name: str):
    from torch.nn.attention import SDPBackend as B

    rest = [B.EFFICIENT_ATTENTION, B.MATH]
    return {"auto": None, "flex": None,
            "flash": [B.FLASH_ATTENTION, B.CUDNN_ATTENTION, *rest],
            "fused": [B.CUDNN_ATTENTION, B.FLASH_ATTENTION, *rest],
            "unfused": [B.MATH]}[name]


BACKENDS = ("auto", "flex", "flash", "fused", "unfused")


def packed_path(backend: str, cuda: bool | None = None) -> str:
    """How packed micro-batches run: `flex` (FlexAttention, one call per layer) or
    `per_length` (one SDPA call per distinct length)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return "flex" if backend == "flex" or (backend == "auto" and cuda) else "per_length"


class SDPAttention(MegatronModule):
    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, backend: str = "auto",
                 k_channels=None, v_channels=None):
        super().__init__(config=config)
        if backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, "
                             f"got {backend!r}")
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
        self.backend = backend
        self.kernels = _kernels(backend)
        self.packed_path = packed_path(backend)
        if self.packed_path == "flex" and self.dropout:
            raise ValueError("attention_backend=flex: FlexAttention has no attention dropout")

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
        explicit additive mask [s_q, s_k] instead of the square causal one."""
        gqa = self.heads != self.groups
        if gqa and mask is not None and q.is_cuda:
            # on CUDA, GQA "works only for Flash_attention and math kernel" (torch 2.13's
            # SDPA docstring) and flash takes no mask: with enable_gqa a masked call would
            # fall to the math kernel, so K/V are repeated for the memory-efficient one
            rep = self.heads // self.groups
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            gqa = False
        with self._kernel_scope():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                dropout_p=self.dropout if self.training else 0.0, enable_gqa=gqa)

    def _kernel_scope(self):
        if self.kernels is None:
            return contextlib.nullcontext()
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(self.kernels, set_priority=True)

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
        """THD: [t, heads, dim] tensors, sequences delimited by cu_seqlens -> [t, heads*dim],
        each sequence attending causally to itself only (under CP `query` holds this
        rank's chunks of each segment, key/value are gathered whole)."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"SDPAttention: packed format {params.qkv_format!r}")
        if params.cu_seqlens_q_padded is not None and not torch.equal(
                params.cu_seqlens_q_padded, params.cu_seqlens_q):
            raise NotImplementedError("SDPAttention: padded packed sequences")
        cp = self.cp_group.size() if self.cp_group is not None else 1
        plan = packed.plan_of(params, cp, self.cp_group.rank() if cp > 1 else 0, query.device,
                              flex=self.packed_path == "flex")
        if cp > 1:
            # the row's segments (whole, over the group); this rank holds 1/CP of each
            key, value = (cpar.gather_sequence(t, plan.segments, 0, self.cp_group,
                                               sum_grads=True) for t in (key, value))
        if self.packed_path == "flex":
            mask = packed.document_block_mask(plan, params.cu_seqlens_q, key.shape[0])
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            out = packed.flex(q, k, v, mask, self.scale)  # [1, heads, t(/CP), dim]
            return out[0].transpose(0, 1).reshape(query.shape[0], self.heads * self.v_dim)
        outs = []
        for length, n, qi, kvi in plan.groups:
            m = length // cp
            if isinstance(qi, int):  # a lone sequence: a slice, not a gather
                q, k, v = (t[qi:qi + length].unsqueeze(0).transpose(1, 2)
                           for t in (query, key, value))
            else:
                # [n·m, heads, dim] -> [n, heads, m, dim]
                q = query[qi].view(n, m, *query.shape[1:]).transpose(1, 2)
                kvi = qi if kvi is None else kvi
                k, v = (t[kvi].view(n, length, *t.shape[1:]).transpose(1, 2)
                        for t in (key, value))
            o = self._cp_causal(q, k, v) if cp > 1 else self._causal(q, k, v)
            outs.append(o.transpose(1, 2).reshape(n * m, self.heads * self.v_dim))
        # back to packed order
        return torch.cat(outs)[plan.inverse]
