"""The rollout manager over two embedded engines: spreading, streaming, long-tail abort."""
import asyncio

import pytest

from megarl.rollout.engine import EmbeddedEngine
from megarl.rollout.manager import RolloutManager
from megarl.rollout.protocol import GenerateRequest, SamplingParams, continuation

run = asyncio.run


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture
def manager(qwen_dir):
    m = RolloutManager([EmbeddedEngine(qwen_dir), EmbeddedEngine(qwen_dir)])
    yield m
    run(m.close())


def test_least_loaded_spreads_and_streams_short_first(manager):
    reqs = [GenerateRequest([10 + i, 20], greedy(n)) for i, n in enumerate([40, 30, 3, 6])]

    async def go():
        tasks = [asyncio.ensure_future(manager.generate(r)) for r in reqs]
        await asyncio.sleep(0)  # every task has been routed, none can have finished
        load = manager.load()
        await asyncio.gather(*tasks)
        return load, [o async for o in manager.stream(reqs)]

    load, outs = run(go())
    assert load == [2, 2]
    lengths = [len(o.output_ids) for o in outs]
    # short ones come back first; each pair runs on two engines, whose relative speed on a
    # shared box decides the order inside the pair
    assert sorted(lengths[:2]) == [3, 6] and sorted(lengths[2:]) == [30, 40]
    assert manager.in_flight == {} and manager.load() == [0, 0]


def test_generate_until_aborts_the_long_tail_and_partials_resume(manager):
    reqs = [GenerateRequest([7, 8, 9], greedy(n), rid=f"r{n}") for n in (4, 5, 2000, 3000)]

    async def go():
        return [o async for o in manager.generate_until(reqs, enough=2)]

    outs = run(go())
    assert [o.aborted for o in outs] == [False, False, True, True]
    partial = next(o for o in outs if o.rid == "r2000")
    assert 0 < len(partial.output_ids) < 2000
    # The tail resumes where it stopped and, greedy, continues the same sequence.
    nxt = continuation(reqs[2], partial.output_ids)
    rest = run(manager.generate(GenerateRequest(nxt.input_ids, greedy(5), rid="resume")))
    full = run(manager.generate(GenerateRequest([7, 8, 9], greedy(len(partial.output_ids) + 5))))
    assert partial.output_ids + rest.output_ids == full.output_ids


def test_n_samples_expand_and_versions(manager):
    req = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4, n=3, sampling_seed=0))

    async def go():
        return [o async for o in manager.stream([req])]

    outs = run(go())
    assert sorted(o.rid for o in outs) == [f"{req.rid}-{i}" for i in range(3)]
    assert run(manager.weight_versions()) == ["default", "default"]
    assert run(manager.flush_cache())


def test_stale_engine_is_dropped_and_its_requests_go_elsewhere(manager):
    """A failed sync leaves an engine at a version megarl never sets (transports.STALE_VERSION):
    its outputs are not used and nothing more is routed to it."""
    async def go():
        await manager.engines[0].update_weight_version("stale", abort_all_requests=True)
        outs = [await manager.generate(GenerateRequest([5, 6], greedy(3))) for _ in range(3)]
        return outs, await manager.weight_versions()

    outs, versions = run(go())
    assert manager.stale == {0: "stale"} and versions == ["default"]
    assert all(o.token_versions() == [0, 0, 0] for o in outs)
    assert manager.engines[1].generated_tokens == 9
