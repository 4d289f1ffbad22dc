"""Partial rollout against a real embedded engine: interrupt, cache, resume, checkpoint state.

Response lengths are long-tailed: a random tiny model samples near-uniformly, and a tenth of
the vocabulary is made a stop token, so lengths are roughly geometric (mean ~10) under a
budget of 48 tokens.
"""
import asyncio
import json

import pytest

from megarl.controller.partial import PartialRollout
from megarl.controller.trajectory import TrajectoryRunner
from megarl.data.dataset import Prompt
from megarl.data.loader import PromptLoader
from megarl.rollout.manager import RolloutManager
from megarl.rollout.protocol import SamplingParams

N = 2


def _prompts(count):
    return [Prompt(index=i, uid=f"p{i}", prompt_ids=[5 + i % 50, 7, 11 + i % 13],
                   raw_prompt="", data_source="t", ground_truth=str(i)) for i in range(count)]


def _sp(seed=1):
    return SamplingParams(max_new_tokens=48, temperature=1.0, stop_token_ids=list(range(0, 300,
                                                                                      10)),
                          sampling_seed=seed)


def _new(engine, loader, scorer, **kw):
    runner = TrajectoryRunner(RolloutManager([engine]), engine.tokenizer, scorer)
    return PartialRollout(runner, loader, n=N, need=kw.pop("need", 2),
                          over=kw.pop("over", 4), **kw)


async def _bump(engine, version: int):
    """A weight "update" that only moves the version (the weights stay), like a sync: SGLang's
    `/update_weight_version`, without aborting anything."""
    await engine.update_weight_version(str(version), abort_all_requests=False)


def _drawn(loader_state_offset, prompts):
    return {p.uid for p in prompts[:loader_state_offset]}


def test_steps_train_whole_groups_once_and_resume_partials(engine, scorer):
    prompts = _prompts(64)
    loader = PromptLoader(prompts, 4, shuffle=False)
    pr = _new(engine, loader, scorer)

    async def go():
        trained, spanned, ratios = [], [], []
        for k in range(5):
            samples, futs, m, dropped = await pr.run_step(k, _sp(k + 1), k)
            rewards = await asyncio.gather(*futs)
            assert not dropped
            # exactly `need` whole groups, every sample finished and scored
            uids = [s.uid for s in samples]
            assert len(samples) == 2 * N and sorted(set(uids)) == sorted(uids)[::N]
            assert all(s.finish in ("stop", "length") for s in samples)
            assert [s.reward for s in samples] == rewards
            for s in samples:
                assert len(s.response_ids) == len(s.rollout_logprobs) == len(s.token_versions)
                assert s.response_text == engine.tokenizer.decode(s.response_ids,
                                                                  skip_special_tokens=True)
            trained += sorted(set(uids))
            spanned.append(m["rollout/partial/versions_spanned_max"])
            ratios.append(m["rollout/partial/ratio"])
            # keeps need + over groups going: what did not finish is cached
            assert m["rollout/partial/cached_groups"] >= 4
            await _bump(engine, k + 1)
        return trained, spanned, ratios

    trained, spanned, ratios = asyncio.run(go())
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    cached = {g.prompt.uid for g in pr.cache}
    assert not cached & set(trained)
    # nothing lost: trained + cached is exactly what was drawn, in loader order
    assert set(trained) | cached == _drawn(loader.state_dict()["offset"], prompts)
    # the long tail was cut and resumed under newer weights
    assert max(ratios) > 0
    assert max(spanned) >= 2


def test_cache_survives_a_checkpoint_round_trip(engine, scorer):
    prompts = _prompts(64)
    loader = PromptLoader(prompts, 4, shuffle=False)
    pr = _new(engine, loader, scorer)

    async def go():
        await pr.run_step(0, _sp(), 0)
        state = json.loads(json.dumps(pr.state_dict()))
        pos = loader.state_dict()
        started = [g for g in pr.cache if g.started]
        # a second process picks up where the first stopped
        loader2 = PromptLoader(prompts, 4, shuffle=False)
        loader2.load_state_dict(pos)
        pr2 = _new(engine, loader2, scorer)
        pr2.load_state_dict(state)
        assert [g.prompt.uid for g in pr2.cache] == [g.prompt.uid for g in pr.cache]
        for a, b in zip(pr.cache, pr2.cache):
            assert [t.ids for t in a.samples] == [t.ids for t in b.samples]
            assert [t.versions for t in a.samples] == [t.versions for t in b.samples]
        samples, futs, m, _ = await pr2.run_step(1, _sp(2), 1)
        await asyncio.gather(*futs)
        # resumed trajectories keep the tokens they had: they start with the cached prefix
        prefixes = {(g.prompt.uid, i): t.ids for g in started for i, t in enumerate(g.samples)}
        by_uid = {}
        for s in samples:
            by_uid.setdefault(s.uid, []).append(s)
        for uid, ss in by_uid.items():
            for i, s in enumerate(ss):
                pre = prefixes.get((uid, i))
                if pre:
                    assert s.response_ids[:len(pre)] == pre
        return state

    asyncio.run(go())


def test_one_prompt_in_flight_twice_runs_as_two_groups_of_their_own(engine, scorer):
    """Three prompts, six groups in flight: every prompt is drawn twice in one step (as a
    group cached at an epoch's end meets the next epoch's draw of its prompt). Each draw's
    requests have their own ids (the engine refuses an id already in flight, which failed
    such a run) and their own seeds, so the two groups are not copies of each other; the
    serials survive a checkpoint."""
    prompts = _prompts(3)
    pr = _new(engine, PromptLoader(prompts, 1, shuffle=False), scorer, need=4, over=2)

    async def go():
        samples, futs, _, _ = await pr.run_step(0, _sp(7), 0)
        await asyncio.gather(*futs)
        return samples

    samples = asyncio.run(go())
    by_uid = {}
    for s in samples:
        by_uid.setdefault(s.uid, []).append(tuple(s.response_ids))
    twice = [groups for groups in by_uid.values() if len(groups) == 2 * N]
    assert twice, by_uid  # 4 groups of 3 prompts: one prompt trained twice in this step
    for groups in twice:
        assert groups[:N] != groups[N:], "two draws of a prompt sampled the same responses"
    serials = sorted(g.serial for g in pr.cache)
    assert len(set(serials)) == len(serials) and pr.drawn == 4 + len(pr.cache)
    state = json.loads(json.dumps(pr.state_dict()))
    pr2 = _new(engine, PromptLoader(prompts, 1, shuffle=False), scorer, need=4, over=2)
    pr2.load_state_dict(state)
    assert [g.serial for g in pr2.cache] == [g.serial for g in pr.cache]
    assert pr2.drawn == pr.drawn


def test_a_changed_data_set_is_refused(engine, scorer):
    prompts = _prompts(32)
    loader = PromptLoader(prompts, 4, shuffle=False)
    pr = _new(engine, loader, scorer)
    asyncio.run(pr.run_step(0, _sp(), 0))
    state = pr.state_dict()
    other = [Prompt(index=p.index, uid=f"x{p.index}", prompt_ids=p.prompt_ids, raw_prompt="",
                    data_source="t", ground_truth="") for p in prompts]
    pr2 = _new(engine, PromptLoader(other, 4, shuffle=False), scorer)
    with pytest.raises(ValueError, match="data changed"):
        pr2.load_state_dict(state)


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_stale_cached_groups_are_dropped_or_regenerated(engine, scorer, policy):
    prompts = _prompts(64)
    loader = PromptLoader(prompts, 4, shuffle=False)
    pr = _new(engine, loader, scorer, max_staleness=0, stale_policy=policy)

    async def go():
        await pr.run_step(0, _sp(), 0)
        started = {g.prompt.uid for g in pr.cache if g.started}
        assert started, "the first step left no partial trajectory to test with"
        await _bump(engine, 1)
        samples, futs, m, dropped = await pr.run_step(1, _sp(2), 1)
        await asyncio.gather(*futs)
        return started, samples, m, dropped

    started, samples, m, dropped = asyncio.run(go())
    # staleness is judged on the oldest token: v0 tokens trained at v1 are 1 behind
    for s in samples:
        assert 1 - min(s.token_versions) <= 0
    if policy == "drop":
        assert set(dropped) == started
        assert m["rollout/stale_dropped"] == len(started) * N  # samples
        assert not {s.uid for s in samples} & started
        assert not {g.prompt.uid for g in pr.cache} & started
    else:
        assert not dropped
        assert m["rollout/stale_regenerated"] == len(started) * N


def test_remax_baseline_is_cut_off_cached_and_resumed_with_its_group(engine, scorer):
    """remax under partial rollout: each group's greedy response is aborted, cached and
    checkpointed with its samples, resumed under newer versions, and scored before its group
    is trained; every trained sample's `baseline` is the reward (length scorer: the text's
    length) of its prompt's whole greedy response."""
    import dataclasses as dc

    prompts = _prompts(64)
    loader = PromptLoader(prompts, 4, shuffle=False)
    pr = _new(engine, loader, scorer, remax=True)

    async def go():
        trained, metrics = [], []
        samples, futs, m, _ = await pr.run_step(0, _sp(1), 0)
        await asyncio.gather(*futs)
        trained += samples
        metrics.append(m)
        state = json.loads(json.dumps(pr.state_dict()))
        cut = {g["uid"]: g["baseline"] for g in state["groups"]
               if g["baseline"]["ids"] and g["baseline"]["finish"] is None}
        # a second process resumes the cache, baselines and all
        loader2 = PromptLoader(prompts, 4, shuffle=False)
        loader2.load_state_dict(loader.state_dict())
        pr2 = _new(engine, loader2, scorer, remax=True)
        pr2.load_state_dict(state)
        for a, b in zip(pr.cache, pr2.cache):
            assert (a.baseline.ids, a.baseline.versions) == (b.baseline.ids, b.baseline.versions)
        spans = []
        for k in range(1, 4):
            await _bump(engine, k)
            samples, futs, m, _ = await pr2.run_step(k, _sp(k + 1), k)
            await asyncio.gather(*futs)
            trained += samples
            metrics.append(m)
            spans += [len(set(g.baseline.versions)) for g in pr2.cache]
        greedy = await pr2.runner.prompts(
            prompts[:loader2.state_dict()["offset"]],
            dc.replace(_sp(), n=1, temperature=0.0, sampling_seed=None), "check")
        return trained, metrics, state, cut, spans, pr2, greedy

    trained, metrics, state, cut, spans, pr2, greedy = asyncio.run(go())
    full = {s.uid: s for s in greedy.samples}
    assert cut, "no baseline was cut off by step 0's end"
    for uid, b in cut.items():  # the cut one kept its tokens and their versions
        assert full[uid].response_ids[:len(b["ids"])] == b["ids"]
        assert b["versions"] == [0] * len(b["ids"])
    assert max(spans) >= 2, "no cached baseline spans two weight versions"
    uids = [s.uid for s in trained]
    assert len(set(uids)) == len(uids) // N, "a prompt was trained twice"
    for s in trained:
        assert s.baseline == float(len(full[s.uid].response_text)), s.uid
    mean = [sum(s.baseline for s in trained[i:i + 2 * N:N]) / 2
            for i in range(0, len(trained), 2 * N)]
    assert [m["rollout/remax/baseline_reward_mean"] for m in metrics] == mean
    assert sum(m["rollout/remax/baseline_requests"] for m in metrics) >= len(trained) // N
    # a cache saved without remax gets fresh baselines; one loaded without remax loses them
    plain = _new(engine, PromptLoader(prompts, 4, shuffle=False), scorer)
    plain.load_state_dict(state)
    assert all(g.baseline is None for g in plain.cache)
    again = _new(engine, PromptLoader(prompts, 4, shuffle=False), scorer, remax=True)
    again.load_state_dict(plain.state_dict())
    assert all(g.baseline is not None and not g.baseline.ids for g in again.cache)
