"""Lives of a torchrun launch (cluster/torchrun.py): what each rank records in the agents'
store, and the account of a lost life that the next life's driver reports. A real TCPStore
stands in for the one torchrun's agent hosts (it outlives the workers in the same way)."""
import datetime

import pytest

from megarl.config import ConfigError, load_config


@pytest.fixture
def agent_store(monkeypatch):
    """The agent's store, and the environment torchrun gives rank 0 of a 3-rank world."""
    import torch.distributed as dist

    from megarl.utils.launch import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True,
                          timeout=datetime.timedelta(seconds=30))
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "t",
           "TORCHELASTIC_MAX_RESTARTS": "2"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MEGARL_CONTROL_SECRET", "s" * 64)
    yield dist.PrefixStore("megarl/t/life/", store)


def _control(life: int, monkeypatch, *overrides):
    from megarl.cluster.torchrun import Control

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(life))
    cfg = load_config(None, ["trainer.launcher=torchrun", "trainer.n_gpus_per_node=3",
                             "trainer.max_restarts=2", "trainer.placement_timeout_s=1",
                             *overrides])
    return Control(cfg)


def test_a_lost_life_is_told_by_its_records(agent_store, monkeypatch):
    from megarl.cluster.torchrun import STOPPED

    rec = agent_store
    # life 0: rank 1 vanished (SIGKILL), the others were stopped by the agent
    for r in range(3):
        rec.set(f"0/rank/{r}", f"host 10.0.0.{r}, pid {100 + r}")
    rec.set("0/started", "1")
    rec.set("0/end/0", STOPPED)
    rec.set("0/end/2", STOPPED)
    # life 1: rank 0's own account (a rank of another node went silent), and no last word
    # from rank 2; rank 1 never checked in (it was stopped while starting)
    rec.set("1/rank/0", "host 10.0.0.0, pid 200")
    rec.set("1/rank/2", "host 10.0.0.2, pid 202")
    rec.set("1/loss", "RankLost: rank 2 on host 10.0.0.2 has had no heartbeat for 60 s")
    rec.set("1/end/0", "failed")
    # life 2 is this one: every rank checks in (the other two as their processes would)
    rec.add("2/joined", 2)
    ctl = _control(2, monkeypatch)
    ctl.join()
    assert ctl.losses == [
        "no word from rank 1 (host 10.0.0.1, pid 101): killed, or its host lost",
        "RankLost: rank 2 on host 10.0.0.2 has had no heartbeat for 60 s; no word from rank 2 "
        "(host 10.0.0.2, pid 202): killed, or its host lost"]
    assert rec.get("2/rank/0").decode().endswith(f"pid {__import__('os').getpid()}")
    # a rank that checks in to the next life ends this one (its node's agent restarted it)
    assert ctl.newer_life() == []
    rec.set("3/rank/2", "host 10.0.0.2, pid 302")
    rec.add("3/joined", 1)
    assert ctl.newer_life() == [2]


def test_a_missing_rank_fails_the_life_by_the_placement_timeout(agent_store, monkeypatch):
    ctl = _control(1, monkeypatch)  # nobody else checks in to life 1
    agent_store.set("0/started", "1")
    with pytest.raises(TimeoutError, match=r"torchrun life 1: 1 of 3 ranks checked in within "
                                           r"trainer.placement_timeout_s = 1 s; missing: "
                                           r"ranks \[1, 2\]"):
        ctl.join()


def test_a_first_set_up_that_failed_is_not_retried(agent_store, monkeypatch):
    agent_store.set("0/loss", "ValueError: bad data.train_files")
    agent_store.add("1/joined", 2)
    for r in range(3):
        agent_store.set(f"0/end/{r}", "failed")
    ctl = _control(1, monkeypatch)
    with pytest.raises(RuntimeError, match="first set-up failed; not retried: ValueError: bad"):
        ctl.join()


def test_the_agent_and_the_config_must_agree_on_restarts(agent_store, monkeypatch):
    with pytest.raises(ConfigError, match=r"trainer.max_restarts=1 but torchrun was started "
                                          r"with --max-restarts 2"):
        _control(0, monkeypatch, "trainer.max_restarts=1")
