"""Flattened buckets as stock SGLang takes them: whole tensors, one dtype each, at most the
consume size (a larger tensor alone); packed bytes unpack bit-exact on the receiving side."""
import pytest
import torch

from megarl.rollout.protocol import BadRequest
from megarl.rollout.weights import bucket_layout, unpack_bucket
from megarl.weight_sync.buckets import BucketPacker, plan_buckets
from megarl.weight_sync.protocol import SyncConfig, TensorSpec, update_group_ranks


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(7, 5, generator=g)),                       # f32, 140 B
            ("b", torch.randn(33, generator=g).to(torch.bfloat16)),      # bf16, 66 B
            ("c", torch.randn(3, generator=g).to(torch.bfloat16)),       # bf16, 6 B
            ("d", torch.randn(4, 4, 4, generator=g)),                    # f32, 256 B
            ("e", torch.randn(2, generator=g))]                          # f32, 8 B


def _pack(named, bucket_bytes):
    p = BucketPacker(3, bucket_bytes)
    out = [b for n, t in named for b in p.add(n, t)]
    return out + list(p.finish())


@pytest.mark.parametrize("bucket_bytes", [1, 100, 150, 300, 10_000])
def test_buckets_hold_whole_tensors_of_one_dtype_and_unpack_bit_exact(bucket_bytes):
    named = _tensors()
    buckets = _pack(named, bucket_bytes)
    assert [b.meta.index for b in buckets] == list(range(len(buckets)))
    got = {}
    for b in buckets:
        specs = b.meta.specs
        assert len({s.dtype for s in specs}) == 1
        assert b.meta.nbytes <= bucket_bytes or len(specs) == 1  # a large tensor goes alone
        req = b.meta.request("g", weight_version=None)
        assert req["load_format"] == "flattened_bucket" and req["flush_cache"] is False
        assert "weight_version" not in req
        layout = bucket_layout(req["names"], req["dtypes"], req["shapes"])
        flat = b.flat().clone()
        assert flat.numel() == layout[-1][4] == b.meta.nbytes
        got.update(unpack_bucket(flat, layout))
    assert list(got) != [] and set(got) == {n for n, _ in named}
    for n, t in named:
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    # The dry-run plan lays out the same buckets from shapes alone.
    plan = plan_buckets([TensorSpec.of(n, t) for n, t in named], bucket_bytes)
    assert [m.specs for m in plan] == [b.meta.specs for b in buckets]


def test_small_buckets_fill_per_dtype():
    buckets = _pack(_tensors(), 150)
    names = [[s.name for s in b.meta.specs] for b in buckets]
    # d (256 B) goes alone at once; a (140) and e (8) share the open f32 bucket, b and c the
    # bf16 one: a tensor of another dtype does not close a bucket in progress
    assert names == [["d"], ["a", "e"], ["b", "c"]]


@pytest.mark.parametrize("bucket_bytes", [1, 60, 100, 10_000])
def test_mla_down_projections_share_one_bucket(bucket_bytes):
    """Stock SGLang fuses DeepSeek-V3's q_a_proj with kv_a_proj_with_mqa only within one update
    call (a lone half is dropped): each layer's two go out in one bucket, in any export order
    and whatever the bucket size; a layer without a query latent sends its kv_a_proj alone."""
    a = "model.layers.{}.self_attn.{}.weight"
    named = [(a.format(0, "kv_a_proj_with_mqa"), torch.ones(5, 2)),   # 40 B
             (a.format(0, "kv_b_proj"), torch.ones(4, 2)),            # 32 B
             ("x", torch.ones(6)),                                    # 24 B
             (a.format(1, "q_a_proj"), torch.ones(3, 2)),             # 24 B
             (a.format(0, "q_a_proj"), torch.ones(3, 2)),
             (a.format(1, "kv_a_proj_with_mqa"), torch.ones(5, 2)),
             (a.format(2, "kv_a_proj_with_mqa"), torch.ones(5, 2))]   # no q_a_proj in layer 2
    buckets = _pack(named, bucket_bytes)
    where = {s.name: b.meta.index for b in buckets for s in b.meta.specs}
    assert set(where) == {n for n, _ in named}
    for layer in (0, 1):
        assert where[a.format(layer, "q_a_proj")] == where[a.format(layer, "kv_a_proj_with_mqa")]
    assert all(b.meta.nbytes <= bucket_bytes for b in buckets
               if len(b.meta.specs) > 1 and not any("_a_proj" in s.name for s in b.meta.specs))
    plan = plan_buckets([TensorSpec.of(n, t) for n, t in named], bucket_bytes)
    assert [m.specs for m in plan] == [b.meta.specs for b in buckets]


def test_last_call_carries_the_version_as_sglang_string():
    b = _pack(_tensors(), 10_000)[0]
    assert b.meta.request("grp", weight_version=12)["weight_version"] == "12"


def test_receiver_checks_like_stock_sglang():
    with pytest.raises(BadRequest, match="Unaligned"):
        bucket_layout(["x", "y"], ["bfloat16", "float32"], [[1], [1]])
    with pytest.raises(BadRequest, match="empty"):
        bucket_layout([], [], [])
    with pytest.raises(BadRequest, match="Negative"):
        bucket_layout(["x"], ["float32"], [[-1]])


def test_rank_offsets_count_every_engine_tp_rank():
    assert update_group_ranks([1, 1]) == ([1, 2], 3)
    assert update_group_ranks([2, 1, 4]) == ([1, 3, 4], 8)
    with pytest.raises(ValueError):
        update_group_ranks([0])


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        SyncConfig(consume_bucket_mb=0)
    cfg = SyncConfig(produce_bucket_mb=2, consume_bucket_mb=1)
    assert (cfg.produce_bytes, cfg.bucket_bytes) == (2 << 20, 1 << 20)
