"""Helpers for the weight-sync tests: an embedded engine served over HTTP on loopback (the
SGLang API a producer talks to), and one whole version delivered the way the coordinator does."""
import asyncio

from megarl.utils.launch import free_port  # noqa: F401 - re-exported to the tests


class EngineServer:
    """`EmbeddedEngine` behind its HTTP server on a background loop; `call(coro)` runs a
    coroutine on that loop (in-process checks the HTTP API does not offer)."""

    def __init__(self, model_dir, **kw):
        from megarl.rollout.engine import EmbeddedEngine
        from megarl.rollout.server import ServerThread

        self.engine = EmbeddedEngine(model_dir, weight_version="0", load_tokenizer=False, **kw)
        self.server = ServerThread(self.engine).__enter__()
        self.url = self.server.url

    def call(self, coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, self.server._loop).result(timeout)

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.server._loop)

    def close(self):
        self.server.__exit__(None, None, None)


def deliver(prod, named, version, dual=False):
    """One version, as megarl.weight_sync.trainer's coordinator runs it for one stage."""
    from megarl.weight_sync.producer import SyncStats

    stats = SyncStats(version)

    def run(buckets):
        prod.open_version()
        try:
            return prod.send(buckets, version, True, stats)
        finally:
            prod.close_version(dict(prod.stale))

    if dual:
        snap = prod.snapshot(iter(named), version)
        prod.start(lambda: run(snap.buckets))
        return prod.wait(120)
    return run(prod.stream(iter(named), version))
