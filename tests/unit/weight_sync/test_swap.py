"""Swap by reference: staging and live buffers alternate, aliasing is kept."""
import torch
from torch import nn

from megarl.rollout.weights import WeightStore


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
