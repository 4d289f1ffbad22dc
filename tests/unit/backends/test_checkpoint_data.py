"""A checkpoint's optimizer state is loaded as data (`weights_only`): what megarl writes
loads, and a file with a pickled object in it is refused, naming the file, without building
the object (which would run its code). And a checkpoint records what conversion needs to
rebuild its model: the dtype and the vocabulary padding it was built with."""
import json
import os
import subprocess
import sys
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


_SAVE = """
import sys
from megarl.backends.megatron.parallel import rank_program
from megarl.backends.megatron.worker import MegatronWorker
with rank_program():
    w = MegatronWorker(sys.argv[1], 1, 1, params_dtype="bfloat16", trainable=False,
                       make_vocab_size_divisible_by=64)
    w.save(sys.argv[2], step=3)
"""


def test_a_training_save_records_dtype_and_vocab_padding(tiny_qwen2, tmp_path):
    """As the trainer saves (`save(path, step=k)`, nothing else): conversion reads these from
    the meta, and fell back to float32 and 128 when a run's save left them out."""
    from megarl.backends.megatron.checkpoint import read_meta

    p = subprocess.run([sys.executable, "-c", _SAVE, str(tiny_qwen2), str(tmp_path / "ck")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "MASTER_PORT": "0"})
    assert p.returncode == 0, p.stderr[-3000:]
    meta = read_meta(tmp_path / "ck")
    assert (meta["params_dtype"], meta["make_vocab_size_divisible_by"], meta["step"]) == \
        ("bfloat16", 64, 3), json.dumps(meta)
