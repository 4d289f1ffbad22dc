"""Producer → embedded engine over a real gloo update group, in one process (engine on its own
loop thread, as a server runs it): bit-exact delivery, versions, memory, failures."""
import asyncio

import pytest
from safetensors.torch import load_file

from megarl.rollout.protocol import BadRequest, GenerateRequest, SamplingParams
from megarl.weight_sync.producer import WeightProducer
from megarl.weight_sync.protocol import SyncConfig, WeightSyncError, byte_view, digest
from megarl.weight_sync.transports import LocalLink

from ws_helpers import free_port


def trainer_weights(model_dir):
    return sorted(load_file(str(model_dir / "model.safetensors")).items())


def connect(links, **cfg):
    prod = WeightProducer(links, SyncConfig(**cfg))
    prod.connect("127.0.0.1", free_port())
    return prod


def assert_engine_equals(engine_thread, named):
    got = engine_thread.call(engine_thread.engine.weights_digest([n for n, _ in named]))
    assert got == {n: digest(byte_view(t.contiguous())) for n, t in named}


KB = 1 / 1024  # MiB


@pytest.mark.parametrize("dual", [True, False], ids=["staged", "direct"])
def test_sync_is_bit_exact_versioned_and_memory_bounded(engine_thread, ws_model_b, dual):
    named = trainer_weights(ws_model_b)
    prod = connect([LocalLink(engine_thread.engine, engine_thread.loop)], dual_buffer=dual,
                   produce_bucket_mb=32 * KB, consume_bucket_mb=8 * KB,
                   verify=True)
    try:
        if dual:
            prod.start(prod.snapshot(iter(named), "v1"))
            stats = prod.wait(60)
        else:
            prod.pause_engines()
            stats = prod.send(iter(named), "v1", direct=True)
            prod.resume_engines()
    finally:
        prod.close()
    assert stats.results[0]["complete"] and stats.results[0]["weight_version"] == "v1"
    assert stats.buckets >= 3 and stats.pieces > stats.buckets
    eng = engine_thread.engine
    assert eng.weight_version == "v1"
    assert_engine_equals(engine_thread, named)
    mem = eng.weight_memory()
    assert mem["peak_piece_bytes"] == 8 * 1024  # transient memory: one consume piece
    model_bytes = sum(t.numel() * t.element_size() for _, t in named)
    assert mem["staging_bytes"] == (model_bytes if dual else 0)  # the second buffer, or none


def test_direct_update_refused_unless_paused(engine_thread, ws_model_b):
    named = trainer_weights(ws_model_b)
    prod = connect([LocalLink(engine_thread.engine, engine_thread.loop)], timeout_s=30)
    try:
        with pytest.raises(WeightSyncError, match=r"version v1 .*bucket 0.*paused"):
            prod.send(iter(named), "v1", direct=True)
    finally:
        prod.close()
    assert engine_thread.engine.weight_version == "v0"
    assert engine_thread.engine.weights_broken is None


class _DiesAfter:
    """Wraps a link: answers `ok` buckets, then fails (dies) or never answers (hangs)."""

    def __init__(self, link, ok, mode):
        self.link, self.ok, self.mode, self.name = link, ok, mode, f"{mode}-engine"

    def __getattr__(self, k):
        return getattr(self.link, k)

    async def update_bucket(self, group_name, bucket):
        if bucket["index"] >= self.ok:
            if self.mode == "dies":
                raise ConnectionResetError("engine process died")
            await asyncio.sleep(3600)
        return await self.link.update_bucket(group_name, bucket)


@pytest.mark.parametrize("mode", ["dies", "hangs"])
@pytest.mark.parametrize("dual", [True, False], ids=["staged", "direct"])
def test_failure_names_version_bucket_engine_and_no_half_model_serves(
        ws_model, ws_model_b, mode, dual):
    from ws_helpers import EngineThread

    good, bad = EngineThread(ws_model), EngineThread(ws_model)
    before = dict(trainer_weights(ws_model))
    named = trainer_weights(ws_model_b)
    links = [LocalLink(good.engine, good.loop, "good"),
             _DiesAfter(LocalLink(bad.engine, bad.loop, "bad"), 1, mode)]
    prod = connect(links, dual_buffer=dual, produce_bucket_mb=16 * KB, consume_bucket_mb=4 * KB,
                   timeout_s=2)
    try:
        with pytest.raises(WeightSyncError) as err:
            if dual:
                prod.start(prod.snapshot(iter(named), "v5"))
                prod.wait(60)
            else:
                prod.pause_engines()
                prod.send(iter(named), "v5", direct=True)
        assert (err.value.version, err.value.bucket) == ("v5", 1)
        if mode == "dies":  # it failed first: the others only failed once the group broke
            assert err.value.engine == "dies-engine"
        else:  # peers stuck behind the silent one are silent too; it is always named
            assert "hangs-engine" in err.value.engine.split(", ")
        assert "version v5" in str(err.value) and "bucket 1" in str(err.value)
        with pytest.raises(WeightSyncError, match="reconnect"):
            prod.send(iter(named), "v6")
    finally:
        prod.close()
    # The healthy engine got buckets 0 and 1 but never the last: it never serves v5.
    for et in (good, bad):
        eng = et.engine
        assert eng.weight_version == "v0"
        if dual:  # old weights kept, still serving
            assert eng.weights_broken is None
            assert_engine_equals(et, sorted(before.items()))
    if not dual:  # the good engine's live weights are half-written: it must refuse to serve
        assert "v5" in good.engine.weights_broken
        with pytest.raises(BadRequest, match="unhealthy"):
            good.call(good.engine.generate(GenerateRequest([1, 2, 3], SamplingParams())))
    good.close()
    bad.close()


def test_dual_buffers_alternate_by_reference(engine_thread, ws_model, ws_model_b):
    """Each staged version becomes live without a copy; the displaced weights become the next
    staging buffer, which never shares storage with what is live."""
    eng = engine_thread.engine
    params = eng.weights.params
    ptr = lambda: {n: p.data_ptr() for n, p in params.items()}  # noqa: E731
    before = ptr()
    prod = connect([LocalLink(eng, engine_thread.loop)], dual_buffer=True,
                   produce_bucket_mb=32 * KB, consume_bucket_mb=8 * KB)
    try:
        for version, model in (("v1", ws_model_b), ("v2", ws_model), ("v3", ws_model_b)):
            named = trainer_weights(model)
            prod.start(prod.snapshot(iter(named), version))
            prod.wait(60)
            assert eng.weight_version == version
            assert_engine_equals(engine_thread, named)
            live = {p.untyped_storage().data_ptr() for p in params.values()}
            staging = eng._buckets._staging
            assert sum(t.numel() * t.element_size() for t in staging.values()) == sum(
                t.numel() * t.element_size() for _, t in named)
            assert not live & {t.untyped_storage().data_ptr() for t in staging.values()}
            if version == "v2":  # back on the original storage: two buffers, alternating
                assert ptr() == before
    finally:
        prod.close()
