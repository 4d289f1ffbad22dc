"""A checkpoint's optimizer state is loaded as data (`weights_only`): what megarl writes
loads, and a file with a pickled object in it is refused, naming the file, without building
the object (which would run its code)."""
from pathlib import Path

import pytest
import torch

from megarl.backends.megatron.checkpoint import CheckpointError, load_optimizer_file


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (Path(self.path),)


def test_optimizer_state_loads_as_data_and_a_pickled_payload_is_refused(tmp_path):
    # the shape of megarl's own state (backends/megatron/optim.py): tensors, numbers, lists
    state = {"impl": "megatron", "steps": 3,
             "opt": {"state": {0: {"exp_avg": torch.ones(3), "step": torch.tensor(3.0)}},
                     "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]}}
    good = tmp_path / "rank_00000.pt"
    torch.save(state, good)
    back = load_optimizer_file(good, "cpu")
    assert back["steps"] == 3 and torch.equal(back["opt"]["state"][0]["exp_avg"], torch.ones(3))

    marker = tmp_path / "ran"
    bad = tmp_path / "rank_00001.pt"
    torch.save({**state, "opt": _Payload(marker)}, bad)
    with pytest.raises(CheckpointError, match=rf"{bad}: refused: the optimizer state holds "
                                              r"something other than tensors"):
        load_optimizer_file(bad, "cpu")
    assert not marker.exists()
