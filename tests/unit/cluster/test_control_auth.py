"""The torchrun control plane takes commands and results only from the job itself: values in
the store are signed with the job's secret (utils/control_auth.py), and one that is not is
refused before a byte of it is unpickled; the rank goes on serving. A real TCPStore stands in
for the one torchrun's agent hosts; two real `Control`s are ranks 0 and 1 of a 3-rank world."""
import datetime
import logging
import os
import pickle
import threading
import time
from pathlib import Path

import pytest

from megarl.utils.control_auth import ForgedMessage, Sealer
from megarl.config import ConfigError, load_config


class _Payload:
    """What an attacker would write: unpickling it creates `path`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (Path(self.path),)


def test_sealed_values_open_only_at_their_key_under_their_secret(tmp_path):
    s = Sealer("a" * 64)
    blob = s.seal("megarl/r/0/cmd/1/0", ("w", "m", (1,), {}))
    assert s.open("megarl/r/0/cmd/1/0", blob) == ("w", "m", (1,), {})
    marker = tmp_path / "ran"
    for key, value in [("megarl/r/0/cmd/2/0", blob),                 # replayed elsewhere
                       ("megarl/r/1/cmd/1/0", blob),                 # in another life
                       ("megarl/r/0/cmd/1/0", Sealer("b" * 64).seal(  # another job's secret
                           "megarl/r/0/cmd/1/0", _Payload(marker))),
                       ("megarl/r/0/cmd/1/0", pickle.dumps(_Payload(marker))),  # unsigned
                       ("megarl/r/0/cmd/1/0", b"")]:
        with pytest.raises(ForgedMessage, match="not signed with this job's"):
            s.open(key, value)
    assert not marker.exists()
    with pytest.raises(ConfigError, match="MEGARL_CONTROL_SECRET: 5 characters"):
        Sealer("short")


@pytest.fixture
def world(monkeypatch):
    import torch.distributed as dist

    from megarl.utils.launch import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True,
                          timeout=datetime.timedelta(seconds=30))
    env = {"WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "t",
           "TORCHELASTIC_RESTART_COUNT": "0"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    return store


def _control(rank, monkeypatch):
    from megarl.cluster.torchrun import Control

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # each Control takes it out
    return Control(load_config(None, ["trainer.launcher=torchrun", "trainer.n_gpus_per_node=3"]))


def _gone(store, key, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while store.check([key]):
        assert time.monotonic() < deadline, f"{key} was never read"
        time.sleep(0.01)


def test_forged_commands_and_results_are_refused_and_the_run_goes_on(world, monkeypatch,
                                                                     tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="megarl.cluster.torchrun")
    marker = tmp_path / "ran"
    monkeypatch.delenv("MEGARL_CONTROL_SECRET", raising=False)
    with pytest.raises(ConfigError, match="MEGARL_CONTROL_SECRET is not set"):
        _control(1, monkeypatch)
    monkeypatch.setenv("MEGARL_CONTROL_SECRET", os.urandom(32).hex())
    rank1 = _control(1, monkeypatch)
    # Someone who reached the store writes rank 1's first command before rank 0 does.
    # (PrefixStore joins prefix and key with a "/": the life's keys are under megarl/t/0//)
    world.set("megarl/t/0//cmd/1/0", pickle.dumps(_Payload(marker)))
    served = {}
    t = threading.Thread(target=lambda: served.update(failed=rank1.serve()), daemon=True)
    t.start()
    _gone(world, "megarl/t/0//cmd/1/0")
    assert not marker.exists()
    rank0 = _control(0, monkeypatch)
    # ... and a result for a call rank 0 has in flight (to rank 2, which never answers)
    waiting = rank0.call(2, "x", "method")
    world.set("megarl/t/0//res/2/0", pickle.dumps(_Payload(marker)))
    _gone(world, "megarl/t/0//res/2/0")
    assert not marker.exists() and not waiting.done()
    # the real command still reaches rank 1, which answers and leaves its loop
    assert rank0.call(1, "", "__exit__", False).result(timeout=30) is None
    t.join(timeout=30)
    assert served == {"failed": False}
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert any(m.startswith("rank 1: refused a command (megarl/t/0/cmd/1/0: ")
               for m in refused), refused
    assert any(m.startswith("rank 0: refused a result (megarl/t/0/res/2/0: ")
               for m in refused), refused
    rank0._stop.set()
