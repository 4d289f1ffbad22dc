"""Packed (THD) attention plans (packed_attention.py): made once per micro-batch, and the
FlexAttention document mask equal to one causal SDPA call per sequence (fp32, GQA, forward
and gradients), on the CPU where torch runs flex's eager reference."""
import pytest
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


def flex_against_sdpa(device: str, dtype=torch.float32, segments=SEGMENTS, dim=16):
    """(forward, largest q/k/v gradient) differences of FlexAttention's document mask from
    one causal SDPA call per sequence, with GQA (4 query heads, 2 KV heads); each relative to
    the reference's largest magnitude where that is over 1."""
    g = torch.Generator().manual_seed(0)
    p = params(segments)
    p.cu_seqlens_q = p.cu_seqlens_kv = p.cu_seqlens_q.to(device)
    total, heads, groups, scale = sum(segments), 4, 2, 0.3
    q = torch.randn(1, heads, total, dim, generator=g).to(device, dtype).requires_grad_()
    k, v = (torch.randn(1, groups, total, dim, generator=g).to(device, dtype).requires_grad_()
            for _ in range(2))
    plan = pa.plan_of(p, device=device, flex=True)
    assert plan.groups == []  # flex without CP never reads cu_seqlens to the host
    mask = pa.document_block_mask(plan, p.cu_seqlens_q, total)
    assert pa.document_block_mask(plan, p.cu_seqlens_q, total) is mask  # shared by layers
    got = pa.flex(q, k, v, mask, scale)
    bounds = p.cu_seqlens_q.tolist()
    want = torch.cat([F.scaled_dot_product_attention(
        q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale,
        enable_gqa=True) for a, b in zip(bounds, bounds[1:]) if b > a], dim=2)
    w = torch.randn(got.shape, generator=g).to(device, dtype)
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    ref = torch.autograd.grad((want * w).sum(), (q, k, v))
    def diff(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()

    return diff(got, want), max(diff(a, b) for a, b in zip(grads, ref))


def test_flex_document_mask_equals_one_causal_sdpa_call_per_sequence():
    out, grads = flex_against_sdpa("cpu")
    assert out <= 1e-6 and grads <= 1e-5, (out, grads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled FlexAttention)")
def test_compiled_flex_on_cuda_equals_sdpa_per_sequence():
    """What `attention_backend: auto` runs for packed rows on a GPU: compiled FlexAttention
    and a compiled block mask, at head_dim 128, over rows of two lengths (a recompile)."""
    for segments in (SEGMENTS, [300, 0, 45, 300, 1, 200]):
        out, grads = flex_against_sdpa("cuda", segments=segments, dim=128)
        # fp32 inputs; the Triton kernel may round through TF32
        assert out <= 2e-3 and grads <= 2e-3, (segments, out, grads)
        out, grads = flex_against_sdpa("cuda", torch.bfloat16, segments, dim=128)
        assert out <= 2e-2 and grads <= 2e-2, (segments, out, grads)


def test_which_packed_path_each_backend_takes():
    assert packed_path("auto", cuda=True) == "flex"
    assert packed_path("auto", cuda=False) == "per_length"  # the CPU's exact default
    assert packed_path("flex", cuda=False) == "flex"
    assert packed_path("unfused", cuda=True) == "per_length"


def test_flex_under_context_parallelism_attends_each_ranks_chunks_to_the_whole_row():
    """Each CP rank's queries (its chunks r and 2·CP-1-r of every segment) against the whole
    row's keys, through the plan's query positions: the rows of the one-process answer, and
    the gradients too (each rank's query rows; K/V summed over the ranks, which is what the
    gather's reduce-scatter does)."""
    g = torch.Generator().manual_seed(3)
    cp, segs = 2, cpar.packed_segments([3, 8, 2, 8], 2)  # 4, 8, 4, 8
    total, scale = sum(segs), 0.25
    q = torch.randn(1, 4, total, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, total, 8, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(1, 4, total, 8, generator=g)
    p = params(segs)
    whole = pa.flex(q, k, v, pa.document_block_mask(pa.plan_of(p), p.cu_seqlens_q, total),
                    scale)
    want = torch.autograd.grad((whole * w).sum(), (q, k, v))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        p = params(segs)
        plan = pa.plan_of(p, cp=cp, rank=rank)
        idx = cpar.local_index(tuple(segs), cp, rank)
        assert torch.equal(plan.q_positions, idx)
        ql = q.detach()[:, :, idx].requires_grad_()
        got = pa.flex(ql, k, v, pa.document_block_mask(plan, p.cu_seqlens_q, total), scale)
        assert (got - whole[:, :, idx]).abs().max() <= 1e-6
        gq, gk, gv = torch.autograd.grad((got * w[:, :, idx]).sum(), (ql, k, v))
        dq[:, :, idx] = gq
        dk, dv = dk + gk, dv + gv
    for a, b in zip((dq, dk, dv), want):
        assert (a - b).abs().max() <= 1e-5
