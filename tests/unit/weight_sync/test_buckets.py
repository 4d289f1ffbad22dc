"""Packing into flat buckets and scattering back is bit-exact for any bucket and piece size."""
import pytest
import torch

from megarl.weight_sync.buckets import BucketPacker, scatter
from megarl.weight_sync.protocol import BucketMeta, SyncConfig, byte_view, digest


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(7, 5, generator=g)),                       # 140 B
            ("b", torch.randn(33, generator=g).to(torch.bfloat16)),      # 66 B
            ("empty", torch.zeros(0, 4)),
            ("c", torch.randint(-9, 9, (3, 3), generator=g)),            # int64, 72 B
            ("d", torch.randn(4, 4, 4, generator=g).double())]           # 512 B


def _pack(named, bucket, chunk, verify=False):
    bufs = {}
    p = BucketPacker("7", bucket, chunk, lambda i, n: bufs.setdefault(i, torch.empty(n, dtype=torch.uint8)),
                     verify=verify)
    out = [(m, f.clone()) for n, t in named for m, f in p.add(n, t)]
    return out + [(m, f.clone()) for m, f in p.finish()]


@pytest.mark.parametrize("bucket", [1, 50, 140, 141, 200, 10_000])
@pytest.mark.parametrize("chunk", [1, 17, 10_000])
def test_roundtrip_bit_exact(bucket, chunk):
    named = _tensors()
    buckets = _pack(named, bucket, chunk, verify=True)
    total = sum(t.numel() * t.element_size() for _, t in named)
    assert sum(m.nbytes for m, _ in buckets) == total
    assert all(m.nbytes <= bucket for m, _ in buckets)
    assert [m.index for m, _ in buckets] == list(range(len(buckets)))
    assert [m.last for m, _ in buckets] == [False] * (len(buckets) - 1) + [True]
    if bucket >= total:
        assert len(buckets) == 1
    out = {n: torch.full_like(t, 3) for n, t in named}  # garbage, so a missed byte shows
    for meta, flat in buckets:
        meta = BucketMeta.from_json(meta.to_json())  # what the engine sees
        assert meta.checksum == digest(flat)
        for a, b in meta.chunks():
            assert b - a <= min(chunk, bucket)
            scatter(meta, a, flat[a:b], lambda e: byte_view(out[e.name]))
    for n, t in named:
        assert torch.equal(byte_view(out[n]), byte_view(t)), n


def test_tensor_larger_than_bucket_is_split_over_buckets():
    buckets = _pack([("big", torch.arange(100, dtype=torch.float32))], 128, 1000)
    assert [(m.nbytes, [(e.start, e.end) for e in m.entries]) for m, _ in buckets] == [
        (128, [(0, 128)]), (128, [(128, 256)]), (128, [(256, 384)]), (16, [(384, 400)])]


def test_stage_without_tensors_still_sends_a_last_bucket():
    (meta, flat), = _pack([], 64, 64)
    assert meta.last and meta.nbytes == 0 and meta.chunks() == []


def test_config_caps_consume_at_produce_and_rejects_nonsense():
    assert SyncConfig(produce_bucket_mb=1, consume_bucket_mb=8).chunk_bytes == 1 << 20
    with pytest.raises(ValueError):
        SyncConfig(consume_bucket_mb=0)
