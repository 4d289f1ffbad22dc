"""Helpers for the weight-sync tests: a free port, an engine on its own loop thread."""
import asyncio
import threading

from megarl.utils.launch import free_port  # noqa: F401 - re-exported to the tests


class EngineThread:
    """`EmbeddedEngine` bound to a loop on a background thread; `call(coro)` runs on it."""

    def __init__(self, model_dir, **kw):
        from megarl.rollout.engine import EmbeddedEngine

        self.engine = EmbeddedEngine(model_dir, weight_version="v0", load_tokenizer=False, **kw)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self):
        self.call(self.engine.close())
        self.call(asyncio.sleep(0.01))  # let the cancelled scheduler task finish
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
