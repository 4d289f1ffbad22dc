"""How a producer reaches an engine's API: over SGLang-style HTTP, or in process.

Owns only the call plumbing; the bytes themselves always travel on the update process group.
One link per engine; every method is a coroutine run on the producer's own event loop.
"""
from __future__ import annotations

import asyncio
from typing import Protocol

from megarl.backends.sglang.client import SGLangClient

from .protocol import LOAD_FORMAT


class EngineLink(Protocol):
    name: str

    async def init_group(self, address: str, port: int, rank: int, world_size: int,
                         group_name: str, backend: str) -> None: ...

    async def update_bucket(self, group_name: str, bucket: dict) -> dict: ...

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    async def weights_digest(self, names: list[str] | None = None) -> dict: ...

    async def close(self) -> None: ...


class HTTPLink:
    """An engine behind SGLang's HTTP API (the embedded server; bucketed updates need it)."""

    def __init__(self, url: str, timeout_s: float | None = None):
        self.name = url
        self.client = SGLangClient(url, timeout_s=timeout_s)

    async def init_group(self, address, port, rank, world_size, group_name, backend):
        await self.client.init_weights_update_group(address, port, rank, world_size,
                                                    group_name, backend)

    async def update_bucket(self, group_name, bucket):
        # SGLang's payload shape, plus megarl's `bucket`; the client has no method for the
        # extra field, so this goes through its generic call.
        return await self.client._call("POST", "/update_weights_from_distributed", {
            "names": [], "dtypes": [], "shapes": [], "group_name": group_name,
            "load_format": LOAD_FORMAT, "bucket": bucket})

    async def pause(self, mode):
        await self.client.pause_generation(mode)

    async def resume(self):
        await self.client.continue_generation()

    async def weights_digest(self, names=None):
        return await self.client._call("POST", "/weights_digest",
                                       {} if names is None else {"names": names})

    async def close(self):
        await self.client.close()


class LocalLink:
    """An `EmbeddedEngine` in this process, running on `loop` (another thread's loop)."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, name: str = "local"):
        self.engine, self.loop, self.name = engine, loop, name

    async def _on_engine(self, coro):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def init_group(self, address, port, rank, world_size, group_name, backend):
        await self._on_engine(self.engine.init_weights_update_group(
            address, port, rank, world_size, group_name, backend))

    async def update_bucket(self, group_name, bucket):
        return await self._on_engine(self.engine.update_weights_from_distributed(
            [], [], [], group_name, load_format=LOAD_FORMAT, bucket=bucket))

    async def pause(self, mode):
        await self._on_engine(self.engine.pause(mode))

    async def resume(self):
        await self._on_engine(self.engine.resume())

    async def weights_digest(self, names=None):
        return await self._on_engine(self.engine.weights_digest(names))

    async def close(self):
        pass
