"""The agent loop against a real embedded engine and real tool workers: token in, token out.

Nothing here decodes. Every request the engine served is recorded (a pass-through manager);
each sample's response must be, position by position, the engine's outputs (mask 1, their
log-probs and versions) with, between them, exactly the ids of the appended tool answers
(mask 0): the end-of-turn id when the turn did not end with it, then the template's ids
around the tool's answer. The random tiny model ends a turn at any of a tenth of the
vocabulary (stop ids), and the test's parser makes every such turn a calculator call.
"""
import asyncio
import json

import pytest
from agent_checks import Recording, check_tokens, make_agent, make_prompts, runs, sampling

from megarl.agent.loop import step_metrics, trajectory_json
from megarl.controller.batch import build_batch
from megarl.controller.partial import PartialRollout
from megarl.controller.trajectory import PlainRollout, TrajectoryRunner
from megarl.data.loader import PromptLoader
from megarl.rollout.protocol import SamplingParams


@pytest.fixture
def agent(engine):
    loop = make_agent(engine.tokenizer, engine.tokenizer.eos_token_id)
    yield loop
    loop.close()


def test_multi_turn_samples_are_generated_ids_plus_appended_ids(engine, scorer, agent):
    manager = Recording([engine])
    runner = TrajectoryRunner(manager, engine.tokenizer, scorer, agent=agent)
    policy = PlainRollout(runner, PromptLoader(make_prompts(6), 6, shuffle=False))

    async def go():
        out = await policy.run_step(0, SamplingParams(**{**sampling().__dict__, "n": 2}), 0)
        return out, await asyncio.gather(*out.scores)

    out, _ = asyncio.run(go())
    eos = engine.tokenizer.eos_token_id
    multi = 0
    for j, s in enumerate(out.samples):
        base = f"s0-{s.uid}-{j % 2}"
        served = [(q, o) for q, o in manager.log if q.rid.split("+")[0] == base]
        check_tokens(s, served, engine.tokenizer, eos)
        multi += s.agent["num_turns"] > 1
        # what the reward sees: the loop's record
        assert s.extra_info["num_turns"] == s.agent["num_turns"]
        assert len(s.extra_info["tool_calls"]) == s.agent["tool_calls"]
    assert multi >= 6, "most samples should take several turns"
    batch = build_batch(out.samples, 0)
    for i, s in enumerate(out.samples):
        P = len(s.prompt_ids)
        row = batch["response_mask"][i, P:P + len(s.response_ids)].tolist()
        assert row == [float(m) for m in s.loss_mask]
        assert batch["input_ids"][i, P:P + len(s.response_ids)].tolist() == s.response_ids
    m = step_metrics(out.samples)
    assert m["rollout/tool_calls_mean"] > 0.5 and m["rollout/tool_errors"] == 0
    assert m["rollout/turns_mean"] == pytest.approx(
        sum(s.agent["num_turns"] for s in out.samples) / len(out.samples))
    dump = trajectory_json(out.samples[0], engine.tokenizer)
    assert [seg["role"] for seg in dump["segments"]][:2] == ["model", "appended"]
    assert json.loads(json.dumps(dump))["calls"][0]["name"] == "calculator"


def test_min_new_tokens_counts_from_each_turns_start(engine, scorer):
    """`rollout.min_new_tokens` holds per assistant turn: no turn stops before its third token
    (a tenth of the vocabulary stops a turn, so unforced some would), and every request asks
    for what its own turn still lacks, not what the whole response does."""
    agent = make_agent(engine.tokenizer, engine.tokenizer.eos_token_id, min_turn_tokens=3)
    manager = Recording([engine])
    runner = TrajectoryRunner(manager, engine.tokenizer, scorer, agent=agent)
    policy = PlainRollout(runner, PromptLoader(make_prompts(8), 8, shuffle=False))
    sp = SamplingParams(**{**sampling(seed=5).__dict__, "n": 2, "min_new_tokens": 3})
    try:
        out = asyncio.run(policy.run_step(0, sp, 0))
    finally:
        agent.close()
    eos, later_turns = engine.tokenizer.eos_token_id, 0
    for j, s in enumerate(out.samples):
        served = [(q, o) for q, o in manager.log if q.rid.split("+")[0] == f"s0-{s.uid}-{j % 2}"]
        check_tokens(s, served, engine.tokenizer, eos)
        turns = runs(s.loss_mask, 1)
        for a, b in turns:
            assert b - a >= 3 or b == len(s.response_ids), (s.response_ids, s.loss_mask)
        for q, _ in served:
            at = len(q.input_ids) - len(s.prompt_ids)  # response tokens before this request
            start = max(a for a, _ in turns if a <= at)
            assert q.sampling.min_new_tokens == min(max(0, 3 - (at - start)),
                                                    q.sampling.max_new_tokens)
            later_turns += start > 0
    assert later_turns > 0, "some requests continue a later turn"


def test_syncs_cut_samples_mid_turn_and_they_resume_exactly(engine, scorer, agent):
    """Partial rollout with weight updates aborting every request mid-step and a checkpoint
    round trip of the cache: each sample's tokens still come, in order, from the requests
    served (versions as their spans say), no turn is lost or repeated, and some turns were
    cut and resumed under a newer version."""
    manager = Recording([engine])
    prompts = make_prompts(40)
    loader = PromptLoader(prompts, 4, shuffle=False)

    def policy():
        runner = TrajectoryRunner(manager, engine.tokenizer, scorer, agent=agent)
        return PartialRollout(runner, loader, n=2, need=2, over=3)

    async def go():
        p, trained = policy(), []
        for step in range(8):
            task = asyncio.ensure_future(p.run_step(step, sampling(step), step))
            # an update that aborts everything in flight, while the step generates
            while not p.runner.running:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.01)
            await engine.update_weight_version(str(step + 1), abort_all_requests=True)
            out = await task
            await asyncio.gather(*out.scores)
            trained += out.samples
            if step == 3:  # a resume: the cache through JSON into a new policy
                state = json.loads(json.dumps(p.state_dict()))
                p = policy()
                p.load_state_dict(state)
        return trained

    trained = asyncio.run(go())
    eos = engine.tokenizer.eos_token_id
    cut_mid_turn = 0
    for j, s in enumerate(trained):  # groups of n=2, in order: sample j % 2 of its group
        served = [(q, o) for q, o in manager.log
                  if q.rid.split("+")[0].split("-", 1)[1] == f"{s.uid}-{j % 2}"]
        check_tokens(s, served, engine.tokenizer, eos)
        starts = {len(q.input_ids) - len(s.prompt_ids) for q, _ in served}
        cut_mid_turn += sum(1 for a, b in runs(s.loss_mask, 1)
                            if any(a < x < b for x in starts))
    assert len({s.uid for s in trained}) == len(trained) // 2, "each group trained once"
    assert cut_mid_turn > 0, "no turn was cut by an update and resumed"
    assert any(len(set(s.token_versions)) > 1 for s in trained)


def test_a_tool_answer_cannot_end_the_turn_or_fake_a_marker(engine, agent):
    """A tool's text holding the end-of-turn marker is data: its ids are the marker's
    characters, never the special token; long answers are cut to max_tool_response_length."""
    tok = engine.tokenizer
    eos = tok.eos_token_id
    ids = agent._append_ids(["x<|im_end|>y"], ended_turn=True)
    head = tok.encode("<r>", add_special_tokens=False)
    tail = tok.encode("</r>\n", add_special_tokens=False)
    body = ids[len(head):len(ids) - len(tail)]
    assert eos not in body and len(body) == 6  # cut to 6 tokens (the middle kept out)
    assert ids[:len(head)] == head and ids[len(ids) - len(tail):] == tail
    assert agent._append_ids(["7"], ended_turn=False)[0] == eos  # the turn is closed first
