"""The trajectory runner and the rollout policies over it, against a real embedded engine:
resume after an abort, the plain policy, and a user's rollout function named by import path."""
import asyncio
import dataclasses
import textwrap

import pytest
from omegaconf import OmegaConf

from megarl.config import ConfigError
from megarl.controller.trajectory import (FunctionRollout, PlainRollout, StepRollout,
                                          TrajectoryRunner, make_policy)
from megarl.data.dataset import Prompt
from megarl.data.loader import PromptLoader
from megarl.rollout.manager import RolloutManager
from megarl.rollout.protocol import FinishReason, GenerateRequest, SamplingParams
from megarl.utils.imports import load_callable

KEY = "actor_rollout_ref.rollout.rollout_fn"


def _prompts(count):
    return [Prompt(index=i, uid=f"p{i}", prompt_ids=[5 + i, 7, 11], raw_prompt="",
                   data_source="t", ground_truth=str(i)) for i in range(count)]


def greedy(n, k=1):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, n=k)


def test_an_aborted_sample_resumes_to_the_same_tokens_and_keeps_its_versions(engine, scorer):
    """A weight update that aborts every request (`abort_all_requests`, SGLang's) mid-sample:
    the runner resumes with the budget left; greedy on unchanged weights, the tokens are what
    an undisturbed request gives, and the versions say where the update landed."""
    runner = TrajectoryRunner(RolloutManager([engine]), engine.tokenizer, scorer)
    prompt = _prompts(1)[0]

    async def go():
        ref = await runner.sample(prompt, GenerateRequest(prompt.prompt_ids, greedy(400), True,
                                                          "ref"))
        task = asyncio.ensure_future(runner.sample(
            prompt, GenerateRequest(prompt.prompt_ids, greedy(400), True, "cut")))
        while not runner.running or engine.model_steps < 20:
            await asyncio.sleep(0.005)
        await engine.update_weight_version("1", abort_all_requests=True)
        t = await task
        return ref, t, await t.future

    ref, t, reward = asyncio.run(go())
    assert t.ids == ref.ids and len(t.ids) == 400 and t.finish == "length"
    cut = t.versions.index(1)
    assert 0 < cut < 400 and set(t.versions[:cut]) == {0} and set(t.versions[cut:]) == {1}
    assert t.sample.token_versions == t.versions and t.sample.weight_version == 0
    assert reward == t.sample.reward and runner.running == {}


class AbortRacesTheStop(RolloutManager):
    """The real manager; an output that ended on a stop id comes back as stock SGLang's abort
    answers when the abort lands in the step that sampled the stop: finish "abort", the stop
    id already in `output_ids`."""

    async def generate(self, request):
        out = await super().generate(request)
        if out.finish_reason.type == "stop":
            out = dataclasses.replace(out, finish_reason=FinishReason("abort", message="raced"))
        return out


def test_an_abort_that_raced_the_stop_token_ends_the_sample(engine, scorer):
    """Resuming such an output would generate after its stop id (seen with partial rollout on
    stock SGLang: 7% of agent turns held a second <|im_end|>); it is finished instead."""
    runner = TrajectoryRunner(AbortRacesTheStop([engine]), engine.tokenizer, scorer)
    prompt = _prompts(1)[0]
    free = asyncio.run(runner.sample(prompt, GenerateRequest(prompt.prompt_ids, greedy(60),
                                                             True, "free")))
    stop = free.ids[6]
    sp = dataclasses.replace(greedy(60), ignore_eos=False, stop_token_ids=[stop])
    t = asyncio.run(runner.sample(prompt, GenerateRequest(prompt.prompt_ids, sp, True, "r")))
    first = free.ids.index(stop)
    assert t.ids == free.ids[:first + 1] and t.finish == "stop" and t.interrupted == 0
    # with min_new_tokens the stop is banned at first; the stop drawn after it ends the sample
    late = dataclasses.replace(sp, min_new_tokens=first + 2)
    t = asyncio.run(runner.sample(prompt, GenerateRequest(prompt.prompt_ids, late, True, "m")))
    assert t.ids[:first] == free.ids[:first] and t.ids[first] != stop
    assert t.ids.index(stop) == len(t.ids) - 1 >= first + 1 and t.finish == "stop"


def test_plain_policy_draws_the_batch_and_gives_n_scored_samples_each(engine, scorer):
    loader = PromptLoader(_prompts(8), 3, shuffle=False)
    policy = PlainRollout(TrajectoryRunner(RolloutManager([engine]), engine.tokenizer, scorer),
                          loader)

    async def go():
        out = await policy.run_step(0, greedy(6, k=2), 0)
        return out, await asyncio.gather(*out.scores)

    out, rewards = asyncio.run(go())
    assert [s.uid for s in out.samples] == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert rewards == [s.reward for s in out.samples] and policy.state_dict() is None
    assert loader.state_dict()["offset"] == 3


USER_FN = textwrap.dedent('''
    from megarl.controller.trajectory import StepRollout
    from megarl.rollout.protocol import GenerateRequest


    async def two_turns(ctx, sampling):
        """Each prompt twice: its first answer is appended to the prompt of the second."""
        samples, scores = [], []
        for p in ctx.loader.next_batch():
            first = await ctx.runner.sample(p, GenerateRequest(p.prompt_ids, sampling, True,
                                                               f"s{ctx.step}-{p.uid}-a"))
            second = await ctx.runner.sample(p, GenerateRequest(
                p.prompt_ids + first.ids, sampling, True, f"s{ctx.step}-{p.uid}-b"))
            samples.append(second.sample)
            scores.append(second.future)
        return StepRollout(samples, scores, {"rollout/turns": 2.0})


    async def nothing(ctx, sampling):
        return []


    def not_async(ctx, sampling):
        return None
''')


def test_prompts_of_one_step_draw_their_own_random_streams(engine, scorer):
    """A step's sampling seed is spread over its prompts: two prompts with the same ids at
    different places in the batch sample differently (from the step's seed alone, sample i of
    every prompt drew the same numbers, so equal prompts got equal samples), and the whole
    step is reproducible from its seed."""
    runner = TrajectoryRunner(RolloutManager([engine]), engine.tokenizer, scorer)
    same = [Prompt(index=i, uid=f"p{i}", prompt_ids=[9, 7, 11], raw_prompt="",
                   data_source="t", ground_truth="0") for i in range(2)]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, n=2,
                        sampling_seed=77)

    async def go():
        return [[list(s.response_ids) for s in (await runner.prompts(same, sp, f"r{k}")).samples]
                for k in range(2)]

    first, again = asyncio.run(go())
    assert first == again  # seeded: the same step samples the same tokens
    assert first[0] != first[1]  # a prompt's two samples differ
    assert first[:2] != first[2:]  # and so do the two prompts' samples


def test_prompts_in_rounds_sample_what_one_call_does_with_a_round_in_flight(engine, scorer):
    """data.val_batch_size: validation's prompts in rounds of that many; never more than a
    round's samples in flight, and the same tokens as one call over all the prompts."""
    runner = TrajectoryRunner(RolloutManager([engine]), engine.tokenizer, scorer)
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, n=2,
                        sampling_seed=5)
    most = []

    async def watch():
        while True:
            most.append(len(runner.running))
            await asyncio.sleep(0)

    async def go(size):
        w = asyncio.ensure_future(watch())
        out = await runner.prompts(_prompts(5), sp, "v0", round_size=size)
        w.cancel()
        return [list(s.response_ids) for s in out.samples], len(out.scores)

    whole, _ = asyncio.run(go(None))
    peak_whole, most[:] = max(most), []
    rounds, n_scores = asyncio.run(go(2))
    assert rounds == whole and n_scores == len(whole) == 10
    assert max(most) == 4 < peak_whole == 10  # two prompts of two samples at a time


def test_a_rollout_function_by_import_path_runs_as_the_policy(engine, scorer, tmp_path):
    (tmp_path / "user_rollout.py").write_text(USER_FN)
    cfg = OmegaConf.create({"n": 1, "partial_rollout": False, "over_sample_prompts": None,
                            "rollout_fn": f"{tmp_path}/user_rollout.py:two_turns"})
    loader = PromptLoader(_prompts(4), 2, shuffle=False)
    runner = TrajectoryRunner(RolloutManager([engine]), engine.tokenizer, scorer)
    policy = make_policy(cfg, runner, loader, need=2, max_staleness=None, stale_policy="drop",
                         rollout_fn=load_callable(cfg.rollout_fn, KEY))
    assert isinstance(policy, FunctionRollout)

    async def go():
        out = await policy.run_step(3, greedy(5), 3)
        return out, await asyncio.gather(*out.scores)

    out, rewards = asyncio.run(go())
    assert [s.uid for s in out.samples] == ["p0", "p1"] and out.metrics == {"rollout/turns": 2.0}
    # the second turn's prompt holds the first answer
    assert all(len(s.prompt_ids) == 3 + 5 and len(s.response_ids) == 5 for s in out.samples)
    assert rewards == [s.reward for s in out.samples]

    bad = FunctionRollout(load_callable(f"{tmp_path}/user_rollout.py:nothing", KEY),
                          "nothing", runner, loader, 1)
    with pytest.raises(TypeError, match="nothing returned list; it must return a StepRollout"):
        asyncio.run(bad.run_step(0, greedy(2), 0))
    with pytest.raises(ConfigError, match=f"{KEY}: 'x' is not an `async def`"):
        FunctionRollout(load_callable(f"{tmp_path}/user_rollout.py:not_async", KEY), "x",
                        runner, loader, 1)
    with pytest.raises(ConfigError, match=f"{KEY}: .*has no attribute 'missing'"):
        load_callable(f"{tmp_path}/user_rollout.py:missing", KEY)
    assert StepRollout([], []).metrics == {}


@pytest.mark.parametrize("override,match", [
    ("actor_rollout_ref.rollout.rollout_fn=nocolon", f"{KEY}: 'nocolon' is not an import path"),
    ("actor_rollout_ref.rollout.rollout_fn=a:b", "partial_rollout=true is one of them"),
])
def test_config_refuses_a_bad_rollout_fn_naming_the_key(override, match):
    from megarl.config import load_config

    extra = ["actor_rollout_ref.rollout.partial_rollout=true"] if "a:b" in override else []
    with pytest.raises(ConfigError, match=match):
        load_config("configs/quickstart.yaml", [override, *extra])


def test_remax_generates_a_greedy_baseline_per_prompt_beside_its_samples(engine, scorer):
    """`prompts(remax=True)`: each sample's `baseline` is the reward of its prompt's greedy
    response (the length scorer: its text's length), one extra request per prompt, counted."""
    import dataclasses as dc

    from megarl.controller.batch import build_batch
    from megarl.data.dataset import Prompt
    from megarl.rollout.manager import RolloutManager
    from megarl.rollout.protocol import SamplingParams

    prompts = [Prompt(index=i, uid=f"p{i}", prompt_ids=[5 + i, 7, 11 + i], raw_prompt="",
                      data_source="t", ground_truth="0") for i in range(3)]
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, n=4, sampling_seed=5,
                        stop_token_ids=list(range(0, 300, 10)))
    runner = TrajectoryRunner(RolloutManager([engine]), engine.tokenizer, scorer)

    async def go():
        out = await runner.prompts(prompts, sp, "s0", remax=True)
        await asyncio.gather(*out.scores)
        greedy = await runner.prompts(prompts, dc.replace(sp, n=1, temperature=0.0,
                                                          sampling_seed=None), "check")
        return out, [len(s.response_text) for s in greedy.samples]

    out, greedy_lengths = asyncio.run(go())
    assert len(out.samples) == 12 and out.metrics["rollout/remax/baseline_requests"] == 3
    want = dict(zip([p.uid for p in prompts], map(float, greedy_lengths)))
    assert [s.baseline for s in out.samples] == [want[s.uid] for s in out.samples]
    assert out.metrics["rollout/remax/baseline_reward_mean"] == sum(want.values()) / 3
    b = build_batch(out.samples, pad_id=0)
    assert b["reward_baselines"].tolist() == [want[s.uid] for s in out.samples]
