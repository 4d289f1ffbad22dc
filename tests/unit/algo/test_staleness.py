"""The staleness limit: oldest response token decides; whole groups optional."""
import pytest
import torch

from megarl.algo.staleness import sample_staleness, staleness_mask

# trainer at version 5. row 0: response tokens at v5 -> 0 behind; row 1: oldest response
# token v3 -> 2 behind (prompt position's v0 does not count); row 2: no response -> 0;
# row 3: tokens v4 and v4 (v2 is masked) -> 1 behind
VERSIONS = torch.tensor([[0, 5, 5], [0, 3, 4], [0, 0, 0], [4, 2, 4]])
MASK = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 0, 0], [1, 0, 1]])


def test_sample_staleness_uses_oldest_response_token():
    assert sample_staleness(VERSIONS, MASK, 5).tolist() == [0, 2, 0, 1]


def test_staleness_mask_and_counts():
    keep, m = staleness_mask(VERSIONS, MASK, 5, max_staleness=1)
    assert keep.tolist() == [True, False, True, True]
    assert m == {"rollout/stale_dropped": 1.0, "rollout/stale_dropped_frac": 0.25,
                 "rollout/stale_kept": 3.0}
    keep, _ = staleness_mask(VERSIONS, MASK, 5, max_staleness=2)
    assert keep.all()
    keep, m = staleness_mask(VERSIONS, MASK, 5, max_staleness=None)
    assert keep.all() and m["rollout/stale_dropped"] == 0


def test_whole_groups_dropped_together():
    keep, m = staleness_mask(VERSIONS, MASK, 5, 1, group_ids=["a", "a", "b", "b"])
    assert keep.tolist() == [False, False, True, True] and m["rollout/stale_dropped"] == 2
    keep, _ = staleness_mask(VERSIONS, MASK, 5, 0, group_ids=torch.tensor([7, 7, 8, 8]))
    assert not keep.any()


def test_bad_inputs():
    with pytest.raises(ValueError):
        staleness_mask(VERSIONS, MASK, 5, -1)
    with pytest.raises(ValueError):
        staleness_mask(VERSIONS, MASK, 5, 1, group_ids=["a"])
    keep, m = staleness_mask(VERSIONS[:0], MASK[:0], 5, 1)
    assert keep.numel() == 0 and m["rollout/stale_dropped_frac"] == 0.0
