"""Context parallelism's layout arithmetic (megarl/backends/megatron/context_parallel.py):
each sequence in 2·CP chunks, rank r holding r and 2·CP-1-r; packed rows sequence by
sequence; the gather's reorder; CP packing and unpacking."""
import pytest
import torch

from megarl.backends.megatron import context_parallel as cpar
from megarl.backends.megatron.packing import pack, unpack_shifted


def test_each_rank_holds_an_early_and_a_late_chunk():
    assert cpar.chunk_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cpar.chunk_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cpar.chunk_index(12, 3, 1, offset=100).tolist() == [102, 103, 108, 109]
    with pytest.raises(ValueError, match="multiple of 2·CP = 4"):
        cpar.chunk_index(6, 2, 0)


@pytest.mark.parametrize("segments,cp", [((8,), 2), ((4, 8, 4), 2), ((6, 12), 3), ((16,), 4)])
def test_ranks_cover_every_position_once_and_the_gather_restores_order(segments, cp):
    parts = [cpar.local_index(segments, cp, r) for r in range(cp)]
    assert all(len(p) == sum(segments) // cp for p in parts)
    gathered = torch.cat(parts)  # what an all-gather of the positions returns
    assert sorted(gathered.tolist()) == list(range(sum(segments)))
    assert gathered[cpar.restore_order(segments, cp)].tolist() == list(range(sum(segments)))
    # packed: a rank's chunks of each segment stay inside that segment
    start = 0
    for n in segments:
        mine = parts[0][(parts[0] >= start) & (parts[0] < start + n)] - start
        assert mine.tolist() == cpar.chunk_index(n, cp, 0).tolist()
        start += n


def test_cp_packing_pads_each_sequence_and_unpacks_to_rows():
    ids = torch.arange(1, 31).view(3, 10)
    lengths = [3, 10, 5]
    segs = cpar.packed_segments(lengths, 2)
    assert segs == [4, 12, 8]
    p = pack(ids, lengths, total=28, seq_segments=segs)
    assert p.segments == (4, 12, 8, 4) and p.max_seqlen == 12
    assert p.input_ids[0, :4].tolist() == [1, 2, 3, 0]  # the sequence, then its padding
    assert p.position_ids[0, 4:8].tolist() == [0, 1, 2, 3]  # positions restart per segment
    # per-position outputs of the packed row: the value at packed position j is j
    out = unpack_shifted(torch.arange(28.0), lengths, 10, segs)
    assert out[0, :3].tolist() == [0, 0, 1] and out[1, 1].item() == 4  # row 1 starts at 4
    assert out[2, 4].item() == 16 + 3 and out[2, 5:].abs().sum() == 0
