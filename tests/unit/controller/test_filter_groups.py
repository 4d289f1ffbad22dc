"""Dynamic sampling (`algorithm.filter_groups`) against a real embedded engine and reward pool.

The reward (`megarl.reward.testing:constant_for_even`) gives every sample of an even prompt
the same score, so each of their groups has no spread and must be dropped; an odd prompt's
samples score by length, which a random tiny model varies. What each test asserts holds
whatever was sampled: every even prompt drawn is dropped, every trained group has a spread,
and every prompt drawn is trained, dropped or (partial rollout) cached, exactly once.
"""
import asyncio

import pytest
from omegaconf import OmegaConf

from megarl.config import load_config
from megarl.config.errors import ConfigError
from megarl.config.validate import validate_config
from megarl.controller.filter_groups import FilteredRollout, FilterGroupsExhausted
from megarl.controller.partial import PartialRollout
from megarl.controller.trajectory import PlainRollout, TrajectoryRunner, make_policy
from megarl.data.dataset import Prompt
from megarl.data.loader import PromptLoader
from megarl.reward.pool import RewardPool
from megarl.rollout.manager import RolloutManager
from megarl.rollout.protocol import SamplingParams

N = 3
BATCH = 4


@pytest.fixture
def parity_scorer():
    pool = RewardPool("megarl.reward.testing:constant_for_even", 2, 30.0)
    yield pool
    pool.close()


def _prompts(count):
    return [Prompt(index=i, uid=f"p{i}", prompt_ids=[5 + i % 50, 7, 11 + i % 13],
                   raw_prompt="", data_source="t", ground_truth=str(i)) for i in range(count)]


def _sp(seed=1):
    # a tenth of the vocabulary stops: lengths vary (roughly geometric, mean ~10)
    return SamplingParams(max_new_tokens=24, temperature=1.0,
                          stop_token_ids=list(range(0, 300, 10)), sampling_seed=seed, n=N)


def _runner(engine, scorer):
    return TrajectoryRunner(RolloutManager([engine]), engine.tokenizer, scorer)


async def _groups(samples, futs):
    """uid -> the group's rewards, in the order the samples came."""
    rewards = await asyncio.gather(*futs)
    out = {}
    for s, r in zip(samples, rewards):
        out.setdefault(s.uid, []).append(r)
    return out


def _drawn(loader_offset, prompts):
    return {p.uid for p in prompts[:loader_offset]}


def test_plain_rollout_drops_groups_without_spread_and_draws_until_the_batch_is_full(
        engine, parity_scorer):
    prompts = _prompts(64)
    loader = PromptLoader(prompts, BATCH, shuffle=False)
    policy = FilteredRollout(_runner(engine, parity_scorer), loader, need=BATCH)

    async def go():
        seen = []
        for k in range(3):
            out = await policy.run_step(k, _sp(k + 1), k)
            groups = await _groups(out.samples, out.scores)
            assert len(groups) == BATCH and all(len(r) == N for r in groups.values())
            assert all(len(set(r)) > 1 for r in groups.values()), groups  # each has a spread
            # even prompts never train; what was drawn is trained, dropped or surplus
            assert all(int(u[1:]) % 2 for u in groups), sorted(groups)
            m = out.metrics
            consumed = int(m["rollout/filter_groups/prompts_consumed"])
            assert consumed == BATCH * m["rollout/filter_groups/gen_batches"] >= 2 * BATCH
            assert len(groups) + len(out.filtered) + len(out.surplus) == consumed
            assert m["rollout/filter_groups/filtered_groups"] == len(out.filtered) >= BATCH
            seen += [*groups, *out.filtered, *out.surplus]
        return seen

    seen = asyncio.run(go())
    assert len(seen) == len(set(seen)), "a prompt was consumed twice"
    assert set(seen) == _drawn(loader.state_dict()["offset"], prompts)


def test_a_step_past_max_num_gen_batches_fails_naming_the_key(engine, parity_scorer):
    # one batch of 4 prompts holds 2 even ones: never 4 groups with a spread
    loader = PromptLoader(_prompts(64), BATCH, shuffle=False)
    policy = FilteredRollout(_runner(engine, parity_scorer), loader, need=BATCH,
                             max_num_gen_batches=1)
    with pytest.raises(FilterGroupsExhausted,
                       match=r"step 0: 1 generation batch\(es\) drawn \(algorithm\.filter_groups"
                             r"\.max_num_gen_batches=1\) and only [0-2] of the 4 prompt groups"):
        asyncio.run(policy.run_step(0, _sp(), 0))


@pytest.mark.parametrize("remax", [False, True])
def test_partial_rollout_drops_complete_groups_without_spread_exactly_once(
        engine, parity_scorer, remax):
    """With remax, a group is judged by its samples' rewards once its baseline is scored too;
    a dropped group's baseline goes with it (generated once, counted, never resumed)."""
    prompts = _prompts(96)
    loader = PromptLoader(prompts, BATCH, shuffle=False)
    pr = PartialRollout(_runner(engine, parity_scorer), loader, n=N, need=BATCH, over=2,
                        filter_max_gen_batches=0, remax=remax)
    baselines = []

    async def go():
        trained, filtered = [], []
        for k in range(4):
            out = await pr.run_step(k, _sp(k + 1), k)
            groups = await _groups(out.samples, out.scores)
            assert len(groups) == BATCH and all(len(set(r)) > 1 for r in groups.values())
            assert all(int(u[1:]) % 2 for u in groups)
            assert out.metrics["rollout/filter_groups/filtered_groups"] == len(out.filtered)
            trained += list(groups)
            filtered += out.filtered
            if remax:
                assert all(s.baseline is not None for s in out.samples)
                baselines.append(out.metrics["rollout/remax/baseline_requests"])
            await engine.update_weight_version(str(k + 1), abort_all_requests=False)
        return trained, filtered

    trained, filtered = asyncio.run(go())
    cached = [g.prompt.uid for g in pr.cache]
    everything = trained + filtered + cached
    assert len(everything) == len(set(everything)), "a prompt trained, dropped or cached twice"
    assert set(everything) == _drawn(loader.state_dict()["offset"], prompts)
    assert {u for u in everything if int(u[1:]) % 2 == 0} <= set(filtered) | set(cached)
    assert len(filtered) >= 2 * 4  # at least the even prompts of the trained steps' draws
    if remax:  # one greedy response finished per group trained, dropped, or cached finished
        assert sum(baselines) == len(trained) + len(filtered) + sum(
            g.baseline.finish is not None for g in pr.cache)


def _cfg(*overrides):
    return load_config(None, ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4", *overrides])


def test_the_config_key_picks_the_policy_a_run_builds(engine, parity_scorer):
    runner = _runner(engine, parity_scorer)
    loader = PromptLoader(_prompts(8), BATCH, shuffle=False)
    for overrides, kind in [([], PlainRollout),
                            (["algorithm.filter_groups.enable=true"], FilteredRollout),
                            (["algorithm.filter_groups.enable=true",
                              "actor_rollout_ref.rollout.partial_rollout=true"], PartialRollout)]:
        cfg = _cfg(*overrides)
        validate_config(cfg)
        policy = make_policy(cfg.actor_rollout_ref.rollout, runner, loader, need=4,
                             max_staleness=None, stale_policy="drop", rollout_fn=None,
                             filter_groups=cfg.algorithm.filter_groups)
        assert type(policy) is kind
    cfg = _cfg("algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.partial_rollout=true")
    validate_config(cfg)
    assert make_policy(cfg.actor_rollout_ref.rollout, runner, loader, need=4, max_staleness=None,
                       stale_policy="drop", rollout_fn=None, filter_groups=None,
                       remax=True).remax
    cfg = _cfg("algorithm.filter_groups.enable=true",
               "actor_rollout_ref.rollout.partial_rollout=true")
    assert make_policy(cfg.actor_rollout_ref.rollout, runner, loader, need=4, max_staleness=None,
                       stale_policy="drop", rollout_fn=None,
                       filter_groups=cfg.algorithm.filter_groups).filter_max == 0


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.filter_groups.metric=overlong"],
     r"algorithm\.filter_groups\.metric: 'overlong' is not a number megarl keeps per "),
    (["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=1"],
     r"algorithm\.filter_groups\.enable: with actor_rollout_ref\.rollout\.n=1 a group has one"),
    (["algorithm.filter_groups.enable=true",
      "actor_rollout_ref.rollout.rollout_fn=megarl.reward.testing:length_score"],
     r"algorithm\.filter_groups\.enable: a rollout function"),
])
def test_bad_settings_are_refused_by_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(_cfg(*overrides))


def _scored(rewards, scores):
    """Samples as the reward pool leaves them: `reward` (what trains), `score` (the
    function's own), and their done futures."""
    from megarl.controller.batch import Sample

    async def make():
        loop = asyncio.get_running_loop()
        samples, futs = [], []
        for r, s in zip(rewards, scores):
            samples.append(Sample(uid="u", prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0],
                                  weight_version=0, token_versions=[0], finish="stop", reward=r,
                                  score=s))
            futs.append(loop.create_future())
            futs[-1].set_result(r)
        return samples, futs
    return make


@pytest.mark.parametrize("metric, kept", [("reward", True), ("seq_reward", True),
                                          ("acc", False), ("score", False)])
def test_the_metric_names_the_reward_or_the_score_before_the_overlong_penalty(metric, kept):
    from megarl.controller.filter_groups import has_spread

    async def go():
        # every answer right (score 1), one run into the overlong buffer (reward 0.5)
        samples, futs = await _scored([1.0, 0.5, 1.0], [1.0, 1.0, 1.0])()
        return await has_spread(futs, samples, metric)

    assert asyncio.run(go()) is kept
