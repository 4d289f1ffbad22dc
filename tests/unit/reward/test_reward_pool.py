"""RewardPool: real spawned worker processes scoring, failing, hanging and dying."""
from __future__ import annotations

import asyncio
import logging
import os
import time

import pytest

from megarl.config.errors import ConfigError
from megarl.config.schema import RewardConfig
from megarl.controller.batch import Sample
from megarl.reward.pool import RewardPool
from megarl.reward.registry import default_compute_score


def sample(text: str, gt, data_source: str = "x") -> Sample:
    return Sample(uid="u", prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0],
                  weight_version=0, token_versions=[0], finish="stop", ground_truth=gt,
                  data_source=data_source, response_text=text, reward=-99.0)


def gone(pid: int) -> bool:
    """True when the process no longer exists (reaped, not even a zombie)."""
    return not os.path.exists(f"/proc/{pid}")


async def score_all(pool, samples):
    return await asyncio.gather(*[pool.submit(s) for s in samples])


def test_scores_match_plain_function_and_loop_stays_free():
    samples = [sample("so \\boxed{42}", "42", "openai/gsm8k"),
               sample("#### 41", "42", "gsm8k"),
               sample("7", 7, "megarl/quickstart"),
               sample("the answer is 07", 7, "megarl/quickstart")]
    expected = [default_compute_score(s.data_source, s.response_text, s.ground_truth)
                for s in samples]
    with RewardPool(None, num_workers=2, timeout_s=30) as pool:
        assert asyncio.run(score_all(pool, samples)) == expected
        assert [s.reward for s in samples] == expected
        assert pool.stats()["reward/calls"] == 4 and pool.stats()["reward/failures"] == 0

    # a 50 ms verifier must not block the event loop that submits to it
    async def with_ticker(pool):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        task = asyncio.create_task(ticker())
        scores = await score_all(pool, [sample("x" * 50, None) for _ in range(6)])
        task.cancel()
        return scores, ticks

    with RewardPool("megarl.reward.testing:slow_verifier", num_workers=2, timeout_s=30) as pool:
        asyncio.run(score_all(pool, [sample("warm", None)] * 2))  # workers started
        scores, ticks = asyncio.run(with_ticker(pool))
    assert scores == [0.5] * 6
    assert ticks >= 10  # 6 × 50 ms over 2 workers ≈ 150 ms of scoring: the loop kept ticking


def test_raising_and_junk_give_failure_score_counted_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="megarl.reward.pool")
    with RewardPool("megarl.reward.testing:raises", 1, 30, failure_score=-1.0) as pool:
        s = sample("boom", None, data_source="my/task")
        assert asyncio.run(score_all(pool, [s, sample("b", None)])) == [-1.0, -1.0]
        assert s.reward == -1.0
        st = pool.pop_stats()
        assert st["reward/calls"] == 2 and st["reward/failures"] == 2
        assert st["reward/timeouts"] == 0 and st["reward/worker_restarts"] == 0
        assert pool.stats()["reward/failures"] == 0  # pop_stats reset the step counters
    assert "my/task" in caplog.text and "verifier broke on 'boom'" in caplog.text

    with RewardPool("megarl.reward.testing:returns_junk", 1, 30, failure_score=-2.0) as pool:
        got = [pool.score("d", t, None).result(timeout=60) for t in ("nan", "str")]
        assert got == [-2.0, -2.0] and pool.stats()["reward/failures"] == 2


def test_timeout_kills_and_replaces_worker():
    with RewardPool("megarl.reward.testing:sleeps", 1, timeout_s=1.0) as pool:
        assert pool.score("d", "", 0).result(timeout=60) == 1.0  # worker is up
        old_pid = pool.worker_pids()[0]
        t0 = time.monotonic()
        assert pool.score("d", "", 1000).result(timeout=60) == 0.0
        assert time.monotonic() - t0 < 2.0
        assert pool.score("d", "", 0.01).result(timeout=60) == 1.0  # the replacement works
        st = pool.stats()
        assert st["reward/timeouts"] == 1 and st["reward/failures"] == 1
        assert st["reward/worker_restarts"] == 1 and st["reward/latency_max_s"] >= 1.0
        assert pool.worker_pids()[0] != old_pid and gone(old_pid)


def test_worker_exit_is_replaced_and_counted():
    with RewardPool("megarl.reward.testing:hard_exit", 2, timeout_s=30) as pool:
        futs = [pool.score("d", t, None) for t in ("a", "exit", "b", "exit", "c")]
        assert [f.result(timeout=60) for f in futs] == [2.0, 0.0, 2.0, 0.0, 2.0]
        st = pool.stats()
        assert st["reward/failures"] == 2 and st["reward/worker_restarts"] == 2
        assert st["reward/timeouts"] == 0


def test_file_path_spec_with_unpicklable_function(tmp_path):
    f = tmp_path / "my_reward.py"
    # a closure: cannot be pickled, so it only works if each worker imports the file itself
    f.write_text("def _make():\n"
                 "    bonus = 0.5\n"
                 "    return lambda ds, sol, gt, extra_info=None: len(sol) + bonus\n"
                 "score = _make()\n")
    cfg = RewardConfig(reward_fn=f"{f}:score", num_workers=1, timeout_s=10.0)
    with RewardPool.from_config(cfg) as pool:
        assert asyncio.run(score_all(pool, [sample("abc", None)])) == [3.5]


@pytest.mark.parametrize("spec, words", [
    ("no_such_module_xyz:fn", "cannot import module"),
    ("megarl.reward.testing:nope", "has no attribute"),
    ("not a path", "not an import path"),
    ("/nonexistent/file.py:fn", "no such file"),
])
def test_bad_spec_fails_in_constructor(spec, words):
    with pytest.raises(ConfigError, match="reward.reward_fn") as err:
        RewardPool(spec, 1, 10)
    assert words in str(err.value)


def test_bad_numbers_fail_in_constructor():
    with pytest.raises(ConfigError, match="reward.num_workers"):
        RewardPool(None, 0, 10)
    with pytest.raises(ConfigError, match="reward.timeout_s"):
        RewardPool(None, 1, 0)
    with pytest.raises(ConfigError, match="reward.failure_score"):
        RewardPool(None, 1, 1, failure_score=float("nan"))


def test_close_leaves_no_processes_and_is_idempotent():
    pool = RewardPool("megarl.reward.testing:length_score", 2, 10)
    assert pool.score("d", "abcd", None).result(timeout=60) == 4.0
    pids = pool.worker_pids()
    pool.close()
    pool.close()
    assert all(gone(p) for p in pids)
    with pytest.raises(RuntimeError, match="after close"):
        pool.score("d", "x", None)


def test_finish_reason_and_length_reach_the_reward_in_extra_info():
    # the last-digit reward pays 1.0 only when the response ended with the stop token
    stopped, cut = sample("3", "3", "megarl/last_digit"), sample("3", "3", "megarl/last_digit")
    cut.finish, cut.response_ids = "length", [2, 5, 5, 5]  # the digit and three more tokens
    stopped.extra_info = cut.extra_info = {"index": 1}
    with RewardPool(None, num_workers=1, timeout_s=30) as pool:
        # and the length in tokens: a right start cut at the cap loses 0.1 per token after it
        assert asyncio.run(score_all(pool, [stopped, cut])) == [1.0, pytest.approx(0.2)]
    assert cut.extra_info == {"index": 1}  # the sample's own dict is left as the data had it


def test_a_returned_dicts_numbers_are_kept_beside_the_score():
    """The other numbers of a dict a reward function returns are the sample's reward_extra
    (GDPO's components); a failed call has none (None), a bare number an empty dict."""
    from megarl.controller.trajectory import Trajectory

    good = sample("3", "3", "megarl/last_digit")
    good.extra_info = {"index": 0}
    bare = sample("3", "3", "megarl/last_digit")
    with RewardPool("megarl.reward.testing:scored_in_parts", num_workers=1,
                    timeout_s=30) as pool:
        asyncio.run(score_all(pool, [good]))
    assert good.reward_extra == {"acc": 1.0, "brevity": 0.5} and good.score == 1.5
    with RewardPool("megarl.reward.testing:raises", num_workers=1, timeout_s=30,
                    failure_score=-1.0) as pool:
        failed = sample("x", "3")
        asyncio.run(score_all(pool, [failed]))
    assert failed.reward_extra is None and failed.reward == -1.0
    with RewardPool(None, num_workers=1, timeout_s=30) as pool:
        asyncio.run(score_all(pool, [bare]))
    assert bare.reward_extra == {}
    # a scored trajectory carries them through a checkpoint (partial rollout's cache)
    for extra in ({"acc": 1.0, "brevity": 0.5}, None, {}):
        t = Trajectory(ids=[2], logprobs=[0.0], versions=[0], finish="stop", reward=1.5,
                       score=1.5, reward_extra=extra)
        assert Trajectory.from_dict(t.to_dict()).reward_extra == extra
