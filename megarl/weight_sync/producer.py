"""The trainer side of a weight sync: one pipeline stage's sender, rank 0 of its update group.

Owns the stage's update group (hosted here, engines joining at their TP rank offsets), its
snapshot buffers (dual buffer), the background sender, and what happens when an engine fails.

Per bucket, in order: one `/update_weights_from_distributed` call to every engine (not awaited:
it returns only once the engine has received and loaded the bucket), one broadcast of the
packed bytes, then every answer, before the next bucket. The version's last call carries its
`weight_version`. Engine control around a version (`open_version`: pause where the engine
needs it, begin; `close_version`: end, flush, continue) is the coordinator's; see
megarl.weight_sync.trainer for who calls what.

An engine that fails (an answer with `success: false`, an error, or silence past `timeout_s`)
is marked stale: the stage rebuilds its update group without it (the other engines leave the
old group and join the new one) and, if the failed bucket's broadcast did not complete, sends
that bucket again; every earlier bucket was confirmed by every engine still in the group. A
stale engine is given the version `STALE_VERSION` and continued, which tells the rollout
manager to stop routing to it; nothing waits on it again. The sync fails only when no engine
is left, or on the trainer's own errors.

- `stream(named, version)`: buckets packed from the exported tensors as they come, each sent
  from one reusable packing buffer (no dual buffer; the trainer waits throughout).
- `snapshot(named, version)` + `start(fn)`: dual buffer — the whole stage packed into buffers
  kept between versions (the only part the trainer waits for), sent from a background thread;
  `wait()` joins it.

On CUDA (NCCL) the sends run on a stream of the producer's own (megarl.utils.streams): each
broadcast is ordered after its bytes were written (the snapshot's copies, or the bucket's
packing, marked by an event on the trainer's stream), and "sent" means an event after it was
synchronised on the host, never that `work.wait()` returned. A broadcast that cannot complete
(an engine refused its bucket, or died, or is silent past the bucket's bound) aborts the NCCL
communicator at once; under gloo the group is closed when its pending wait ends.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from megarl.rollout.weights import (bucket_layout, in_daemon_thread, new_update_group,
                                    unpack_bucket)
from megarl.utils.streams import SideStream

from .buckets import Bucket, BucketPacker
from .protocol import (NoEngineToSend, SyncConfig, WeightSyncError, copy_bytes,
                       update_group_ranks)
from .transports import STALE_VERSION, EngineLink
from .verify import SentDigest, check_engine, direct

logger = logging.getLogger(__name__)

_SPLIT_COPY_BYTES = 4 << 20  # snapshot copies at least this large use two threads
# How stock SGLang (and the embedded engine) words a failed receive. Stock 0.5.23 uses the
# same words for refusals raised BEFORE it joins the broadcast (scheduler_components/
# weight_updater.py wraps every exception of the receive): an unknown group (the engine lost
# it, e.g. restarted), a bucket layout it rejects (weight_sync/tensor_bucket.py), a dtype
# name torch lacks. Those are the engine's own refusals and `_refused` tells them apart; only
# the rest, a receive that broke in transport, means another peer left the broadcast.
RECEIVE_FAILED = "Failed to receive weights"
_REFUSAL_MARKS = ("init_weights_update_group` first", "empty tensor bucket",
                  "Negative dimension", "Unaligned received tensor",
                  "module 'torch' has no attribute", "Must provide either")


def _refused(why: str) -> bool:
    """An engine's failure answer says it refused the bucket (never joined the broadcast)."""
    return RECEIVE_FAILED not in why or any(m in why for m in _REFUSAL_MARKS)


@dataclass
class SyncStats:
    version: int
    stage: int = 0
    bytes: int = 0
    buckets: int = 0
    blocking_s: float = 0.0  # what the trainer waited for
    transfer_s: float = 0.0  # first update call to last answer
    pause_s: float = 0.0  # engines paused (pause to continue), coordinator only
    stale: list[str] = field(default_factory=list)  # engines dropped during this version

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.transfer_s, 1e-9) / 1e9


@dataclass
class Snapshot:
    version: int
    buckets: list[Bucket]
    blocking_s: float


class _EngineFailed(Exception):
    """Engines to drop (none: the group failed, not an engine) and whether the broadcast
    completed; `why` is the transport's error."""

    def __init__(self, engines: dict[str, str], delivered: bool, why: str = ""):
        self.engines, self.delivered, self.why = engines, delivered, why
        super().__init__("; ".join(f"{n}: {w}" for n, w in engines.items()) or why)


class _LoopThread:
    """An asyncio loop on a daemon thread, so synchronous trainer code can drive engine calls."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="megarl-weight-sync-io")
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Cancel what is still running (a call to an engine that is cut off would hold its
        caller, and that caller's thread the process's exit, for its whole timeout), stop."""
        def stop():
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.call_later(0.1, self.loop.stop)  # let the cancellations be delivered
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(stop)
        self._thread.join(5)


class WeightProducer:
    def __init__(self, links: list[EngineLink], config: SyncConfig, *, stage: int = 0,
                 group_name: str = "megarl-weights", backend: str = "gloo",
                 device: str | torch.device = "cpu"):
        self.links, self.config, self.stage = list(links), config, stage
        self.backend, self.device = backend, torch.device(device)
        self._side = SideStream(self.device)  # where broadcasts are posted and waited on
        # Each group built gets a name of its own (`connect`): stock SGLang (0.5.23, through
        # torch's process-group registry) refuses a name it has held before, even once that
        # group is destroyed, so a rebuilt group, or a second run's, needs a new one.
        self._group_base, self._groups_built = group_name, 0
        self.group_name = group_name
        self.group = None
        self._members: set[str] = set()  # engines in the current group
        self._last_sent: concurrent.futures.Future | None = None  # the last broadcast's wait
        self.sent_checksums = SentDigest()  # verify mode: the version being sent
        self.stale: dict[str, str] = {}  # engine -> why
        self._retired: set[str] = set()  # stale engines already given STALE_VERSION
        # Replacements for dead engines (slot -> link), taken in at the start of a version:
        # set from the caller's thread while a background delivery may be using `links`.
        self._swaps: dict[int, EngineLink] = {}
        self._swap_lock = threading.Lock()
        self._address = "127.0.0.1"
        self._version: int | str = "-"  # the version being opened, for errors
        self._io = _LoopThread()
        self._snap_bufs: dict[int, torch.Tensor] = {}
        self.last_snapshot: Snapshot | None = None  # its buffers hold it until the next one
        self._pack_buf: torch.Tensor | None = None
        self._bg: concurrent.futures.Future | None = None
        self._bg_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-wsync")
        self._copy_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-copy")

    # -- engines and the group ----------------------------------------------------------------
    def live(self) -> list[EngineLink]:
        return [l for l in self.links if l.name not in self.stale]

    def _none_left(self) -> WeightSyncError:
        why = "; ".join(f"engine {n}: {w}" for n, w in self.stale.items()
                        if n in {l.name for l in self.links})
        return NoEngineToSend(self._version, None, "no engine left to send weights to"
                               + (f" ({why})" if why else ""), stage=self.stage)

    def stale_now(self) -> list[str]:
        """The engine slots whose engine is stale (a dead engine whose slot has a replacement
        is history, not a stale engine)."""
        return sorted(l.name for l in self.links if l.name in self.stale)

    def _each(self, links, fn, timeout: float | None = None) -> list:
        """`fn(link)` on each link concurrently, within the timeout; exceptions come back in
        place of results."""
        timeout = timeout or self.config.timeout_s

        async def run():
            return await asyncio.gather(*(asyncio.wait_for(fn(l), timeout) for l in links),
                                        return_exceptions=True)
        return self._io.submit(run()).result()

    def _all(self, links, fn, what: str) -> list:
        results = self._each(links, fn)
        for link, r in zip(links, results):
            if isinstance(r, BaseException):
                raise RuntimeError(f"{what} failed on engine {link.name}: "
                                   f"{_why(r, self.config.timeout_s)}")
        return results

    def connect(self, address: str | None = None, port: int | None = None) -> None:
        """Host the update group and have every live engine join it, engines first (the
        trainer's rendezvous blocks until they have). Engine i's TP ranks start at its offset."""
        from megarl.utils.launch import free_port

        self._address = address or self._address
        port = port or free_port(self._address)
        links = self.live()
        if not links:
            raise self._none_left()
        offsets, world = update_group_ranks([l.tp_size for l in links])
        self._groups_built += 1
        self.group_name = f"{self._group_base}-{uuid.uuid4().hex[:8]}-{self._groups_built}"
        async def join_all():
            return await asyncio.gather(*(asyncio.wait_for(l.init_group(
                self._address, port, off, world, self.group_name, self.backend),
                self.config.timeout_s) for l, off in zip(links, offsets)),
                return_exceptions=True)

        joins = self._io.submit(join_all())
        # The group's own timeout bounds a broadcast that megarl's deadline does not end
        # (gloo's wait): the largest bucket this producer can send. Under NCCL the producer
        # aborts the communicator at its own deadline, which must come first: the watchdog's
        # timeout ends the process, so it gets one call timeout more.
        bound = self.config.bucket_timeout_s(max(self.config.produce_bytes,
                                                 self.config.bucket_bytes))
        if self.backend == "nccl":
            bound += self.config.timeout_s
        group = in_daemon_thread(lambda: new_update_group(
            self._address, port, 0, world, self.group_name, self.backend, timeout_s=bound))
        # An engine that refuses to join (stock: a group name it still holds) answers at once,
        # while the rendezvous would wait for it until its timeout: watch both.
        concurrent.futures.wait([group, joins], return_when=concurrent.futures.FIRST_COMPLETED)
        for link, r in zip(links, joins.result()):
            if isinstance(r, BaseException):
                raise RuntimeError(f"engine {link.name} did not join {self.group_name}: "
                                   f"{_why(r, self.config.timeout_s)}")
        self.group = group.result()
        self._members = {l.name for l in links}
        logger.info("update group %s: trainer + %d engine(s), world %d, rank offsets %s",
                    self.group_name, len(links), world, offsets)

    def _rebuild(self) -> None:
        """A new group without the stale engines (the old one may be mid-broadcast)."""
        old, self.group = self.group, None
        if old is not None:
            self._drop(old)
        live = self.live()
        self._each(live, lambda l: l.destroy_group(self.group_name))
        self._each([l for l in self.links if l.name in self.stale],
                   lambda l: l.destroy_group(self.group_name), timeout=5)
        self.connect()

    def _drop(self, group) -> None:
        """Leave a group that may have a broadcast pending (one that cannot complete: the
        reason it is dropped). NCCL: abort the communicator now, which ends the kernel.
        Gloo: close it once the pending wait has ended (at the group's timeout); tearing a
        gloo group down under one can stall the process."""
        pending = self._last_sent is not None and not self._last_sent.done()
        if pending and group.backend == "nccl":
            logger.warning("stage %d: aborting update group %s under a broadcast that cannot "
                           "complete", self.stage, group.name)
            group.abort()
        elif pending:
            self._last_sent.add_done_callback(lambda _: group.close())
        else:
            group.close()

    def mark_stale(self, engines: dict[str, str]) -> None:
        new = {n: w for n, w in engines.items() if n not in self.stale}
        for n, why in new.items():
            logger.error("engine %s marked stale (stage %d): %s", n, self.stage, why)
        self.stale.update(new)

    def replace_link(self, index: int, link: EngineLink, after: int = 0) -> None:
        """Engine slot `index` has a new engine (the old one died): from the first version
        whose sequence number is above `after` on, the group is rebuilt with it and it
        receives every bucket like the others. A sequence number, not "the next one this
        thread opens": a background delivery may be mid-version when this is called, and
        every pipeline stage must take the engine in at the same version."""
        with self._swap_lock:
            self._swaps[index] = (link, after)

    def link_of(self, index: int) -> EngineLink:
        """Engine slot `index`'s engine: its replacement when one is waiting to be taken in."""
        with self._swap_lock:
            return self._swaps[index][0] if index in self._swaps else self.links[index]

    def leave(self) -> None:
        """The engines drop this producer's group (a refit's, used once): a group an engine
        holds is a store connection and, under NCCL, device memory."""
        if self.group is not None:
            self._each(self.live(), lambda l: l.destroy_group(self.group_name), timeout=10)

    def _take_swaps(self, seq: int) -> None:
        with self._swap_lock:
            swaps = {i: link for i, (link, after) in self._swaps.items() if after < seq}
            for i in swaps:
                del self._swaps[i]
        for i, link in swaps.items():
            old = self.links[i]
            self.stale.setdefault(old.name, "replaced")  # never addressed again
            self._retired.add(old.name)
            self.links[i] = link
            self.stale.pop(link.name, None)
            self._retired.discard(link.name)
            self._each([old], lambda l: l.close(), timeout=5)
            logger.info("engine slot %d: %s replaces %s in %s", i, link.name, old.name,
                        self.group_name)

    def exclude(self, engines: dict[str, str], seq: int | None = None) -> None:
        """Leave out engines another stage found stale and, at the start of version number
        `seq`, take in the replacements due by then (a new group when the members change)."""
        if seq is not None:
            self._take_swaps(seq)
        self.mark_stale(engines)
        if self._members != {l.name for l in self.live()}:
            self._rebuild()

    def _try(self, links, fn, what: str) -> None:
        """`fn` on each link; an engine that fails it is marked stale (not the sync)."""
        results = self._each(links, fn)
        self.mark_stale({l.name: f"{what}: {_why(r, self.config.timeout_s)}"
                         for l, r in zip(links, results) if isinstance(r, BaseException)})

    def open_version(self, version: int | str = "-") -> None:
        """Pause (where the engine loads into live weights) and begin the update session."""
        self._version = version
        self._try([l for l in self.live() if l.pause_for_update], lambda l: l.pause(),
                  "pause_generation")
        self._try(self.live(), lambda l: l.begin(), "begin_weight_update")
        self.exclude({})  # a new group if an engine just failed

    def close_version(self, stale: dict[str, str]) -> None:
        """End the session, flush once, continue. Engines found stale get `STALE_VERSION`
        (their requests are aborted and come back as partials) and are continued too, so
        nothing waits on them."""
        self.mark_stale(stale)
        live = self.live()
        self._try(live, lambda l: l.end(), "end_weight_update")
        # Paused engines hold their requests retracted (no KV), so the flush must succeed:
        # one that refuses would serve prefixes computed with the old weights under the new
        # version, so it is stale. Engines that stage and swap (pause_for_update False) keep
        # no KV across versions and are not asked.
        paused = [l for l in self.live() if l.pause_for_update]
        flushed = self._each(paused, lambda l: l.flush())
        self.mark_stale({l.name: "flush_cache after the update: " + (
            _why(r, self.config.timeout_s) if isinstance(r, BaseException) else "refused")
            for l, r in zip(paused, flushed) if r is not True})
        self._try([l for l in self.live() if l.pause_for_update], lambda l: l.resume(),
                  "continue_generation")
        dead = [l for l in self.links if l.name in self.stale and l.name not in self._retired]
        self._retired.update(l.name for l in dead)
        if dead:
            self._each(dead, lambda l: l.set_version(STALE_VERSION, abort_all_requests=True),
                       timeout=10)
            self._each(dead, lambda l: l.end(), timeout=10)
            self._each(dead, lambda l: l.resume(), timeout=10)
        if not self.live():
            raise self._none_left()

    def engine_checksums(self) -> list[dict[str, str]]:
        return self._all(self.live(), lambda l: l.checksums(), "weights_checker")

    def verify(self, version: int, digest: SentDigest) -> dict[str, int]:
        """Verify mode: each live engine's `/weights_checker` checksums against what this
        stage sent, where they can be compared, else against each other's (the meaning of
        each case is in megarl.weight_sync.verify). Returns, per engine compared with the
        trainer, how many tensors were."""
        live = self.live()
        compared_with_trainer = {}
        infos = self._each(live, lambda l: l.server_info())
        got = self._each(live, lambda l: l.checksums())
        others = []
        for link, info, sums in zip(live, infos, got):
            failed = next((r for r in (info, sums) if isinstance(r, BaseException)), None)
            if failed is not None:  # an engine that died since it took the version
                self.mark_stale({link.name: f"weights_checker: "
                                            f"{_why(failed, self.config.timeout_s)}"})
                continue
            if not direct(info):
                others.append((link, info, sums))
                continue
            compared, skipped, bad = check_engine(
                sums, digest, info.get("dtype"), info.get("engine") == "megarl-embedded")
            if bad:
                raise WeightSyncError(version, None, f"checksum of {bad[0]} is {sums[bad[0]]}, "
                                      f"sent {digest.checksums[bad[0]]} ({len(bad)} of "
                                      f"{compared} tensors differ)", stage=self.stage,
                                      engine=link.name)
            compared_with_trainer[link.name] = compared
            logger.info("weights v%d stage %d on %s: %d tensors equal the trainer's "
                        "(%d not comparable: cast or padded on load)", version, self.stage,
                        link.name, compared, skipped)
        layouts: dict[tuple, list] = {}
        for link, info, sums in others:
            layouts.setdefault((info.get("device"), info.get("tp_size")), []).append(
                (link, sums))
        for (device, tp), members in layouts.items():
            if len(members) < 2:
                logger.info("verify v%d: %s (%s, TP %s) cannot be compared with the trainer "
                            "(its checksums are of its own shards or CUDA hashes) nor with "
                            "another engine", version, members[0][0].name, device, tp)
                continue
            first = members[0][1]
            for link, sums in members[1:]:
                bad = [n for n in first if sums.get(n) != first[n]]
                if bad:
                    raise WeightSyncError(version, None, f"engines {members[0][0].name} and "
                                          f"{link.name} disagree on {bad[0]} ({len(bad)} "
                                          "tensors)", stage=self.stage, engine=link.name)
            logger.info("verify v%d: %d engines (%s, TP %s) hold equal weights", version,
                        len(members), device, tp)
        logger.info("weights v%d stage %d verified on %d engine(s)", version, self.stage,
                    len(self.live()))
        return compared_with_trainer

    # -- sending ------------------------------------------------------------------------------
    def send(self, buckets: Iterable[Bucket], version: int, set_version: bool,
             stats: SyncStats) -> SyncStats:
        """Send buckets in order; the last one carries `version` when `set_version`."""
        self.exclude({})  # engines found stale since the group was built leave it first
        if not self.live():
            raise self._none_left()
        it = iter(buckets)
        cur = next(it, None)
        while cur is not None:
            nxt = next(it, None)
            self._send_bucket(cur, version if (set_version and nxt is None) else None)
            stats.bytes += cur.meta.nbytes
            stats.buckets += 1
            cur = nxt
        stats.stale = self.stale_now()
        return stats

    def _send_bucket(self, b: Bucket, tag: int | None) -> None:
        flat = b.flat(self._packing_buffer)
        if self.config.verify:  # what this bucket holds, hashed as the engines will
            layout = bucket_layout(*(lambda r: (r["names"], r["dtypes"], r["shapes"]))(
                b.meta.request(self.group_name)))
            for n, t in unpack_bucket(flat, layout):
                self.sent_checksums.add(n, t)
        last = ""
        for _ in range(len(self.links) + 1):
            try:
                self._broadcast(b, flat, tag)
                return
            except _EngineFailed as f:
                if not f.engines:
                    last = f"; last: {f.why}"
                    logger.warning("stage %d bucket %d: the broadcast failed (%s) with every "
                                   "engine healthy; a new group, the bucket again", self.stage,
                                   b.meta.index, f.why)
                self.mark_stale(f.engines)
                self._rebuild()  # raises once no engine is left
                if f.delivered:
                    return  # every engine still in the group has this bucket
        raise WeightSyncError(b.meta.version, b.meta.index, "engines kept failing" + last,
                              stage=self.stage)

    def _broadcast(self, b: Bucket, flat: torch.Tensor, tag: int | None) -> None:
        if self.group is None:
            raise WeightSyncError(b.meta.version, b.meta.index, "no update group; connect "
                                  "first", stage=self.stage)
        links, timeout = self.live(), self.config.bucket_timeout_s(b.meta.nbytes)
        # The bytes were written on the calling thread's stream (a snapshot's copies, earlier;
        # this bucket's packing, just now): the broadcast on the side stream waits for them.
        ready = b.ready if b.ready is not None else self._side.mark_current()
        answers = [self._io.submit(asyncio.wait_for(
            l.update_bucket(b.meta, self.group_name, tag), timeout)) for l in links]
        group = self.group

        def post_and_complete():
            # Posted here, not on this thread: NCCL builds its communicator at a group's first
            # collective and that blocks until every rank joins, which one that refused the
            # bucket never does; this thread must stay free to see the refusal and abort.
            with self._side.after(ready):
                work = group.broadcast_async(flat, 0)
            # Done when the bytes are out: under NCCL an event after the broadcast,
            # synchronised (not `work.wait()`, which returns at once); gloo: the blocking wait.
            self._side.complete(work)

        sent = self._last_sent = in_daemon_thread(post_and_complete)
        deadline = time.monotonic() + timeout
        # Until the bytes are out, an engine that answers with a failure has refused without
        # receiving (stock SGLang checks before it receives), or died: the broadcast cannot
        # complete. One whose receive failed has not refused: a peer left the group.
        broken = None
        while not sent.done():
            concurrent.futures.wait([sent, *answers], deadline - time.monotonic(),
                                    concurrent.futures.FIRST_COMPLETED)
            failed = _failures(links, answers, timeout)
            refused = {n: w for n, w in failed.items() if _refused(w)}
            if refused:
                raise _EngineFailed(refused, delivered=False)
            if failed:
                broken = next(iter(failed.values()))
                break
            if time.monotonic() >= deadline:
                raise _EngineFailed({l.name: f"no answer within {timeout:g} s"
                                     for l, a in zip(links, answers) if not a.done()},
                                    delivered=False)
        if broken is None and sent.exception() is not None:
            broken = str(sent.exception())
        if broken is not None:
            raise _EngineFailed(self._culprits(links, answers, broken, timeout),
                                delivered=False, why=broken)
        concurrent.futures.wait(answers, max(0.0, deadline - time.monotonic()))
        failed = _failures(links, answers, timeout)
        failed.update({l.name: f"no answer within {timeout:g} s"
                       for l, a in zip(links, answers) if not a.done()})
        if failed:
            raise _EngineFailed(failed, delivered=True)

    def _culprits(self, links, answers, error: str, timeout: float) -> dict[str, str]:
        """A peer left the group mid-broadcast: which engine. The engines still in it fail
        their receive too (`RECEIVE_FAILED`); the culprit refused without receiving, failed
        otherwise (its connection dropped: a dead process) or says nothing. Every answer is
        read at least once, however many are already in: under load they all are by the time
        the broadcast's failure is seen. Where every engine answered a failed receive, each is
        asked for its health (liveness) and those that do not answer are the culprits; with
        none, the failure is the group's, not an engine's (empty: rebuild with everyone, send
        again)."""
        until = time.monotonic() + min(timeout, 5.0)
        while True:
            failed = {n: w for n, w in _failures(links, answers, timeout).items()
                      if _refused(w)}
            if failed or all(a.done() for a in answers) or time.monotonic() >= until:
                break
            concurrent.futures.wait(answers, until - time.monotonic(),
                                    concurrent.futures.FIRST_COMPLETED)
        if failed:
            return failed
        silent = {l.name: f"no answer after the broadcast failed ({error})"
                  for l, a in zip(links, answers) if not a.done()}
        if silent:
            return silent
        alive = self._each(links, lambda l: l.health(), timeout=min(timeout, 5.0))
        return {l.name: f"broadcast failed ({error}) and its health check does not answer"
                for l, ok in zip(links, alive) if ok is not True}

    def _packing_buffer(self, index: int, nbytes: int) -> torch.Tensor:
        if self._pack_buf is None or self._pack_buf.numel() < nbytes:
            self._pack_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._pack_buf

    def stream(self, named: Iterable[tuple[str, torch.Tensor]], version: int
               ) -> Iterator[Bucket]:
        """Buckets from the exported tensors: up to `produce_bucket_mb` of them are gathered
        (exported: TP all-gathers, renaming) before their buckets go out, so the trainer's
        collectives run back to back rather than between broadcasts."""
        packer = BucketPacker(version, self.config.bucket_bytes, self.stage)
        window, held = [], 0
        for name, t in named:
            window.extend(packer.add(name, t.to(self.device)))
            held += t.numel() * t.element_size()
            if held >= self.config.produce_bytes:
                yield from window
                window, held = [], 0
        yield from window
        yield from packer.finish()

    def _snapshot_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """On CPU a large tensor is split over two threads of plain memcpy (it does not stall
        at an OpenMP barrier when another process holds a core); on GPU one device copy."""
        n = src.numel()
        if n < _SPLIT_COPY_BYTES or dst.device.type != "cpu" or src.device.type != "cpu":
            copy_bytes(dst, src)
            return
        half = n // 2
        other = self._copy_pool.submit(copy_bytes, dst[half:], src[half:])
        copy_bytes(dst[:half], src[:half])
        other.result()

    def snapshot(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> Snapshot:
        """Pack the stage into the snapshot buffers; after this the trainer may change its
        weights. Waits for a still-running transfer first (it reads the same buffers)."""
        t0 = time.perf_counter()
        self.wait()

        def buffer(index, nbytes):
            buf = self._snap_bufs.get(index)
            if buf is None or buf.numel() < nbytes:
                buf = self._snap_bufs[index] = torch.empty(nbytes, dtype=torch.uint8,
                                                           device=self.device)
            return buf

        buckets = [b.snapshot(buffer, self._snapshot_copy)
                   for b in self.stream(named, version)]
        # The copies are queued on the trainer's stream, so its next writes to the weights
        # come after them without a host wait; the sends wait for this mark (CPU: a no-op).
        ready = self._side.mark_current()
        for b in buckets:
            b.ready = ready
        self.last_snapshot = Snapshot(version, buckets, time.perf_counter() - t0)
        return self.last_snapshot

    def start(self, fn: Callable[[], SyncStats]) -> None:
        """Run a delivery on the background thread; `wait()` collects its outcome."""
        self._bg = self._bg_pool.submit(fn)

    def wait(self, timeout: float | None = None) -> SyncStats | None:
        """Join the background delivery, if any; re-raises its failure."""
        bg, self._bg = self._bg, None
        return None if bg is None else bg.result(timeout)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop sending. A delivery still under way gets `timeout_s` to end: one blocked on an
        engine that is cut off would otherwise hold the run's exit for the sync timeout."""
        try:
            self.wait(timeout_s)
        except concurrent.futures.TimeoutError:
            logger.warning("weight delivery still running after %.0f s at close; abandoned",
                           timeout_s)
        except Exception:  # noqa: BLE001 - already reported; closing must go on
            pass
        self._bg_pool.shutdown(wait=False, cancel_futures=True)
        self._copy_pool.shutdown(wait=False, cancel_futures=True)
        self._each(self.links, lambda l: l.close(), timeout=10)
        self._io.close()
        if self.group is not None:
            if self._last_sent is None or self._last_sent.done():
                self.group.close()
            elif self.group.backend == "nccl":
                self.group.abort()
            self.group = None


def _failures(links, answers, timeout: float) -> dict[str, str]:
    return {l.name: _why(a.exception(), timeout) for l, a in zip(links, answers)
            if a.done() and a.exception() is not None}


def _why(e: BaseException, timeout: float) -> str:
    if isinstance(e, (asyncio.TimeoutError, concurrent.futures.TimeoutError, TimeoutError)):
        return f"no answer within {timeout:g} s"
    return f"{type(e).__name__}: {e}"
