"""Packing into flat buckets and scattering back is bit-exact for any bucket and piece size;
zero-copy buckets hand out the same bytes; pieces are cut at tensor boundaries."""
import pytest
import torch

from megarl.weight_sync.buckets import BucketPacker, locate, scatter
from megarl.weight_sync.protocol import BucketMeta, Entry, SyncConfig, byte_view, digest


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
    out = [(b.meta, b.flat.clone()) for n, t in named for b in p.add(n, t)]
    return out + [(b.meta, b.flat.clone()) for b in p.finish()]


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


@pytest.mark.parametrize("bucket", [1, 50, 141, 10_000])
@pytest.mark.parametrize("chunk", [1, 17, 64, 10_000])
def test_zero_copy_pieces_equal_packed_bytes(bucket, chunk):
    named = _tensors()
    packed = _pack(named, bucket, chunk, verify=True)
    p = BucketPacker("7", bucket, chunk, None, verify=True)  # no buffer: views of the tensors
    views = [b for n, t in named for b in p.add(n, t)] + list(p.finish())
    assert [b.meta.to_json() for b in views] == [m.to_json() for m, _ in packed]  # same wire
    scratch = torch.empty(chunk, dtype=torch.uint8)
    for b, (_, flat) in zip(views, packed):
        assert b.flat is None
        for lo, hi in b.meta.chunks():
            piece = b.piece(lo, hi, lambda n: scratch)
            assert torch.equal(piece, flat[lo:hi])
            inside = locate(b.meta, lo, hi) is not None
            # in place when inside one tensor (a view of it), gathered otherwise
            assert (piece.untyped_storage().data_ptr() != scratch.data_ptr()) == inside


def _meta(sizes, chunk):
    entries, off = [], 0
    for i, n in enumerate(sizes):
        entries.append(Entry(f"t{i}", "uint8", (n,), 0, n, off))
        off += n
    return BucketMeta("v", 0, 1, 0, True, off, chunk, entries)


def test_pieces_are_cut_at_tensor_boundaries_and_group_small_tensors():
    # chunk 64: tensors under 8 bytes share pieces, the rest get their own
    meta = _meta([100, 3, 4, 0, 5, 64, 2], 64)
    assert meta.chunks() == [(0, 64), (64, 100), (100, 112), (112, 176), (176, 178)]
    assert [locate(meta, a, b) for a, b in meta.chunks()] == [0, 0, None, 5, 6]
    many_small = _meta([7] * 20, 64)  # grouped, never over the piece size
    assert all(b - a <= 64 for a, b in many_small.chunks())
    assert many_small.chunks()[0] == (0, 63) and many_small.chunks()[-1][1] == 140
    assert _meta([], 64).chunks() == []
