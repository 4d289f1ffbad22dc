"""How the trainer reaches one engine's weight-update API: stock SGLang's HTTP endpoints.

Owns the call plumbing only; the bytes themselves travel on the update process group. One
link per engine, for both rollout backends (a stock SGLang server, or megarl's embedded server,
which speaks the same contract). Every method is a coroutine run on the producer's own loop.
Integer versions become SGLang's strings here (`wire_version`), and nowhere else.
"""
from __future__ import annotations

from megarl.backends.sglang.client import SGLangClient

from .protocol import BucketMeta, wire_version

# The version an engine is given when a sync to it failed: not an integer, so the rollout
# manager stops routing to it (megarl.rollout.manager) and no output of it is trained on.
STALE_VERSION = "stale"


class EngineLink:
    """One engine: its URL, its TP size (update-group ranks) and whether generation must be
    paused while a version loads (stock SGLang loads each bucket into the live weights; the
    embedded engine stages and swaps, so it need not stop)."""

    def __init__(self, url: str, tp_size: int = 1, pause_for_update: bool = True,
                 timeout_s: float | None = None):
        self.name, self.tp_size, self.pause_for_update = url, int(tp_size), pause_for_update
        self.client = SGLangClient(url, timeout_s=timeout_s)

    async def init_group(self, address: str, port: int, rank_offset: int, world_size: int,
                         group_name: str, backend: str) -> None:
        await self.client.init_weights_update_group(address, port, rank_offset, world_size,
                                                    group_name, backend)

    async def destroy_group(self, group_name: str) -> None:
        await self.client.destroy_weights_update_group(group_name)

    async def update_bucket(self, meta: BucketMeta, group_name: str,
                            version: int | None) -> dict:
        """Announce one flattened bucket; returns once the engine has received and loaded it."""
        body = meta.request(group_name, version)
        return await self.client.update_weights_from_distributed(
            body["names"], body["dtypes"], body["shapes"], group_name,
            flush_cache=body["flush_cache"], weight_version=body.get("weight_version"),
            load_format=body["load_format"])

    async def pause(self) -> None:
        # retract, not in_place: stock SGLang (0.5.23) refuses /flush_cache while an in_place
        # pause holds running requests, and their KV and the radix tree's entries, computed
        # with the old weights, would then be reused after the update (GRPO siblings, partial
        # continuations: old-weight tokens tagged with the new version). retract frees the
        # running requests' KV and requeues them with the tokens they have; the flush in
        # `close_version` then succeeds, and on continue they prefill again under the new
        # weights. Their version spans still say where the weights changed.
        await self.client.pause_generation("retract")

    async def resume(self) -> None:
        await self.client.continue_generation()

    async def begin(self) -> None:
        await self.client.begin_weight_update()

    async def end(self) -> None:
        await self.client.end_weight_update()

    async def flush(self) -> bool:
        # No `timeout` field: stock's timed flush waits for an idle scheduler without the
        # paused-queue exemption, so it always fails while requests are held.
        return await self.client.flush_cache()

    async def set_version(self, version: int | str, abort_all_requests: bool = False) -> None:
        v = version if isinstance(version, str) else wire_version(version)
        await self.client.update_weight_version(v, abort_all_requests)

    async def checksums(self) -> dict[str, str]:
        """Per-tensor checksums of TP rank 0 (stock `/weights_checker`, action checksum)."""
        out = await self.client.weights_checker("checksum")
        return dict(out["ranks"][0]["checksums"])

    async def server_info(self) -> dict:
        return await self.client.server_info()

    async def health(self) -> bool:
        return await self.client.health()

    async def close(self) -> None:
        await self.client.close()
