"""The embedded engine against transformers itself: tokens, log-probs, scheduling, control."""
import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from megarl.rollout.engine import EmbeddedEngine
from megarl.rollout.protocol import BadRequest, EngineClosed, GenerateRequest, SamplingParams

run = asyncio.run

PROMPTS = [[11, 12, 13], [40, 41, 42, 43, 44, 45, 46], [7], [100, 90, 80, 70],
           [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 201]]


def greedy(max_new, **kw):
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **kw)


def hf_greedy(model, prompt, max_new):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def recompute_logprobs(model, prompt, output, temperature):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


async def wait_tokens(engine, rid, k):
    while rid not in engine._seqs or len(engine._seqs[rid].output_ids) < k:
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("model_dir", ["qwen_dir", "llama_dir"])
def test_greedy_equals_transformers_generate_with_requests_joining_midway(model_dir, request):
    path = request.getfixturevalue(model_dir)
    engine = EmbeddedEngine(path)
    lengths = [17, 9, 24, 5, 30, 12]

    async def go():
        first = [GenerateRequest(p, greedy(n)) for p, n in zip(PROMPTS[:3], lengths[:3])]
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in first]
        await wait_tokens(engine, first[0].rid, 4)  # the batch is mid-decode now
        later = [GenerateRequest(p, greedy(n)) for p, n in zip(PROMPTS[3:], lengths[3:])]
        tasks += [asyncio.ensure_future(engine.generate(r)) for r in later]
        return await asyncio.gather(*tasks)

    outs = run(go())
    ref_model = AutoModelForCausalLM.from_pretrained(path).eval()
    for out, prompt, n in zip(outs, PROMPTS, lengths):
        assert out.output_ids == hf_greedy(ref_model, prompt, n)
        assert out.finish_reason.type == "length" and out.finish_reason.length == n
    run(engine.close())


def test_logprobs_equal_recomputation(engine):
    sps = [SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, sampling_seed=1),
           SamplingParams(max_new_tokens=12, temperature=1.3, top_k=20, sampling_seed=2),
           greedy(15)]

    async def go():
        return await asyncio.gather(*[engine.generate(GenerateRequest(p, sp))
                                      for p, sp in zip(PROMPTS, sps)])

    for out, prompt, sp in zip(run(go()), PROMPTS, sps):
        ref = recompute_logprobs(engine.model, prompt, out.output_ids, sp.temperature)
        assert torch.allclose(torch.tensor(out.output_logprobs), ref, atol=1e-4)


def test_seeded_sampling_is_reproducible_alone_or_batched(engine):
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95, sampling_seed=1234)

    async def alone():
        return (await engine.generate(GenerateRequest(PROMPTS[1], sp))).output_ids

    async def batched():
        others = [GenerateRequest(p, SamplingParams(max_new_tokens=30, temperature=1.0))
                  for p in PROMPTS[2:]]
        outs = await asyncio.gather(engine.generate(GenerateRequest(PROMPTS[1], sp)),
                                    *[engine.generate(r) for r in others])
        return outs[0].output_ids

    a, b, c = run(alone()), run(alone()), run(batched())
    assert a == b == c
    other_seed = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95, sampling_seed=9)
    d = run(engine.generate(GenerateRequest(PROMPTS[1], other_seed))).output_ids
    assert d != a


def test_short_responses_are_handed_back_first(engine):
    lengths = [60, 4, 30, 12]
    finished = []

    async def one(n, rid):
        out = await engine.generate(GenerateRequest(PROMPTS[0], greedy(n), rid=rid))
        # How far the longest row had got when this one came back.
        long_seq = engine._seqs.get("long")
        finished.append((len(out.output_ids), len(long_seq.output_ids) if long_seq else None))

    async def go():
        await asyncio.gather(*[one(n, "long" if n == 60 else f"r{n}") for n in lengths])

    run(go())
    assert [n for n, _ in finished] == [4, 12, 30, 60]
    # The short ones came back while the long one was still generating.
    assert all(progress is not None and progress < 60 for _, progress in finished[:3])


def test_stop_tokens_and_min_new_tokens(engine):
    free = run(engine.generate(GenerateRequest(PROMPTS[3], greedy(20)))).output_ids
    stop = free[5]
    first = free.index(stop)
    out = run(engine.generate(GenerateRequest(PROMPTS[3], greedy(20, stop_token_ids=[stop]))))
    assert out.output_ids == free[:first + 1]
    assert out.finish_reason.type == "stop" and out.finish_reason.matched == stop
    late = run(engine.generate(GenerateRequest(
        PROMPTS[3], greedy(20, stop_token_ids=[stop], min_new_tokens=first + 2))))
    assert len(late.output_ids) > first + 1


def test_eos_ends_generation_unless_ignored(engine):
    eos = next(iter(engine.eos_token_ids))
    out = run(engine.generate(GenerateRequest(PROMPTS[0], SamplingParams(
        max_new_tokens=400, temperature=1.0, sampling_seed=3))))
    assert out.finish_reason.type in ("stop", "length")
    if out.finish_reason.type == "stop":
        assert out.output_ids[-1] == eos and eos not in out.output_ids[:-1]


def test_context_limits(qwen_dir):
    engine = EmbeddedEngine(qwen_dir, context_length=16)
    with pytest.raises(BadRequest) as e:
        run(engine.generate(GenerateRequest(list(range(1, 17)), greedy(4))))
    assert e.value.field == "input_ids"
    out = run(engine.generate(GenerateRequest(list(range(1, 14)), greedy(10))))
    assert len(out.output_ids) == 3 and out.finish_reason.type == "length"
    run(engine.close())


def test_a_call_after_close_is_refused_not_run_on_the_stopped_model_thread(qwen_dir):
    """A run shutting down while its trainer still syncs: an end_weight_update (or any call
    that needs the model thread) reaching the closed engine is refused with a 503, not a
    RuntimeError from the shut-down executor (a 500 and a traceback in the run's log)."""
    engine = EmbeddedEngine(qwen_dir)

    async def go():
        await engine.generate(GenerateRequest([11, 12], greedy(2)))
        await engine.close()
        await engine.read_weights(lambda get, version: version)

    with pytest.raises(EngineClosed) as e:
        run(go())
    assert e.value.status == 503 and e.value.field == "engine"


def test_abort_mid_generation_returns_partial_output(engine):
    async def go():
        req = GenerateRequest(PROMPTS[1], greedy(2000), rid="victim")
        task = asyncio.ensure_future(engine.generate(req))
        await wait_tokens(engine, "victim", 6)
        await engine.abort("victim")
        return await task

    out = run(go())
    assert out.finish_reason.type == "abort" and out.aborted
    assert 6 <= len(out.output_ids) < 2000 and len(out.output_logprobs) == len(out.output_ids)
    ref = run(engine.generate(GenerateRequest(PROMPTS[1], greedy(len(out.output_ids)))))
    assert out.output_ids == ref.output_ids
    assert engine.stats()["running"] == 0


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_holds_requests_and_continue_finishes_them(engine, mode):
    async def go():
        req = GenerateRequest(PROMPTS[4], greedy(40), rid="held")
        task = asyncio.ensure_future(engine.generate(req))
        await wait_tokens(engine, "held", 5)
        await engine.pause(mode)
        seen = len(engine._seqs["held"].output_ids)
        queued = asyncio.ensure_future(engine.generate(GenerateRequest(PROMPTS[0], greedy(3))))
        await asyncio.sleep(0.2)
        assert len(engine._seqs["held"].output_ids) == seen and not task.done()
        assert not queued.done()
        await engine.resume()
        return await task, await queued

    out, queued = run(go())
    assert out.finish_reason.type == "length"
    assert out.output_ids == run(engine.generate(GenerateRequest(PROMPTS[4], greedy(40)))).output_ids
    assert len(queued.output_ids) == 3


def test_pause_in_abort_mode_aborts_running_and_holds_new(engine):
    async def go():
        task = asyncio.ensure_future(engine.generate(GenerateRequest(PROMPTS[0], greedy(2000),
                                                                     rid="r")))
        await wait_tokens(engine, "r", 3)
        await engine.pause("abort")
        aborted = await task
        later = asyncio.ensure_future(engine.generate(GenerateRequest(PROMPTS[0], greedy(3))))
        await asyncio.sleep(0.1)
        assert not later.done()
        await engine.resume()
        return aborted, await later

    aborted, later = run(go())
    assert aborted.aborted and len(aborted.output_ids) >= 3
    assert later.finish_reason.type == "length"
    assert run(engine.flush_cache())


def test_bad_pause_mode(engine):
    with pytest.raises(BadRequest, match="mode"):
        run(engine.pause("sideways"))
