"""Every request megarl sends, checked against the pinned stock SGLang release's own types.

megarl's real code paths run against embedded servers that record what reaches them: the
rollout adapter (generate with the sampling params the driver builds, abort, pause, continue,
flush, model info), the rollout manager, and whole weight versions through the producer and
its engine link (update group, begin/end session, flattened buckets, the version on the last
call, the stale-engine marking, `/weights_checker`). Each recorded body must have only fields
stock SGLang reads, with values it accepts; each `/generate` answer must decode with the
release's response type, and its version spans must be the ones megarl reads."""
import asyncio

import pytest
import torch
from safetensors.torch import load_file

from megarl.backends.sglang.engine import SGLangEngine
from megarl.controller.trajectory import sampling_params
from megarl.rollout.engine import EmbeddedEngine
from megarl.rollout.manager import RolloutManager
from megarl.rollout.protocol import GenerateRequest
from megarl.rollout.server import ServerThread
from megarl.weight_sync.producer import SyncStats, WeightProducer
from megarl.weight_sync.protocol import SyncConfig
from megarl.weight_sync.transports import STALE_VERSION, EngineLink

# Every endpoint megarl calls on a running server: a path missing from the recording means
# the flows below no longer cover it.
USED = {"/generate", "/abort_request", "/pause_generation", "/continue_generation",
        "/flush_cache", "/model_info", "/init_weights_update_group",
        "/destroy_weights_update_group", "/begin_weight_update", "/end_weight_update",
        "/update_weights_from_distributed", "/update_weight_version", "/weights_checker"}


class _Rollout:
    """Rollout settings as the driver's config has them."""
    temperature, top_p, top_k, n = 0.8, 0.9, 20, 2
    min_new_tokens = 1  # on the wire as SGLang's own field
    val_kwargs = type("V", (), {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "n": 1,
                                "do_sample": False})()


@pytest.fixture(scope="module")
def recorded(qwen_dir, qwen_dir_b):
    log: list = []
    staged = ServerThread(EmbeddedEngine(qwen_dir, weight_version="0", load_tokenizer=False),
                          record=log).__enter__()
    live = ServerThread(EmbeddedEngine(qwen_dir, weight_version="0", load_tokenizer=False,
                                       tp_size=2, live_updates=True),
                        record=log).__enter__()
    try:
        outs = asyncio.run(_rollout_flows(staged.url, live.url))
        _weight_flows(staged.url, live, qwen_dir_b)
    finally:
        staged.__exit__(None, None, None)
        live.__exit__(None, None, None)
    return log, outs


async def _rollout_flows(*urls):
    engines = [SGLangEngine(u) for u in urls]
    manager = RolloutManager(engines)
    try:
        outs = []
        for validation in (False, True):
            sp = sampling_params(_Rollout, [2], seed=3, validation=validation,
                                 max_new_tokens=6)
            req = GenerateRequest([5, 6, 7], sp, True, "s1-7")
            outs += [o async for o in manager.stream([req])]
        long = GenerateRequest([5, 6, 7], sampling_params(_Rollout, [2], 1, max_new_tokens=500),
                               True, "p-1")
        outs += [o async for o in manager.generate_until([long, GenerateRequest(
            [8, 9], sampling_params(_Rollout, [2], 1, max_new_tokens=2), True, "p-10")], 2)]
        await asyncio.gather(*[e.pause("in_place") for e in engines])
        await asyncio.gather(*[e.resume() for e in engines])
        await manager.flush_cache()
        await manager.weight_versions()
        return outs
    finally:
        await manager.close()


def _weight_flows(staged_url, live, model_dir):
    from megarl.weight_sync.buckets import plan_buckets
    from megarl.weight_sync.protocol import TensorSpec

    named = sorted(load_file(str(model_dir / "model.safetensors")).items())
    cfg = SyncConfig(consume_bucket_mb=1 / 128)
    per_version = len(plan_buckets([TensorSpec.of(n, t) for n, t in named], cfg.bucket_bytes))
    live.engine.fail_update_at = per_version + 2  # refuses a call in the middle of v2
    live_url = live.url
    prod = WeightProducer([EngineLink(staged_url, 1, pause_for_update=False),
                           EngineLink(live_url, 2)], cfg)
    prod.connect("127.0.0.1")
    try:
        for version in (1, 2):
            stats = SyncStats(version)
            prod.open_version()
            prod.send(prod.stream(iter(named), version), version, True, stats)
            prod.close_version(dict(prod.stale))
            named = [(n, t + 1) for n, t in named]
        assert list(prod.stale) == [live_url]
        prod.engine_checksums()
    finally:
        prod.close()


def test_every_request_is_one_stock_sglang_reads_in_full(recorded, stock_sglang):
    log, _ = recorded
    assert USED <= {path for path, *_ in log}, USED - {path for path, *_ in log}
    for path, body, status, _ in log:
        stock_sglang.check_request(path, body)


def test_weight_updates_are_flattened_whole_tensor_buckets_with_the_version_last(recorded):
    log, _ = recorded
    calls = [b for p, b, *_ in log if p == "/update_weights_from_distributed"]
    assert calls and all(b["load_format"] == "flattened_bucket" and b["flush_cache"] is False
                         for b in calls)
    for b in calls:
        dtypes = {getattr(torch, d) for d in b["dtypes"]}
        assert len(dtypes) == 1  # one dtype per bucket: aligned offsets, no padding
    versioned = [b["weight_version"] for b in calls if "weight_version" in b]
    assert versioned == ["1", "1", "2"]  # the last call of each version, on each engine
    ends = [b for p, b, *_ in log if p == "/end_weight_update"]
    assert ends and all(not b for b in ends)  # no fields: stock has none
    marks = [b for p, b, *_ in log if p == "/update_weight_version"]
    assert marks == [{"new_version": STALE_VERSION, "abort_all_requests": True}]


def test_rids_on_the_wire_are_prefix_free(recorded):
    """Stock `/abort_request` aborts every rid starting with the one given."""
    log, _ = recorded
    sent = [b["rid"] for p, b, *_ in log if p == "/generate"]
    raw = [r.removesuffix("#") for r in sent]
    # megarl's own rids do nest ("s1-7" and its samples "s1-7-0", ...): the mark is needed
    assert "s1-7" in raw and "s1-7-0" in raw
    assert not any(a != b and b.startswith(a) for a in sent for b in sent)
    aborted = [b["rid"] for p, b, *_ in log if p == "/abort_request" and b.get("rid")]
    assert aborted and all(r.endswith("#") for r in aborted)


def test_generate_answers_decode_as_stock_responses_and_spans_give_versions(recorded,
                                                                             stock_sglang):
    log, outs = recorded
    answers = [resp for p, _, status, resp in log if p == "/generate" and status == 200]
    assert answers
    for resp in answers:
        decoded = stock_sglang.check_response("/generate", resp)
        meta = decoded.meta_info
        if not decoded.output_ids:  # aborted before its first token: no token, no span
            assert meta.weight_versions == [], meta
            continue
        assert meta.weight_versions and meta.weight_version == meta.weight_versions[-1].version
        assert meta.weight_versions[-1].end == len(decoded.output_ids)
    assert all(len(o.token_versions()) == len(o.output_ids) for o in outs)
    assert any(o.aborted for o in outs)  # the long tail, aborted by its prefix-free rid


def test_routed_experts_are_asked_for_in_stocks_fields_and_only_when_wanted(tiny_qwen3_moe,
                                                                            stock_sglang):
    """Routing replay's request fields reach the server only on requests that ask (a server
    that predates them never sees them otherwise), and the answer carrying
    `meta_info.routed_experts` decodes as a stock response."""
    log: list = []
    engine = EmbeddedEngine(tiny_qwen3_moe, load_tokenizer=False,
                            enable_return_routed_experts=True)
    sp = sampling_params(_Rollout, [2], seed=None, validation=True, max_new_tokens=3)

    async def go(url):
        adapter = SGLangEngine(url)
        try:
            return [await adapter.generate(GenerateRequest(
                [5, 6, 7], sp, True, f"r{on}", return_routed_experts=on,
                routed_experts_start_len=1)) for on in (True, False)]
        finally:
            await adapter.close()

    with ServerThread(engine, record=log) as server:
        asked, plain = asyncio.run(go(server.url))
    assert asked.routed_experts and plain.routed_experts is None
    sent = [(b, resp) for p, b, status, resp in log if p == "/generate" and status == 200]
    assert [(b.get("return_routed_experts"), b.get("routed_experts_start_len"))
            for b, _ in sent] == [(True, 1), (None, None)]
    for body, resp in sent:
        stock_sglang.check_request("/generate", body)
        stock_sglang.check_response("/generate", resp)
    assert "routed_experts" in sent[0][1]["meta_info"]
    assert "routed_experts" not in sent[1][1]["meta_info"]
