"""The rollout manager: spreads samples over engines and tracks every one in flight.

Owns routing (least-loaded: fewest samples in flight, then fewest outstanding tokens) and the
in-flight table (rid -> engine, request). It hands each sample back as it finishes, and can
abort the long tail once a step has what it needs, returning the partial samples (tokens,
log-probs, version spans) so the caller can resume them later with
`megarl.rollout.protocol.continuation`. Caching those partials and judging their staleness is
the sample buffer's job, not this module's.

Engine-wide commands (pause, resume, flush, version) fan out to every engine concurrently.

Engines that fail. Each engine is in one of four states:
- live: requests are routed to it;
- stale: its weight version is not one megarl set (an integer): a failed sync left it
  half-updated (megarl.weight_sync marks it so, with SGLang's own `/update_weight_version`);
- dead: its process exited, its connection broke, or it failed its health check (the
  engine's `health()`, for an SGLang-API server a `/model_info` call that runs no generation
  and so answers while generation is paused, that errs or outlasts `health_timeout_s`,
  polled every `health_interval_s` while requests are in flight, so a wedged engine is
  found too);
- joining: a replacement on the same devices, serving weights older than the live engines'
  until the next weight sync reaches it (the trainer's update group takes it in at the start of
  that version); it goes live once its version is the newest any live engine serves.
A request whose engine turns stale or dead is sent again to a live engine: the caller's
partial output (the tokens, log-probs and versions of earlier aborted attempts) is in the
request already, and only the attempt in flight on the failed engine is lost. A dead engine is
replaced through the `replace(index)` callback (at most `max_restarts` times per slot); when it
cannot be, the run goes on with fewer engines, and stops with an error naming every engine and
why once none is left and none is joining.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Iterable, Sequence

from megarl.rollout.protocol import (BadRequest, GenerateOutput, GenerateRequest,
                                     RolloutEngine, version_int)

logger = logging.getLogger(__name__)

# What a broken connection or a dead server looks like from the client: anything but an HTTP
# answer. An HTTP error status is the request's fault, not the engine's, and is re-raised.
try:
    import aiohttp

    _TRANSPORT = (ConnectionError, OSError, asyncio.TimeoutError, aiohttp.ClientError)
except ImportError:  # pragma: no cover - aiohttp is a base dependency
    _TRANSPORT = (ConnectionError, OSError, asyncio.TimeoutError)


class EngineDied(RuntimeError):
    """Internal: the engine a request ran on was found dead; the request goes elsewhere."""


class NoEngineLeft(RuntimeError):
    """Every engine is dead or stale and none is coming back."""


@dataclass
class InFlight:
    engine: int
    request: GenerateRequest
    started: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> int:
        return len(self.request.input_ids) + self.request.sampling.max_new_tokens


class RolloutManager:
    def __init__(self, engines: Sequence[RolloutEngine], *,
                 replace: Callable[[int], Awaitable[RolloutEngine]] | None = None,
                 names: Sequence[str] | None = None, health_interval_s: float = 2.0,
                 health_timeout_s: float = 10.0, max_restarts: int = 3,
                 join_timeout_s: float = 600.0):
        if not engines:
            raise ValueError("engines: need at least one rollout engine")
        self.engines = list(engines)
        self.names = list(names) if names else [
            str(getattr(e, "base_url", f"engine {i}")) for i, e in enumerate(self.engines)]
        self.in_flight: dict[str, InFlight] = {}
        self._count = [0] * len(self.engines)
        self._tokens = [0] * len(self.engines)
        self.stale: dict[int, str] = {}  # engine index -> the version it reported
        self.dead: dict[int, str] = {}  # engine index -> why
        self.joining: set[int] = set()
        self.restarts = [0] * len(self.engines)
        self._replace, self.max_restarts = replace, max_restarts
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.join_timeout_s = join_timeout_s
        # Futures resolved when an engine dies (its requests stop waiting on it) or when any
        # engine changes state; made in the running loop, as callers may use several loops.
        self._died: list[set[asyncio.Future]] = [set() for _ in self.engines]
        self._changed: set[asyncio.Future] = set()
        self._newest = 0  # the newest weight version a live engine reported
        self._monitor: asyncio.Task | None = None
        self._replacing: dict[int, asyncio.Task] = {}
        self._stats = {"failures": 0, "requeued": 0, "replaced": 0}
        self._alive_min = len(self.engines)
        self.events: list[tuple[float, str, str]] = []  # (time, engine, what): failures

    # -- engine states ------------------------------------------------------------------------
    def label(self, i: int) -> str:
        return f"rollout engine {i} ({self.names[i]})"

    def live(self) -> list[int]:
        return [i for i in range(len(self.engines))
                if i not in self.stale and i not in self.dead and i not in self.joining]

    def _event(self, i: int, what: str) -> None:
        self.events.append((time.time(), self.label(i), what))
        self._alive_min = min(self._alive_min, len(self.live()))
        _resolve(self._changed)

    def _none_left(self) -> NoEngineLeft:
        why = "; ".join([f"{self.label(i)}: dead ({w})" for i, w in self.dead.items()] +
                        [f"{self.label(i)}: stale (version {v!r})"
                         for i, v in self.stale.items()])
        return NoEngineLeft(f"no rollout engine left: {why}")

    async def _pick(self) -> int:
        """The least-loaded live engine; waits while a replacement is on its way."""
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            live = self.live()
            if live:
                return min(live, key=lambda i: (self._count[i], self._tokens[i], i))
            if not self.joining and not self._replacing:
                raise self._none_left()
            if time.monotonic() > deadline:
                raise NoEngineLeft(f"no live rollout engine for {self.join_timeout_s:.0f} s; "
                                   f"replacements {sorted(self.joining)} never reached the "
                                   "live engines' weights")
            changed = asyncio.get_running_loop().create_future()
            self._changed.add(changed)
            await self._promote_joining()
            await asyncio.wait([changed], timeout=1.0)
            self._changed.discard(changed)

    def _mark_stale(self, i: int, version) -> None:
        if i not in self.stale:
            logger.error("%s reports weight version %r: stale after a failed sync, no longer "
                         "used", self.label(i), version)
            self.stale[i] = str(version)
            self._event(i, "stale")

    def mark_dead(self, i: int, why: str) -> None:
        """Stop routing to engine i, send its requests elsewhere, and replace it."""
        if i in self.dead:
            return
        self.dead[i] = why
        self.joining.discard(i)
        self._stats["failures"] += 1
        logger.error("%s failed: %s; its %d request(s) go to the other engines", self.label(i),
                     why, self._count[i])
        _resolve(self._died[i])
        self._event(i, "dead")
        if self._replace is not None and self.restarts[i] < self.max_restarts:
            self._replacing[i] = asyncio.ensure_future(self._replace_engine(i))
        elif not self.live() and not self.joining and not self._replacing:
            logger.error("%s", self._none_left())

    async def _replace_engine(self, i: int) -> None:
        t0 = time.monotonic()
        old = self.engines[i]
        while True:
            self.restarts[i] += 1
            try:
                new = await self._replace(i)
                break
            except Exception as e:  # noqa: BLE001 - tried again, else fewer engines
                left = self.max_restarts - self.restarts[i]
                logger.error("%s could not be replaced (%s: %s); %s", self.label(i),
                             type(e).__name__, e, f"trying again ({left} restart(s) left)"
                             if left > 0 else f"going on with {len(self.live())} engine(s)")
                if left <= 0:
                    self._replacing.pop(i, None)
                    self._event(i, "replace-failed")
                    return
                await asyncio.sleep(1.0)  # a replacement that died starting: not in a loop
        try:
            await old.close()
        except Exception:  # noqa: BLE001 - the old one is gone anyway
            pass
        self.engines[i] = new
        self.names[i] = str(getattr(new, "base_url", self.names[i]))
        self.dead.pop(i, None)
        self.stale.pop(i, None)
        self.joining.add(i)
        self._replacing.pop(i, None)
        self._stats["replaced"] += 1
        logger.warning("%s replaced in %.1f s; it joins once it has the current weights",
                       self.label(i), time.monotonic() - t0)
        self._event(i, "replaced")
        await self._promote_joining()

    async def _promote_joining(self) -> None:
        """Joining engines whose version reached the newest live version go live. With no live
        engine left, the newest version any engine reported is the bar."""
        for i in sorted(self.joining):
            try:
                v = await asyncio.wait_for(self.engines[i].get_weight_version(),
                                           self.health_timeout_s)
                n = version_int(v)
            except ValueError:
                continue
            except Exception as e:  # noqa: BLE001
                self.mark_dead(i, f"get_weight_version failed: {_why(e)}")
                continue
            if n >= self._newest and i in self.joining:
                self.joining.discard(i)
                logger.info("%s is live again at weight version %d", self.label(i), n)
                self._event(i, "live")

    async def _healthy(self, i: int) -> str | None:
        """None when engine i answers its health check in time, else why not."""
        check = getattr(self.engines[i], "health", None)
        if check is None:
            return None
        try:
            ok = await asyncio.wait_for(check(), self.health_timeout_s)
        except asyncio.TimeoutError:
            return f"health check gave no answer within {self.health_timeout_s:g} s"
        except Exception as e:  # noqa: BLE001
            return f"health check failed: {_why(e)}"
        return None if ok else "health check failed"

    def _watch(self) -> None:
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.ensure_future(self._monitor_loop())

    async def _monitor_loop(self) -> None:
        """While requests are in flight, probe every live engine: a wedged engine (its
        requests silent, its health check past its deadline) is found here."""
        while self.in_flight:
            await asyncio.sleep(self.health_interval_s)
            idx = [i for i in self.live() if self._count[i]]
            whys = await asyncio.gather(*[self._healthy(i) for i in idx])
            for i, why in zip(idx, whys):
                if why is not None and i not in self.dead:
                    self.mark_dead(i, why)

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

    def pop_metrics(self) -> dict[str, float]:
        """`rollout/engines_*` since the last call: live now, fewest live, failures,
        re-queued requests, replacements."""
        alive = len(self.live())
        out = {"rollout/engines_alive": float(alive),
               "rollout/engines_alive_min": float(min(self._alive_min, alive)),
               "rollout/engine_failures": float(self._stats["failures"]),
               "rollout/requeued_requests": float(self._stats["requeued"]),
               "rollout/engines_replaced": float(self._stats["replaced"])}
        self._stats = dict.fromkeys(self._stats, 0)
        self._alive_min = alive
        return out

    def pop_events(self) -> list[tuple[float, str, str]]:
        """Engine state changes (time, engine label, "dead" / "stale" / "replaced" / "live" /
        "replace-failed") since the last call."""
        out, self.events = self.events, []
        return out

    # -- generation ---------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """One sample (n == 1) on the least-loaded live engine; again on another one if the
        engine turns out stale or dies (the failed attempt's output is not used)."""
        while True:
            i = await self._pick()
            try:
                out = await self._generate_on(i, request)
            except EngineDied:
                self._stats["requeued"] += 1
                continue
            bad = [v for v, _, _ in out.weight_version_spans if not self._is_megarl_version(v)]
            if not bad:
                self._newest = max([self._newest, *(version_int(v) for v, _, _ in
                                                    out.weight_version_spans)])
                return out
            self._mark_stale(i, bad[0])
            self._stats["requeued"] += 1

    async def _generate_on(self, i: int, request: GenerateRequest) -> GenerateOutput:
        if request.rid in self.in_flight:
            raise ValueError(f"rid: {request.rid!r} is already in flight")
        rec = InFlight(i, request)
        self.in_flight[request.rid] = rec
        self._count[i] += 1
        self._tokens[i] += rec.tokens
        self._watch()
        call = asyncio.ensure_future(self.engines[i].generate(request))
        died = asyncio.get_running_loop().create_future()
        self._died[i].add(died)
        try:
            await asyncio.wait({call, died}, return_when=asyncio.FIRST_COMPLETED)
            if not call.done():
                raise EngineDied(self.dead.get(i, "dead"))
            try:
                return call.result()
            except BadRequest:
                raise
            except _TRANSPORT as e:
                # The connection broke: a dead engine, or one blip on a live one.
                why = await self._healthy(i)
                if why is None and i not in self.dead:
                    raise EngineDied(f"request failed ({_why(e)}), engine healthy") from e
                self.mark_dead(i, f"{_why(e)}; {why or 'dead'}")
                raise EngineDied(why or "dead") from e
        finally:
            self._died[i].discard(died)
            for f in (call, died):
                if not f.done():
                    f.cancel()
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

    # -- engine-wide commands: live engines (a dead one cannot answer; a joining one is
    # -- brought up to date by the weight sync, not by these)
    async def _fan(self, fn, idx: Iterable[int] | None = None) -> list:
        idx = list(self.live() + sorted(self.joining) if idx is None else idx)
        got = await asyncio.gather(*[fn(self.engines[i]) for i in idx], return_exceptions=True)
        for i, r in zip(idx, got):
            if isinstance(r, _TRANSPORT):
                self.mark_dead(i, _why(r))
            elif isinstance(r, BaseException):
                raise r
        return [r for r in got if not isinstance(r, BaseException)]

    async def abort(self, rids: Iterable[str]) -> None:
        """Abort these samples; each one's `generate` returns its partial output."""
        by_engine: dict[int, list[str]] = {}
        for rid in rids:
            rec = self.in_flight.get(rid)
            if rec is not None and rec.engine not in self.dead:
                by_engine.setdefault(rec.engine, []).append(rid)
        await asyncio.gather(*[self._fan(lambda e, rid=rid: e.abort(rid), [i])
                               for i, rs in by_engine.items() for rid in rs])

    async def abort_all(self) -> None:
        await self._fan(lambda e: e.abort(abort_all=True))

    async def pause(self, mode: str = "abort") -> None:
        await self._fan(lambda e: e.pause(mode))

    async def resume(self) -> None:
        await self._fan(lambda e: e.resume())

    async def flush_cache(self) -> bool:
        return all(await self._fan(lambda e: e.flush_cache()))

    async def weight_versions(self) -> list[str]:
        """The versions of the live engines (engines found stale or dead here are dropped;
        replacements that reached the newest version go live). With no live engine, the
        versions of the joining ones, so a caller waiting for a version waits for them."""
        await self._promote_joining()
        live = self.live()
        got = await asyncio.gather(*[self.engines[i].get_weight_version() for i in live],
                                   return_exceptions=True)
        out = []
        for i, v in zip(live, got):
            if isinstance(v, BaseException):
                if not isinstance(v, _TRANSPORT):
                    raise v
                self.mark_dead(i, f"get_weight_version failed: {_why(v)}")
            elif self._is_megarl_version(v):
                out.append(v)
                self._newest = max(self._newest, version_int(v))
            else:
                self._mark_stale(i, v)
        if not out and self.joining:
            got = await asyncio.gather(*[self.engines[i].get_weight_version()
                                         for i in sorted(self.joining)],
                                       return_exceptions=True)
            out = [v for v in got if not isinstance(v, BaseException)
                   and self._is_megarl_version(v)]
        if not out and not self._replacing:
            raise self._none_left()
        return out

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for t in list(self._replacing.values()):
            t.cancel()
        await asyncio.gather(*[e.close() for e in self.engines], return_exceptions=True)


def _resolve(futures: set[asyncio.Future]) -> None:
    for f in list(futures):
        if not f.done():
            f.set_result(None)
    futures.clear()


def _why(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
