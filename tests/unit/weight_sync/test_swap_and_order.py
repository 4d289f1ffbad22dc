"""Swap by reference (staging and live buffers alternate, aliasing kept) and the consumer's
bucket order (calls may arrive out of order; receives are posted in bucket order)."""
import threading
import time

import pytest
import torch
from torch import nn

from megarl.rollout.weights import WeightStore
from megarl.weight_sync.buckets import BucketPacker
from megarl.weight_sync.consumer import BucketConsumer
from megarl.weight_sync.protocol import BucketMeta, byte_view


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.arange(12.0).reshape(3, 4))
        self.tied = self.a  # one Parameter under two names, as tied embeddings are
        self.b = nn.Parameter(torch.zeros(6))
        self.b_half = nn.Parameter(self.b.data[:3])  # another tensor on b's storage
        self.c = nn.Parameter(torch.ones(2, 2))


def test_swap_takes_staged_storage_and_returns_the_old():
    m = _Tiny()
    store = WeightStore(m)
    old_a = m.a.data_ptr()
    staged = {"a": torch.full((3, 4), 7.0), "b": torch.full((6,), 5.0),
              "c": torch.full((2, 2), 3.0).t()}  # non-contiguous: must be copied
    new_a = staged["a"]
    displaced = store.swap(dict(staged))
    assert m.a.data_ptr() == new_a.data_ptr() and m.tied is m.a  # by reference
    assert displaced["a"].data_ptr() == old_a
    assert m.b.data_ptr() != staged["b"].data_ptr()  # aliased by b_half: copied in place
    assert torch.equal(m.b, torch.full((6,), 5.0)) and torch.equal(m.b_half, torch.full((3,), 5.0))
    assert displaced["b"] is staged["b"]
    assert torch.equal(m.c, torch.full((2, 2), 3.0)) and displaced["c"] is staged["c"]
    for name, t in displaced.items():  # nothing handed back is live
        assert all(t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
                   for p in m.parameters()), name


def test_swap_both_tied_names_last_wins_and_nothing_live_is_handed_back():
    m = _Tiny()
    store = WeightStore(m)
    displaced = store.swap({"a": torch.full((3, 4), 1.0), "tied": torch.full((3, 4), 2.0)})
    assert torch.equal(m.a, torch.full((3, 4), 2.0))  # as copying a then tied would leave it
    live = m.a.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() != live for t in displaced.values())


class _FakeGroup:
    """Hands out `data` in posting order, one piece per broadcast (as a real group matches
    posts across ranks); records the posts."""

    def __init__(self, data: torch.Tensor, fail: bool = False):
        self.data, self.pos, self.fail, self.posts = data, 0, fail, 0

    def broadcast_async(self, t, root=0):
        self.posts += 1
        if self.fail:
            raise RuntimeError("connection reset by peer")
        t.copy_(self.data[self.pos: self.pos + t.numel()])
        self.pos += t.numel()
        return self

    def wait(self):
        pass

    def broadcast(self, t, root=0):
        self.broadcast_async(t, root)


def _buckets(named, bucket_bytes, chunk_bytes):
    bufs = {}
    p = BucketPacker("v1", bucket_bytes, chunk_bytes,
                     lambda i, n: bufs.setdefault(i, torch.empty(n, dtype=torch.uint8)))
    out = [b for n, t in named for b in p.add(n, t)] + list(p.finish())
    return [(BucketMeta.from_json(b.meta.to_json()), b.flat.clone()) for b in out]


def test_out_of_order_calls_are_received_in_bucket_order():
    m = _Tiny()
    consumer = BucketConsumer(WeightStore(m))
    g = torch.Generator().manual_seed(0)
    want = {"a": torch.randn(3, 4, generator=g), "c": torch.randn(2, 2, generator=g)}
    buckets = _buckets(sorted(want.items()), 24, 16)
    assert len(buckets) == 3
    group = _FakeGroup(torch.cat([flat for _, flat in buckets]))
    results = {}

    def receive(meta):
        results[meta.index] = consumer.receive(group, meta)

    threads = []
    for meta, _ in reversed(buckets):  # last bucket's call arrives first
        threads.append(threading.Thread(target=receive, args=(meta,)))
        threads[-1].start()
        time.sleep(0.05)
    for t in threads:
        t.join(10)
    assert [results[i]["complete"] for i in range(3)] == [False, False, True]
    staged, direct = consumer.take("v1")
    assert not direct
    for name, t in want.items():
        assert torch.equal(byte_view(staged[name]), byte_view(t)), name


def test_after_a_transport_failure_later_buckets_do_not_touch_the_group():
    m = _Tiny()
    consumer = BucketConsumer(WeightStore(m))
    buckets = _buckets([("a", torch.randn(3, 4)), ("c", torch.randn(2, 2))], 24, 16)
    group = _FakeGroup(torch.empty(0), fail=True)
    with pytest.raises(RuntimeError, match="reset"):
        consumer.receive(group, buckets[0][0])
    posts = group.posts
    with pytest.raises(RuntimeError, match="bucket 0 .* failed"):
        consumer.receive(group, buckets[1][0])
    assert group.posts == posts
    assert consumer.broken is None  # staged mode: the old weights keep serving


def test_a_bucket_whose_predecessor_never_comes_gives_up(monkeypatch):
    consumer = BucketConsumer(WeightStore(_Tiny()))
    monkeypatch.setattr(consumer, "turn_timeout_s", 0.2)
    buckets = _buckets([("a", torch.randn(3, 4)), ("c", torch.randn(2, 2))], 24, 16)
    with pytest.raises(RuntimeError, match="never arrived"):
        consumer.receive(_FakeGroup(torch.empty(0)), buckets[1][0])
