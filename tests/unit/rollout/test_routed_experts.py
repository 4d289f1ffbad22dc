"""Routed experts (R3) on the embedded engine, in stock SGLang 0.5.23's contract: for a tiny
Qwen3-MoE every reported position equals transformers' own routing (softmax of the router's
logits, top-k) recomputed over prompt + output, from `routed_experts_start_len` to the token
before the last; continuations, weight swaps and retracts report the forward pass that
processed each position; the flag, the field and bad starts behave as stock's."""
import asyncio
import dataclasses
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megarl.backends.sglang import SGLangEngine
from megarl.rollout.engine import EmbeddedEngine
from megarl.rollout.protocol import (BadRequest, GenerateOutput, GenerateRequest,
                                     SamplingParams, continuation, decode_routed_experts,
                                     encode_routed_experts)
from megarl.rollout.server import ServerThread
from megarl.utils.tiny_model import make_tiny_model

run = asyncio.run
LAYERS, TOPK = 2, 2  # tests/conftest.py's tiny Qwen3-MoE: 2 layers, 8 experts, top-2
PROMPTS = [[5, 17, 42, 99, 123, 7, 250, 31, 64, 11], [9, 8, 7, 6, 5], [200, 3, 77]]


def greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def sampled(n, seed):
    return SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, sampling_seed=seed)


def routed(req, **kw):
    return GenerateRequest(req[0], req[1], return_routed_experts=True, **kw)


@pytest.fixture(scope="module")
def moe_engine(tiny_qwen3_moe):
    eng = EmbeddedEngine(tiny_qwen3_moe, weight_version="0", load_tokenizer=False,
                         enable_return_routed_experts=True)
    yield eng
    run(eng.close())


def _load(model):
    if isinstance(model, torch.nn.Module):
        return model
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def hf_routing(model, ids, then=None, switch_at=None) -> np.ndarray:
    """transformers' routing of every position of `ids`: [tokens, layers, topk], recomputed
    from each router's input (softmax of its logits, sorted top-k), not read from its output.
    With `then`, positions from `switch_at` on run on that model over the first one's cache
    (a weight swap between two decode steps)."""
    models = [_load(model)] + ([_load(then)] if then is not None else [])
    got: dict[int, list] = {i: [] for i in range(LAYERS)}

    def hook(i):
        def fn(mod, args, out):
            x = args[0].reshape(-1, args[0].shape[-1])
            probs = torch.softmax(torch.nn.functional.linear(x, mod.weight).float(), -1)
            got[i].append(torch.topk(probs, TOPK, dim=-1).indices)
        return fn

    handles = [layer.mlp.gate.register_forward_hook(hook(i))
               for m in models for i, layer in enumerate(m.model.layers)]
    try:
        with torch.no_grad():
            if then is None:
                models[0](torch.tensor([ids]))
            else:
                cache = models[0](torch.tensor([ids[:switch_at]]), use_cache=True)
                models[1](torch.tensor([ids[switch_at:]]), use_cache=True,
                          past_key_values=cache.past_key_values)
    finally:
        for h in handles:
            h.remove()
    return torch.stack([torch.cat(got[i]) for i in range(LAYERS)], 1).numpy()


def rows_of(out: GenerateOutput) -> np.ndarray:
    return decode_routed_experts(out.routed_experts, LAYERS, TOPK)


async def wait_tokens(engine, rid, k):
    while rid not in engine._seqs or len(engine._seqs[rid].output_ids) < k:
        await asyncio.sleep(0.002)


def test_batched_greedy_and_sampled_requests_report_transformers_routing(moe_engine,
                                                                         tiny_qwen3_moe):
    """Rows of different lengths prefilled together and decoded in one batch, one joining
    mid-decode, one not asking (its rows must not disturb the others)."""
    first = [routed((PROMPTS[0], greedy(9))), routed((PROMPTS[1], sampled(7, 3)),
                                                     routed_experts_start_len=2),
             GenerateRequest(PROMPTS[2], greedy(12))]
    later = [routed((PROMPTS[2], sampled(6, 5)), routed_experts_start_len=3),
             routed((PROMPTS[1], greedy(1)), routed_experts_start_len=5)]

    async def go():
        tasks = [asyncio.ensure_future(moe_engine.generate(r)) for r in first]
        await wait_tokens(moe_engine, first[0].rid, 3)
        tasks += [asyncio.ensure_future(moe_engine.generate(r)) for r in later]
        return await asyncio.gather(*tasks)

    outs = run(go())
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32).eval()
    for req, out in zip(first + later, outs):
        if not req.return_routed_experts:
            assert out.routed_experts is None
            continue
        seq = req.input_ids + out.output_ids
        want = hf_routing(model, seq)[req.routed_experts_start_len:len(seq) - 1]
        np.testing.assert_array_equal(rows_of(out), want, err_msg=req.rid)
    # start_len == len(prompt) with one output token: no row at all, as stock answers
    assert rows_of(outs[-1]).shape == (0, LAYERS, TOPK)


def test_a_continuation_after_an_abort_covers_what_the_first_attempt_did_not(moe_engine,
                                                                             tiny_qwen3_moe):
    req = GenerateRequest(PROMPTS[0], greedy(400), rid="cut", return_routed_experts=True)

    async def first_attempt():
        task = asyncio.ensure_future(moe_engine.generate(req))
        await wait_tokens(moe_engine, "cut", 4)
        await moe_engine.abort("cut")
        return await task

    a = run(first_attempt())
    assert a.aborted and len(a.output_ids) >= 4
    nxt = continuation(req, a.output_ids)
    assert nxt.routed_experts_start_len == len(PROMPTS[0]) + len(a.output_ids) - 1
    nxt.sampling.max_new_tokens = 5
    b = run(moe_engine.generate(nxt))
    seq = PROMPTS[0] + a.output_ids + b.output_ids
    assert len(rows_of(a)) == len(PROMPTS[0]) + len(a.output_ids) - 1
    joined = np.concatenate([rows_of(a), rows_of(b)])
    np.testing.assert_array_equal(joined, hf_routing(tiny_qwen3_moe, seq)[:len(seq) - 1])


@pytest.fixture(scope="module")
def moe_b(tiny_qwen3_moe, tmp_path_factory):
    """Same shapes as tiny_qwen3_moe, other weights (routing included)."""
    return make_tiny_model(tmp_path_factory.mktemp("moe-b") / "model", "qwen3_moe", seed=1,
                           head_dim=24, vocab_size=300, hidden_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, intermediate_size=128)


async def _swap_to(engine, named, version):
    await engine.begin_weight_update()
    await engine.update_weights_from_tensor(named, version, flush_cache=False)
    await engine.end_weight_update()


@pytest.mark.parametrize("retract", [False, True])
def test_each_position_reports_the_weights_of_the_pass_that_processed_it(tiny_qwen3_moe, moe_b,
                                                                         retract):
    """A swap between two decode steps: positions processed before it keep the old routing
    (output token i came from the pass over position len(prompt) + i - 1, so the version
    spans say which). After a retract the re-prefill processes them all again, under the new
    weights, and its routing replaces the old (stock's rebuilt KV slots do the same)."""
    engine = EmbeddedEngine(tiny_qwen3_moe, weight_version="0", load_tokenizer=False,
                            enable_return_routed_experts=True)
    req = GenerateRequest(PROMPTS[0], greedy(60), rid="swap", return_routed_experts=True)
    named = list(load_file(str(moe_b / "model.safetensors")).items())  # ready before it starts

    async def go():
        task = asyncio.ensure_future(engine.generate(req))
        await wait_tokens(engine, "swap", 4)
        if retract:
            await engine.pause("retract")
        await _swap_to(engine, named, "1")
        if retract:
            await engine.resume()
        return await task

    try:
        out = run(go())
    finally:
        run(engine.close())
    seq, prompt = PROMPTS[0] + out.output_ids, len(PROMPTS[0])
    versions = out.token_versions()
    assert versions[0] == 0 and versions[-1] == 1
    new = hf_routing(moe_b, seq)[:len(seq) - 1]
    if retract:
        want = new
    else:
        # output token i was sampled by the pass over position prompt + i - 1: the first
        # new-version token names the first position the new weights processed
        switch = prompt + versions.index(1) - 1
        want = hf_routing(tiny_qwen3_moe, seq, then=moe_b, switch_at=switch)[:len(seq) - 1]
        assert not np.array_equal(want, new)  # the old weights' rows show
    np.testing.assert_array_equal(rows_of(out), want)


def test_a_request_aborted_while_queued_gets_none_as_from_stock(moe_engine):
    """Stock answers an abort from its waiting queue (here: after a retract) without routed
    experts, though the request has tokens."""
    async def go():
        task = asyncio.ensure_future(moe_engine.generate(
            routed((PROMPTS[0], greedy(400)), rid="held")))
        await wait_tokens(moe_engine, "held", 3)
        await moe_engine.pause("retract")
        try:
            await moe_engine.abort("held")
        finally:
            await moe_engine.resume()
        return await task

    out = run(go())
    assert out.aborted and len(out.output_ids) >= 3 and out.routed_experts is None


def test_no_routed_experts_unless_asked_and_enabled(moe_engine, tiny_qwen3_moe):
    out = run(moe_engine.generate(GenerateRequest(PROMPTS[1], greedy(3))))
    assert out.routed_experts is None and "routed_experts" not in out.to_sglang()["meta_info"]
    # a server started without the flag ignores the ask, as stock does
    plain = EmbeddedEngine(tiny_qwen3_moe, load_tokenizer=False)
    try:
        out = run(plain.generate(routed((PROMPTS[1], greedy(3)))))
    finally:
        run(plain.close())
    assert out.routed_experts is None and out.output_ids


def test_a_dense_model_refuses_the_flag_as_stock_does(qwen_dir):
    """Stock 0.5.23 fails at start-up (no num_experts_per_tok); here with a clear message."""
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        EmbeddedEngine(qwen_dir, load_tokenizer=False, enable_return_routed_experts=True)


@pytest.mark.parametrize("start", [-1, len(PROMPTS[1]) + 1])
def test_a_start_outside_the_prompt_is_refused_only_when_asked_for(moe_engine, start):
    with pytest.raises(BadRequest) as e:
        moe_engine.check(routed((PROMPTS[1], greedy(3)), routed_experts_start_len=start))
    assert e.value.field == "routed_experts_start_len"
    # stock checks the range only for requests that ask for routed experts
    moe_engine.check(GenerateRequest(PROMPTS[1], greedy(3), routed_experts_start_len=start))


def _post(url, body):
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_embedded_server_speaks_stocks_wire(tiny_qwen3_moe):
    engine = EmbeddedEngine(tiny_qwen3_moe, load_tokenizer=False,
                            enable_return_routed_experts=True)
    with ServerThread(engine) as server:  # closes the engine on leaving
        sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        ok = {"input_ids": PROMPTS[2], "sampling_params": sp, "return_routed_experts": True,
              "routed_experts_start_len": 1}
        status, body = _post(server.url, ok)
        assert status == 200
        seq = PROMPTS[2] + body["output_ids"]
        np.testing.assert_array_equal(
            decode_routed_experts(body["meta_info"]["routed_experts"], LAYERS, TOPK),
            hf_routing(tiny_qwen3_moe, seq)[1:len(seq) - 1])
        for bad, field in [(-1, "routed_experts_start_len"), (4, "routed_experts_start_len"),
                           ("1", "routed_experts_start_len")]:
            status, body = _post(server.url, {**ok, "routed_experts_start_len": bad})
            assert status == 400 and body["error"]["field"] == field, body
        status, body = _post(server.url, {**ok, "return_routed_experts": [True]})
        assert status == 400 and body["error"]["field"] == "return_routed_experts"

        async def through_the_adapter():  # megarl's client sends the fields, reads the answer
            engine = SGLangEngine(server.url)
            try:
                return await engine.generate(routed((PROMPTS[0], greedy(3)),
                                                    routed_experts_start_len=4))
            finally:
                await engine.close()

        out = run(through_the_adapter())
        seq = PROMPTS[0] + out.output_ids
        np.testing.assert_array_equal(rows_of(out), hf_routing(tiny_qwen3_moe, seq)[4:-1])


def test_wire_helpers_round_trip_and_name_the_field():
    rows = np.arange(3 * LAYERS * TOPK, dtype=np.int32).reshape(3, LAYERS, TOPK)
    np.testing.assert_array_equal(decode_routed_experts(encode_routed_experts(rows), LAYERS,
                                                        TOPK), rows)
    with pytest.raises(ValueError, match=r"meta_info\.routed_experts"):
        decode_routed_experts(encode_routed_experts(rows), LAYERS, 5)
    with pytest.raises(ValueError, match=r"meta_info\.routed_experts"):
        decode_routed_experts("not base64!", LAYERS, TOPK)
    out = GenerateOutput("r", 2, [4], None, GenerateOutput.from_sglang({}).finish_reason, "0",
                         routed_experts=encode_routed_experts(rows))
    assert GenerateOutput.from_sglang(out.to_sglang()).routed_experts == out.routed_experts
    req = GenerateRequest([1, 2], SamplingParams(n=2), return_routed_experts=True,
                          routed_experts_start_len=1)
    assert all(r.return_routed_experts and r.routed_experts_start_len == 1
               for r in req.expand())


# ------------------------------------------------------- the trajectory runner and the batch
def test_a_sample_cut_by_an_update_keeps_every_positions_routing(moe_engine, tiny_qwen3_moe):
    """The runner asks each request from the first position the sample's earlier requests
    did not cover: a sample aborted by a weight update (unchanged weights) and resumed ends
    with one routing row per position but its last, equal to transformers'; it survives the
    trajectory's checkpoint form and lands in the batch, experts 0..k-1 where none ran."""
    from megarl.controller.batch import build_batch
    from megarl.controller.trajectory import Trajectory, TrajectoryRunner
    from megarl.data.dataset import Prompt
    from megarl.rollout.manager import RolloutManager

    runner = TrajectoryRunner(RolloutManager([moe_engine]), None, routing=(LAYERS, TOPK))
    prompt = Prompt(index=0, uid="p0", prompt_ids=PROMPTS[0], raw_prompt="", data_source="t",
                    ground_truth="")

    async def go():
        task = asyncio.ensure_future(runner.sample(
            prompt, GenerateRequest(list(PROMPTS[0]), greedy(24), True, "cut")))
        await wait_tokens(moe_engine, "cut", 6)
        await moe_engine.update_weight_version("1", abort_all_requests=True)
        return await task

    runner.tokenizer = type("Tok", (), {"decode": staticmethod(lambda ids, **kw: "")})()
    t = run(go())
    assert len(t.routed) == 2 and 1 in t.versions  # two requests, the second resumed
    sample = t.sample
    whole = PROMPTS[0] + sample.response_ids
    assert sample.routed_experts.shape == (len(whole) - 1, LAYERS, TOPK)
    np.testing.assert_array_equal(sample.routed_experts, hf_routing(tiny_qwen3_moe, whole)[:-1])
    back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.routed_len == t.routed_len
    np.testing.assert_array_equal(back.routed[0], sample.routed_experts)
    short = dataclasses.replace(sample, response_ids=sample.response_ids[:5],
                                rollout_logprobs=sample.rollout_logprobs[:5],
                                token_versions=sample.token_versions[:5],
                                routed_experts=sample.routed_experts[:len(PROMPTS[0]) + 4])
    batch = build_batch([sample, short], pad_id=0)
    routed = batch["routed_experts"]
    assert routed.dtype == torch.int16 and routed.shape == (2, len(whole), LAYERS, TOPK)
    assert torch.equal(routed[0, :len(whole) - 1], torch.from_numpy(sample.routed_experts))
    spare = torch.arange(TOPK, dtype=torch.int16)
    assert (routed[0, -1] == spare).all() and (routed[1, len(PROMPTS[0]) + 4:] == spare).all()
    with pytest.raises(ValueError, match="routed experts missing"):
        build_batch([sample, dataclasses.replace(short, routed_experts=None)], pad_id=0)
