"""Packed (THD) attention plans (packed_attention.py): made once per micro-batch, and the
FlexAttention document mask equal to one causal SDPA call per sequence (fp32, GQA, forward
and gradients), on the CPU where torch runs flex's eager reference."""
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from megarl.backends.megatron import context_parallel as cpar
from megarl.backends.megatron import packed_attention as pa
from megarl.backends.megatron.attention import packed_path

# a zero-length segment, two sequences of one length, a 1-token one, a padding tail
SEGMENTS = [5, 0, 17, 5, 1, 9]


def params(segments):
    cu = torch.tensor([0, *segments]).cumsum(0).to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)


def test_the_plan_is_made_once_per_micro_batch_and_groups_by_length():
    p = params(SEGMENTS)
    plan = pa.plan_of(p)
    assert pa.plan_of(p) is plan  # every later layer (and recompute) reuses it
    assert plan.segments == tuple(SEGMENTS)
    # one group per distinct length, the two 5-token sequences gathered together
    assert [(length, n) for length, n, _, _ in plan.groups] == [(5, 2), (17, 1), (1, 1),
                                                                (9, 1)]
    assert plan.groups[0][2].tolist() == [*range(0, 5), *range(22, 27)]
    assert plan.groups[1][2] == 5  # a lone sequence is a slice
    assert pa.plan_of(params(SEGMENTS)) is not plan  # a new micro-batch, a new plan


def test_the_context_parallel_plan_holds_this_ranks_chunks_and_the_rows_keys():
    segs = cpar.packed_segments([3, 8, 2], 2)  # 4, 8, 4
    for rank in (0, 1):
        plan = pa.plan_of(params(segs), cp=2, rank=rank)
        local = cpar.local_index(tuple(segs), 2, rank)
        got_q, got_kv = [], []
        for length, n, q, kv in plan.groups:
            assert q.numel() == n * length // 2 and kv.numel() == n * length
            got_q.append(q)
            got_kv.append(kv)
        # local query positions, in packed order once put back by the inverse
        assert torch.equal(torch.cat(got_q)[plan.inverse], torch.arange(local.numel()))
        # the keys of the 4-token group: segments 0 and 2, whole
        assert plan.groups[0][3].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


def test_flex_document_mask_equals_one_causal_sdpa_call_per_sequence():
    g = torch.Generator().manual_seed(0)
    p = params(SEGMENTS)
    total, heads, groups, dim, scale = sum(SEGMENTS), 4, 2, 16, 0.3
    q = torch.randn(1, heads, total, dim, generator=g, requires_grad=True)
    k, v = (torch.randn(1, groups, total, dim, generator=g, requires_grad=True)
            for _ in range(2))
    plan = pa.plan_of(p)
    mask = pa.document_block_mask(plan, p.cu_seqlens_q, total)
    assert pa.document_block_mask(plan, p.cu_seqlens_q, total) is mask  # shared by layers
    got = pa.flex(q, k, v, mask, scale)
    bounds = p.cu_seqlens_q.tolist()
    want = torch.cat([F.scaled_dot_product_attention(
        q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale,
        enable_gqa=True) for a, b in zip(bounds, bounds[1:]) if b > a], dim=2)
    assert (got - want).abs().max() <= 1e-6
    w = torch.randn(got.shape, generator=g)
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    ref = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(grads, ref):
        assert (a - b).abs().max() <= 1e-5


def test_which_packed_path_each_backend_takes():
    assert packed_path("auto", cuda=True) == "flex"
    assert packed_path("auto", cuda=False) == "per_length"  # the CPU's exact default
    assert packed_path("flex", cuda=False) == "flex"
    assert packed_path("unfused", cuda=True) == "per_length"
    assert packed_path("flex", cp=2, cuda=True) == "per_length"  # CP: per length only
