"""Producer → embedded engine servers over HTTP and a real gloo update group, through stock
SGLang's weight contract: bit-exact delivery checked with `/weights_checker`, versions, TP rank
offsets, and engines that fail mid-version (after or before receiving a bucket)."""
import time

import pytest
import torch
from safetensors.torch import load_file

from megarl.rollout.weights import tensor_checksum
from megarl.weight_sync.producer import WeightProducer
from megarl.weight_sync.protocol import SyncConfig, WeightSyncError
from megarl.weight_sync.transports import STALE_VERSION, EngineLink

from ws_helpers import EngineServer, deliver

KB = 1 / 1024  # MiB


def trainer_weights(model_dir):
    return sorted(load_file(str(model_dir / "model.safetensors")).items())


def connect(links, **cfg):
    prod = WeightProducer(links, SyncConfig(**cfg))
    prod.connect("127.0.0.1")
    return prod


def assert_bit_exact(prod, named, engines=None):
    want = {n: tensor_checksum(t) for n, t in named}
    for got in prod.engine_checksums():
        assert {n: got[n] for n in want} == want


@pytest.mark.parametrize("dual", [True, False], ids=["dual", "stream"])
def test_sync_is_bit_exact_and_versioned(engine_server, ws_model_b, dual):
    named = trainer_weights(ws_model_b)
    prod = connect([EngineLink(engine_server.url, pause_for_update=False)],
                   dual_buffer=dual, consume_bucket_mb=8 * KB)
    try:
        stats = deliver(prod, named, 1, dual)
        assert stats.buckets >= 3 and stats.stale == []
        # each broadcast was ordered after its bytes' mark and waited for to completion (the
        # side-stream path, a no-op stream on CPU: megarl.utils.streams)
        assert (prod._side.ordered, prod._side.completed) == (stats.buckets, stats.buckets)
        assert engine_server.engine.weight_version == "1"
        assert_bit_exact(prod, named)
        stats = deliver(prod, trainer_weights(engine_server.engine.model_path and ws_model_b), 2,
                        dual)
        assert engine_server.engine.weight_version == "2"
    finally:
        prod.close()


def test_two_engines_one_of_tp2_loading_live(ws_model, ws_model_b):
    """The TP-2 engine holds ranks offset and offset+1, as stock SGLang does; a wrong offset
    would not even form the group."""
    a = EngineServer(ws_model)
    b = EngineServer(ws_model, tp_size=2, live_updates=True)
    named = trainer_weights(ws_model_b)
    prod = connect([EngineLink(b.url, 2), EngineLink(a.url, 1, pause_for_update=False)],
                   consume_bucket_mb=8 * KB)
    try:
        assert [g.rank for g in b.engine._groups[prod.group_name].groups] == [1, 2]
        assert [g.rank for g in a.engine._groups[prod.group_name].groups] == [3]
        deliver(prod, named, 7)
        assert_bit_exact(prod, named)
        assert (a.engine.weight_version, b.engine.weight_version) == ("7", "7")
        assert not b.engine.paused  # paused for the version, continued after it
    finally:
        prod.close()
        a.close()
        b.close()


def test_engine_failing_mid_version_is_marked_stale_and_dropped(ws_model, ws_model_b):
    """`success: false` on the 2nd update call (after its bytes arrived): that engine gets the
    stale version and leaves the group; the other engine gets the whole version and the next."""
    good = EngineServer(ws_model)
    bad = EngineServer(ws_model, live_updates=True, fail_update_at=2)
    named = trainer_weights(ws_model_b)
    prod = connect([EngineLink(bad.url), EngineLink(good.url, pause_for_update=False)],
                   consume_bucket_mb=8 * KB, timeout_s=20)
    try:
        t0 = time.monotonic()
        stats = deliver(prod, named, 1)
        assert time.monotonic() - t0 < 15  # no waiting for a timeout
        assert stats.stale == [bad.url]
        assert "injected fault" in prod.stale[bad.url]
        assert bad.engine.weight_version == STALE_VERSION and not bad.engine.paused
        assert good.engine.weight_version == "1"
        assert_bit_exact(prod, named)  # only the live engines are asked
        assert len(prod.live()) == 1
        named2 = [(n, t + 1) for n, t in named]
        deliver(prod, named2, 2)
        assert good.engine.weight_version == "2"
        assert_bit_exact(prod, named2)
    finally:
        prod.close()
        good.close()
        bad.close()


def test_engine_refusing_before_it_receives_does_not_hang_the_broadcast(ws_model, ws_model_b):
    """Stock SGLang checks the group before receiving: a refusal there means the broadcast can
    never complete. The producer notices the refusal, rebuilds the group without that engine
    and sends the bucket again. (The broadcast left behind in the old group ends at its group
    timeout; the test waits for that, short here, so nothing is torn down under it.)"""
    good = EngineServer(ws_model, update_group_timeout_s=8)
    bad = EngineServer(ws_model, update_group_timeout_s=8)
    named = trainer_weights(ws_model_b)
    prod = connect([EngineLink(good.url, pause_for_update=False), EngineLink(bad.url)],
                   consume_bucket_mb=8 * KB, timeout_s=8)
    try:
        bad.call(bad.engine.destroy_weights_update_group(prod.group_name))
        t0 = time.monotonic()
        stats = deliver(prod, named, 3)
        assert time.monotonic() - t0 < 8  # well within the timeout: nothing waited for it
        assert stats.stale == [bad.url] and "not in" in prod.stale[bad.url]
        assert good.engine.weight_version == "3"
        assert_bit_exact(prod, named)
        deadline = time.monotonic() + 30
        while (prod._last_sent is not None and not prod._last_sent.done()) or any(
                r.busy for r in good.engine._groups.values()):
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        prod.close()
        good.close()
        bad.close()


def test_no_engine_left_fails_clearly(ws_model, ws_model_b):
    bad = EngineServer(ws_model, live_updates=True, fail_update_at=1)
    prod = connect([EngineLink(bad.url)], consume_bucket_mb=8 * KB, timeout_s=10)
    try:
        with pytest.raises(WeightSyncError, match="no engine left"):
            deliver(prod, trainer_weights(ws_model_b), 1)
    finally:
        prod.close()
        bad.close()


def test_updates_outside_a_session_are_refused_like_stock(engine_server):
    from megarl.rollout.engine import UpdateRefused

    eng = engine_server.engine
    with pytest.raises(UpdateRefused, match="between begin_weight_update"):
        engine_server.call(eng.update_weights_from_tensor([("model.norm.weight",
                                                             torch.ones(64))]))
    engine_server.call(eng.begin_weight_update())
    with pytest.raises(UpdateRefused, match="already open"):
        engine_server.call(eng.begin_weight_update())
    engine_server.call(eng.end_weight_update())
    with pytest.raises(UpdateRefused, match="no weight-update session"):
        engine_server.call(eng.end_weight_update())


def test_verify_mode_checks_engines_with_stock_weights_checker(engine_server, ws_model_b):
    named = trainer_weights(ws_model_b)
    prod = connect([EngineLink(engine_server.url, pause_for_update=False)],
                   consume_bucket_mb=8 * KB, verify=True)
    try:
        deliver(prod, named, 1)
        want = prod.sent_checksums
        assert {n: want.checksums[n] for n, _ in named} == {
            n: tensor_checksum(t) for n, t in named}
        prod.verify(1, want)  # equal: passes
        with torch.no_grad():  # an engine whose weights drifted from what was sent
            engine_server.engine.weights.params["model.norm.weight"].add_(1)
        with pytest.raises(WeightSyncError, match="model.norm.weight"):
            prod.verify(1, want)
    finally:
        prod.close()


def test_engine_gone_before_a_version_is_dropped_not_the_sync(ws_model, ws_model_b):
    """A server that died between versions fails `pause`/`begin`: stale, and the version goes
    to the engines still there."""
    good = EngineServer(ws_model)
    bad = EngineServer(ws_model)
    named = trainer_weights(ws_model_b)
    prod = connect([EngineLink(good.url, pause_for_update=False), EngineLink(bad.url)],
                   consume_bucket_mb=8 * KB, timeout_s=10)
    try:
        bad.close()
        stats = deliver(prod, named, 4)
        assert stats.stale == [bad.url] and "pause_generation" in prod.stale[bad.url]
        assert good.engine.weight_version == "4"
        assert_bit_exact(prod, named)
    finally:
        prod.close()
        good.close()


def _answered(exc=None):
    import concurrent.futures

    f = concurrent.futures.Future()
    f.set_exception(exc) if exc is not None else f.set_result({"success": True})
    return f


def test_a_peer_leaving_mid_broadcast_blames_the_dead_engine_not_the_survivors(
        ws_model, ws_model_b):
    """Under load every answer is in by the time the broadcast's failure is seen: the survivor's
    failed receive and the dead engine's dropped connection. Only the dead one is dropped; if
    every engine answered a failed receive, /health decides; if every engine is healthy, nobody
    is (the group is rebuilt with all of them and the bucket sent again)."""
    import aiohttp

    from megarl.backends.sglang.client import SGLangError

    good, gone = EngineServer(ws_model), EngineServer(ws_model)
    links = [EngineLink(good.url, pause_for_update=False), EngineLink(gone.url)]
    prod = connect(links, consume_bucket_mb=8 * KB, timeout_s=10)
    receive = SGLangError("/update_weights_from_distributed", 400,
                          "Failed to receive weights: Connection closed by peer")
    try:
        gone.close()
        dropped = aiohttp.ServerDisconnectedError()
        assert prod._culprits(links, [_answered(receive), _answered(dropped)], "peer", 10) == {
            gone.url: f"ServerDisconnectedError: {dropped}"}
        # every answer a failed receive: the engine that does not answer /health
        blamed = prod._culprits(links, [_answered(receive), _answered(receive)], "peer", 10)
        assert list(blamed) == [gone.url] and "health check" in blamed[gone.url]
        assert prod._culprits(links[:1], [_answered(receive)], "peer", 10) == {}
        # the whole path: the dead engine leaves, the survivor gets the version
        stats = deliver(prod, trainer_weights(ws_model_b), 5)
        assert stats.stale == [gone.url] and good.engine.weight_version == "5"
    finally:
        prod.close()
        good.close()
