"""The rollout manager: spreads samples over engines and tracks every one in flight.

Owns routing (least-loaded: fewest samples in flight, then fewest outstanding tokens) and the
in-flight table (rid -> engine, request). It hands each sample back as it finishes, and can
abort the long tail once a step has what it needs, returning the partial samples (tokens,
log-probs, version spans) so the caller can resume them later with
`megarl.rollout.protocol.continuation`. Caching those partials and judging their staleness is
the sample buffer's job, not this module's.

Engine-wide commands (pause, resume, flush, version) fan out to every engine concurrently.

Stale engines: an engine whose weight version is not one megarl set (an integer) was left
half-updated by a failed sync (megarl.weight_sync marks it so, with SGLang's own
`/update_weight_version`). The manager stops routing to it as soon as it sees that version, in
`weight_versions()` or on an output, and sends such a request again elsewhere.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable, Sequence

from megarl.rollout.protocol import GenerateOutput, GenerateRequest, RolloutEngine, version_int

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    engine: int
    request: GenerateRequest
    started: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> int:
        return len(self.request.input_ids) + self.request.sampling.max_new_tokens


class RolloutManager:
    def __init__(self, engines: Sequence[RolloutEngine]):
        if not engines:
            raise ValueError("engines: need at least one rollout engine")
        self.engines = list(engines)
        self.in_flight: dict[str, InFlight] = {}
        self._count = [0] * len(self.engines)
        self._tokens = [0] * len(self.engines)
        self.stale: dict[int, str] = {}  # engine index -> the version it reported

    def _pick(self) -> int:
        live = [i for i in range(len(self.engines)) if i not in self.stale]
        if not live:
            raise RuntimeError(f"no rollout engine left: every engine is stale ({self.stale})")
        return min(live, key=lambda i: (self._count[i], self._tokens[i], i))

    def _mark_stale(self, i: int, version) -> None:
        if i not in self.stale:
            logger.error("rollout engine %d reports weight version %r: stale after a failed "
                         "sync, no longer used", i, version)
            self.stale[i] = str(version)

    @staticmethod
    def _is_megarl_version(v) -> bool:
        try:
            version_int(v)
            return True
        except ValueError:
            return False

    def load(self) -> list[int]:
        """Samples in flight per engine."""
        return list(self._count)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """One sample (n == 1) on the least-loaded live engine; again on another one if the
        engine turns out stale (its output is not used)."""
        while True:
            i = self._pick()
            out = await self._generate_on(i, request)
            bad = [v for v, _, _ in out.weight_version_spans if not self._is_megarl_version(v)]
            if not bad:
                return out
            self._mark_stale(i, bad[0])

    async def _generate_on(self, i: int, request: GenerateRequest) -> GenerateOutput:
        if request.rid in self.in_flight:
            raise ValueError(f"rid: {request.rid!r} is already in flight")
        rec = InFlight(i, request)
        self.in_flight[request.rid] = rec
        self._count[i] += 1
        self._tokens[i] += rec.tokens
        try:
            return await self.engines[i].generate(request)
        finally:
            del self.in_flight[request.rid]
            self._count[i] -= 1
            self._tokens[i] -= rec.tokens

    async def stream(self, requests: Iterable[GenerateRequest]) -> AsyncIterator[GenerateOutput]:
        """Every sample of `requests` (n expanded), yielded in the order they finish."""
        async for out in self.generate_until(requests, enough=None):
            yield out

    async def generate_until(self, requests: Iterable[GenerateRequest], enough: int | None
                             ) -> AsyncIterator[GenerateOutput]:
        """Yield samples as they finish; once `enough` have finished normally, abort the rest
        and yield their partial outputs too (finish_reason "abort")."""
        samples = [r for req in requests for r in req.expand()]
        tasks = [asyncio.ensure_future(self.generate(r)) for r in samples]
        done, aborted = 0, False
        try:
            for fut in asyncio.as_completed(tasks):
                out = await fut
                done += not out.aborted
                yield out
                if enough is not None and done >= enough and not aborted:
                    aborted = True
                    tail = [r.rid for r in samples if r.rid in self.in_flight]
                    logger.info("%d samples finished; aborting the long tail of %d", done,
                                len(tail))
                    await self.abort(tail)
        finally:
            for t in tasks:  # the consumer stopped early: don't leave samples running
                t.cancel()

    async def abort(self, rids: Iterable[str]) -> None:
        """Abort these samples; each one's `generate` returns its partial output."""
        by_engine: dict[int, list[str]] = {}
        for rid in rids:
            rec = self.in_flight.get(rid)
            if rec is not None:
                by_engine.setdefault(rec.engine, []).append(rid)
        await asyncio.gather(*[self.engines[i].abort(rid)
                               for i, rs in by_engine.items() for rid in rs])

    async def abort_all(self) -> None:
        await asyncio.gather(*[e.abort(abort_all=True) for e in self.engines])

    async def pause(self, mode: str = "abort") -> None:
        await asyncio.gather(*[e.pause(mode) for e in self.engines])

    async def resume(self) -> None:
        await asyncio.gather(*[e.resume() for e in self.engines])

    async def flush_cache(self) -> bool:
        return all(await asyncio.gather(*[e.flush_cache() for e in self.engines]))

    async def weight_versions(self) -> list[str]:
        """The versions of the live engines (engines found stale here are dropped)."""
        live = [i for i in range(len(self.engines)) if i not in self.stale]
        got = await asyncio.gather(*[self.engines[i].get_weight_version() for i in live])
        out = []
        for i, v in zip(live, got):
            if self._is_megarl_version(v):
                out.append(v)
            else:
                self._mark_stale(i, v)
        if not out:
            raise RuntimeError(f"no rollout engine left: every engine is stale ({self.stale})")
        return out

    async def close(self) -> None:
        await asyncio.gather(*[e.close() for e in self.engines])

