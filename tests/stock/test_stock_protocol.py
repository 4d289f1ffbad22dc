"""megarl's client, engine adapter, rollout manager and weight producer against the stock
`sglang.launch_server` on this CPU: generation equals transformers, and the audit's findings
(a prefix cache that outlived a weight update, /health during a pause, aborts lost during a
pause, verify mode, refusals, seeds, user-run servers' TP) are fixed where stock shows them.

One server serves the whole module (tests/stock/conftest.py); a test that changes its weights
puts the original ones back, and versions are read, not assumed."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch
from safetensors.torch import load_file

from megarl.backends.sglang import SGLangEngine
from megarl.config import ConfigError
from megarl.rollout.manager import RolloutManager
from megarl.rollout.protocol import GenerateRequest
from megarl.weight_sync.producer import SyncStats, WeightProducer
from megarl.weight_sync.protocol import SyncConfig, WeightSyncError
from megarl.weight_sync.transports import EngineLink
from megarl.weight_sync.verify import SentDigest
from stock_helpers import (PROMPT, assert_serves_like_transformers, generate, greedy,
                           hf_greedy, run)

KB = 1 / 1024  # MiB

def weights(model_dir):
    return sorted(load_file(str(model_dir / "model.safetensors")).items())


def deliver(prod, named, version):
    """One version as the trainer's coordinator runs it for one stage."""
    stats = SyncStats(version)
    prod.open_version(version)
    try:
        return prod.send(prod.stream(iter(named), version), version, True, stats)
    finally:
        prod.close_version(dict(prod.stale))


def producer(url, **cfg):
    prod = WeightProducer([EngineLink(url, 1, pause_for_update=True)],
                          SyncConfig(consume_bucket_mb=cfg.pop("bucket", 16 * KB), **cfg))
    prod.connect("127.0.0.1")
    return prod


def current_version(url) -> int:
    async def go():
        engine = SGLangEngine(url)
        try:
            return int(await engine.get_weight_version())
        finally:
            await engine.close()
    return run(go())


def test_greedy_tokens_and_logprobs_equal_transformers(stock_server, qwen_dir):
    assert_serves_like_transformers(stock_server.url, qwen_dir)


def test_after_a_sync_a_prompt_seen_before_gives_the_new_weights_tokens(
        stock_server, qwen_dir, qwen_dir_b):
    """Finding 1: the prompt's KV from the old weights must not be reused after the update,
    though a request is in flight when the update pauses the engine."""
    url = stock_server.url
    old = run(generate(url, rid="seen"))  # the prompt enters the radix cache
    assert old.output_ids == hf_greedy(qwen_dir, PROMPT)
    base = current_version(url)

    prod = producer(url)  # the group first: its rendezvous is no part of the update

    async def scenario():
        # long requests, running when the update pauses the engine (retracted, then resumed)
        longs = [asyncio.ensure_future(generate(url, [9, 8, 7, i], greedy(480), rid=f"l{i}"))
                 for i in range(3)]
        await asyncio.sleep(0.3)
        await asyncio.to_thread(deliver, prod, weights(qwen_dir_b), base + 1)
        again = await generate(url, rid="seen-again")
        return again, await asyncio.gather(*longs)

    try:
        again, longs = run(scenario())
        assert again.output_ids == hf_greedy(qwen_dir_b, PROMPT) != old.output_ids
        assert again.weight_version_spans == [(str(base + 1), 0, 8)]
        # requests that ran across the update: their spans say where the weights changed
        spans = [o.token_versions() for o in longs]
        assert all(len(v) == 480 and v == sorted(v) for v in spans)
        across = [(o, v.index(base + 1)) for o, v in zip(longs, spans)
                  if v[0] == base and v[-1] == base + 1]
        assert across
        # and what followed the switch was computed on the new weights from the whole prefix
        # (the retracted request's KV was rebuilt, not reused)
        o, k = across[0]
        prefix = [9, 8, 7, longs.index(o)] + o.output_ids[:k]
        n = min(12, 480 - k)
        assert o.output_ids[k:k + n] == hf_greedy(qwen_dir_b, prefix, n)
        deliver(prod, weights(qwen_dir), base + 2)  # the module's server as it was
        assert run(generate(url, rid="back")).output_ids == old.output_ids
    finally:
        prod.close()


def test_verify_mode_compares_stock_cpu_checksums_with_the_trainers(stock_server, qwen_dir,
                                                                   qwen_dir_b):
    """Finding 4: on a CPU stock server verify compares every parameter (fused qkv_proj and
    gate_up_proj included) with what was sent, and catches an engine that differs."""
    url = stock_server.url
    base = current_version(url)
    prod = producer(url, verify=True)
    try:
        deliver(prod, weights(qwen_dir_b), base + 1)
        digest = prod.sent_checksums
        compared = prod.verify(base + 1, digest)
        fused = [n for n in digest.checksums if "qkv_proj" in n or "gate_up_proj" in n]
        assert len(fused) == 2 * 3  # per layer: qkv weight + bias, gate_up weight
        assert compared[url] >= len(fused) + 5
        # the engine now holds other weights than this digest says were sent
        prod.sent_checksums = SentDigest()
        deliver(prod, weights(qwen_dir), base + 2)
        with pytest.raises(WeightSyncError, match="differ"):
            prod.verify(base + 2, digest)
    finally:
        prod.close()


def test_a_long_pause_does_not_get_a_healthy_engine_marked_dead(stock_server):
    """Finding 2: stock's /health generates, and waits on a pause for 20 s; the manager's
    health check must not, or a long sync would have a healthy engine replaced."""
    url = stock_server.url

    async def go():
        m = RolloutManager([SGLangEngine(url)], health_interval_s=0.2, health_timeout_s=1.0)
        control = SGLangEngine(url)
        try:
            task = asyncio.ensure_future(m.generate(
                GenerateRequest([3, 1, 4, 1, 5], greedy(200), rid="held")))
            await asyncio.sleep(0.5)
            await control.pause("retract")
            await asyncio.sleep(4.0)  # four health timeouts
            dead_during = dict(m.dead)
            await control.resume()
            out = await asyncio.wait_for(task, 120)
            return dead_during, dict(m.dead), out
        finally:
            await control.resume()
            await control.close()
            await m.close()

    during, after, out = run(go())
    assert during == {} and after == {}
    assert len(out.output_ids) == 200 and not out.aborted


def test_an_abort_sent_during_a_pause_takes_effect(stock_server):
    """Finding 3: a request that reached the server while it was paused is held before the
    scheduler, and stock drops an abort for it; megarl answers it as aborted anyway."""
    url = stock_server.url

    async def go():
        control = SGLangEngine(url)
        engine = SGLangEngine(url, abort_grace_s=1.0)
        try:
            await control.pause("retract")
            task = asyncio.ensure_future(engine.generate(
                GenerateRequest([2, 7, 1, 8], greedy(400), rid="tail")))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            await engine.abort("tail")
            out = await asyncio.wait_for(task, 30)
            waited = time.monotonic() - t0
        finally:
            await control.resume()
            await control.close()
            await engine.close()
        return out, waited

    out, waited = run(go())
    assert out.aborted and out.output_ids == [] and waited < 10


def test_a_refusal_is_the_refusing_engines_and_the_group_bounds_its_wait(stock_server):
    """Finding 6: stock words a refusal (an unknown group) like a failed receive; it must be
    blamed on that engine, not on a peer. Finding 7: every wait is bounded by the bucket's
    bytes at the configured minimum bandwidth."""
    from megarl.weight_sync.producer import _refused

    url = stock_server.url

    async def refused():
        engine = SGLangEngine(url)
        try:
            await engine.begin_weight_update()
            try:
                await engine.update_weights_from_distributed(
                    ["model.norm.weight"], ["float32"], [[64]], group_name="no-such-group",
                    load_format="flattened_bucket")
            finally:
                await engine.end_weight_update()
        finally:
            await engine.close()

    with pytest.raises(Exception) as e:
        run(refused())
    assert "Failed to receive weights" in str(e.value) and _refused(str(e.value))
    assert not _refused("Failed to receive weights: Connection closed by peer")
    cfg = SyncConfig(timeout_s=10, min_bandwidth_mbps=100)
    assert cfg.bucket_timeout_s(int(500e6)) == pytest.approx(15.0)


def test_seeds_and_user_run_servers_tp(stock_server, caplog):
    """Finding 8: a server run without --enable-deterministic-inference ignores sampling
    seeds, so megarl sends none and says so; a user-run server's TP is read from it."""
    from megarl.config.preflight import check_user_servers

    url = stock_server.url
    with caplog.at_level(logging.WARNING, logger="megarl.backends.sglang.engine"):
        out = run(generate(url, sp=greedy(4, sampling_seed=123)))
    assert len(out.output_ids) == 4
    assert "ignores sampling seeds" in caplog.text
    check_user_servers([url], 1)
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size is 2.*tp_size 1"):
        check_user_servers([url], 2)

    async def tensor_update():
        engine = SGLangEngine(url)
        try:
            await engine.update_weights_from_tensor([("model.norm.weight", torch.ones(64))])
        finally:
            await engine.close()

    with pytest.raises(NotImplementedError, match="update_weights_from_distributed"):
        run(tensor_update())
