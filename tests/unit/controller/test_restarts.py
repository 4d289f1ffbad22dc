"""The restart policy of `megarl train` (trainer.max_restarts): which failures restart the run,
how often, after how long, and what a run that keeps failing says. The run itself is replaced
by a function that fails as a lost run does; the whole path (a Ray worker SIGKILLed, the run
resuming from its checkpoint) is tests/integration/test_train_e2e.py::
test_a_lost_trainer_worker_restarts_the_run_which_trains_every_prompt_once."""
import asyncio

import pytest

from megarl.cluster.group import WorkerLost
from megarl.config import ConfigError, load_config
from megarl.controller import driver


def _cfg(*overrides):
    return load_config(None, ["trainer.restart_backoff_s=0.01", *overrides])


def _fake_runs(monkeypatch, outcomes):
    """`driver._run` stand-ins: each call takes the next outcome; an exception is raised
    after (or, with "setup:", before) the set-up counts as done."""
    calls = []

    async def fake(cfg, val_only, losses=(), on_started=None, keep_transport=False):
        calls.append({"resume_mode": cfg.trainer.resume_mode, "losses": list(losses)})
        out = outcomes[len(calls) - 1]
        if isinstance(out, tuple):  # ("setup", error): fails inside setup_run
            raise out[1]
        on_started()
        if isinstance(out, BaseException):
            raise out
        return out

    monkeypatch.setattr(driver, "_run", fake)
    return calls


def test_without_restarts_the_first_loss_is_the_error(monkeypatch):
    lost = WorkerLost("actor rank 0 on host 10.0.0.2 (pid 7) was lost during train")
    _fake_runs(monkeypatch, [lost])
    with pytest.raises(WorkerLost) as e:
        asyncio.run(driver._run_restarting(_cfg(), False))
    assert e.value is lost


def test_losses_restart_resuming_and_waits_grow(monkeypatch):
    sleeps = []

    async def sleep(s):
        sleeps.append(s)
    monkeypatch.setattr(driver.asyncio, "sleep", sleep)
    calls = _fake_runs(monkeypatch, [WorkerLost("a"), RuntimeError("b"), {"steps": 8}])
    cfg = _cfg("trainer.max_restarts=2", "trainer.resume_mode=disable",
               "trainer.restart_backoff_s=3")
    assert asyncio.run(driver._run_restarting(cfg, False)) == {"steps": 8}
    # the first run as configured; restarts resume from the newest checkpoint
    assert [c["resume_mode"] for c in calls] == ["disable", "auto", "auto"]
    assert calls[2]["losses"] == ["WorkerLost: a", "RuntimeError: b"]
    assert sleeps == [3.0, 6.0]
    assert cfg.trainer.resume_mode == "disable"  # the user's config is left as it was


def test_one_loss_past_the_limit_names_every_loss(monkeypatch):
    _fake_runs(monkeypatch, [WorkerLost("first"), WorkerLost("second"),
                             ("setup", TimeoutError("placement of 4 bundles"))])
    with pytest.raises(RuntimeError) as e:
        asyncio.run(driver._run_restarting(_cfg("trainer.max_restarts=2"), False))
    msg = str(e.value)
    assert msg.startswith("the run was lost 3 times, past trainer.max_restarts=2: ")
    assert "(1) WorkerLost: first; (2) WorkerLost: second; (3) TimeoutError: placement" in msg


def test_an_error_of_the_first_set_up_is_not_retried(monkeypatch):
    calls = _fake_runs(monkeypatch, [("setup", ValueError("bad data.train_files")), {}])
    with pytest.raises(ValueError):
        asyncio.run(driver._run_restarting(_cfg("trainer.max_restarts=3"), False))
    assert len(calls) == 1


def test_validation_only_never_restarts(monkeypatch):
    _fake_runs(monkeypatch, [WorkerLost("a"), {}])
    with pytest.raises(WorkerLost):
        asyncio.run(driver._run_restarting(_cfg("trainer.max_restarts=3"), True))


def test_under_torchrun_a_life_waits_resumes_and_the_last_one_names_every_loss(monkeypatch):
    """torchrun's agent restarts the processes: each life is one `driver.run(..., life=)`,
    told the earlier lives' losses; a restart waits and resumes, the last allowed life names
    them all when it fails, an earlier one fails with its own error (for the agent)."""
    sleeps = []

    async def sleep(s):
        sleeps.append(s)
    monkeypatch.setattr(driver.asyncio, "sleep", sleep)

    class Life:
        def __init__(self, losses):
            self.losses, self.began = losses, 0

        def started(self):
            self.began += 1

    cfg = _cfg("trainer.max_restarts=2", "trainer.launcher=torchrun",
               "trainer.resume_mode=disable", "trainer.restart_backoff_s=3")
    calls = _fake_runs(monkeypatch, [{"steps": 8}, WorkerLost("c"), WorkerLost("c")])
    life = Life(["rank 1 lost", "rank 2 lost"])
    assert driver.run(cfg, life=life) == {"steps": 8}
    assert life.began == 1 and sleeps == [6.0]
    assert calls[0] == {"resume_mode": "auto", "losses": ["rank 1 lost", "rank 2 lost"]}
    with pytest.raises(WorkerLost):  # life 1 of 3: the agent restarts it
        driver.run(cfg, life=Life(["rank 1 lost"]))
    with pytest.raises(RuntimeError, match=r"lost 3 times, past trainer.max_restarts=2: "
                                           r"\(1\) a; \(2\) b; \(3\) WorkerLost: c"):
        driver.run(cfg, life=Life(["a", "b"]))
    assert calls[1]["resume_mode"] == "auto" and calls[0]["losses"] != calls[1]["losses"]


def test_a_requeued_batch_job_resumes_as_a_restart_and_counts_it(monkeypatch):
    """launch/slurm_ray.sh in a job Slurm requeued: the run starts as restart n, resuming,
    and the requeues count against trainer.max_restarts."""
    monkeypatch.setenv("MEGARL_RESTARTS_BEFORE", "1")
    monkeypatch.setenv("MEGARL_RESTART_REASON", "Slurm requeued job 7")
    calls = _fake_runs(monkeypatch, [WorkerLost("a"), {"steps": 8}])
    cfg = _cfg("trainer.max_restarts=2", "trainer.resume_mode=disable")
    assert asyncio.run(driver._run_restarting(cfg, False)) == {"steps": 8}
    assert calls == [{"resume_mode": "auto", "losses": ["Slurm requeued job 7"]},
                     {"resume_mode": "auto",
                      "losses": ["Slurm requeued job 7", "WorkerLost: a"]}]
    _fake_runs(monkeypatch, [WorkerLost("b")])
    with pytest.raises(RuntimeError, match=r"lost 2 times, past trainer.max_restarts=1: "
                                           r"\(1\) Slurm requeued job 7; \(2\) WorkerLost: b"):
        asyncio.run(driver._run_restarting(_cfg("trainer.max_restarts=1"), False))


def test_a_negative_limit_is_refused_by_key():
    with pytest.raises(ConfigError, match="trainer.max_restarts"):
        _cfg("trainer.max_restarts=-1")
