"""The trainer side of a weight sync: one pipeline stage's sender, rank 0 of its update group.

Owns the stage's update group, its snapshot buffers (dual buffer) and the background transfer
thread. Per bucket it announces the metadata to every engine through its API (without waiting
for the answer: the engine's call returns only once it has received the bytes), broadcasts the
bucket in `chunk_bytes` pieces (posted asynchronously), announces the next bucket, and
collects the previous bucket's answers within `timeout_s` once the next bucket is out; any
failure raises `WeightSyncError` naming version, stage, bucket and engine, and leaves the
group unusable until `connect` is called again.

- `send(named, version)`: stream — bucket by bucket straight from the exported tensors (no
  dual buffer; the caller pauses the engines and the bytes land in their live weights).
- `snapshot(named, version)` + `start(snapshot)`: dual buffer — copy the whole stage into
  buffers kept between versions (the only part the trainer waits for), then send from a
  background thread; `wait()` joins it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from megarl.rollout.weights import new_update_group

from .buckets import Bucket, BucketPacker
from .protocol import BucketMeta, SyncConfig, WeightSyncError, copy_bytes

logger = logging.getLogger(__name__)

_SPLIT_COPY_BYTES = 4 << 20  # snapshot copies at least this large use two threads


@dataclass
class SyncStats:
    version: str
    stage: int = 0
    bytes: int = 0
    buckets: int = 0
    pieces: int = 0
    blocking_s: float = 0.0  # what the trainer waited for
    transfer_s: float = 0.0  # first announcement to last engine answer
    results: list = field(default_factory=list, repr=False)  # last bucket's answers

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.transfer_s, 1e-9) / 1e9


@dataclass
class Snapshot:
    version: str
    buckets: list[Bucket]
    blocking_s: float


@dataclass
class _InFlight:
    """An announced bucket: every engine's pending answer, and when each failed."""

    meta: BucketMeta
    answers: list[concurrent.futures.Future]
    failed_at: dict[int, float] = field(default_factory=dict)


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
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class WeightProducer:
    def __init__(self, links: list, config: SyncConfig, *, stage: int = 0, num_stages: int = 1,
                 group_name: str = "megarl-weights", backend: str = "gloo",
                 device: str | torch.device = "cpu"):
        self.links, self.config = list(links), config
        self.stage, self.num_stages = stage, num_stages
        self.group_name, self.backend, self.device = group_name, backend, torch.device(device)
        self.group = None
        self.broken: str | None = None
        self._io = _LoopThread()
        self._snap_bufs: dict[int, torch.Tensor] = {}
        self._scratch_bufs: list[torch.Tensor | None] = [None, None]  # straddling pieces
        self._bg: concurrent.futures.Future | None = None
        self._bg_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-wsync")
        self._copy_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-copy")

    # -- group and engine control -------------------------------------------------------------
    async def _each(self, fn) -> list:
        """`fn(link)` on every engine concurrently, each within the timeout; exceptions are
        returned in place of results, one per link."""
        timeout = self.config.timeout_s
        return await asyncio.gather(*(asyncio.wait_for(fn(l), timeout) for l in self.links),
                                    return_exceptions=True)

    def _all(self, fn, what: str) -> list:
        """Run `fn(link)` on every engine; raise naming the first that failed."""
        timeout = self.config.timeout_s
        results = self._io.submit(self._each(fn)).result()
        for link, r in zip(self.links, results):
            if isinstance(r, BaseException):
                raise RuntimeError(f"{what} failed on engine {link.name}: {_why(r, timeout)}")
        return results

    def connect(self, address: str, port: int) -> None:
        """Host the update group and have every engine join it (engines first: the trainer's
        rendezvous blocks until they have)."""
        world = 1 + len(self.links)
        rank = {id(l): 1 + i for i, l in enumerate(self.links)}
        joins = self._io.submit(self._each(lambda l: l.init_group(
            address, port, rank[id(l)], world, self.group_name, self.backend)))
        self.group = new_update_group(address, port, 0, world, self.group_name, self.backend,
                                      timeout_s=self.config.timeout_s)
        for link, r in zip(self.links, joins.result()):
            if isinstance(r, BaseException):
                raise RuntimeError(f"engine {link.name} did not join {self.group_name}: {r!r}")
        self.broken = None

    def pause_engines(self, mode: str = "abort") -> None:
        self._all(lambda l: l.pause(mode), "pause_generation")

    def resume_engines(self) -> None:
        self._all(lambda l: l.resume(), "continue_generation")

    def engine_digests(self, names: list[str] | None = None) -> list[dict]:
        return self._all(lambda l: l.weights_digest(names), "weights_digest")

    # -- sending ------------------------------------------------------------------------------
    def _packer(self, version: str, buffer, direct: bool, **kw) -> BucketPacker:
        return BucketPacker(version, self.config.bucket_bytes, self.config.chunk_bytes, buffer,
                            stage=self.stage, num_stages=self.num_stages,
                            verify=self.config.verify, direct=direct, **kw)

    def _snapshot_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The snapshot's copy: on CPU a large tensor is split over two threads of plain
        memcpy (as fast as torch's OpenMP copy on an idle box, and it does not stall at a
        barrier when another process holds a core); on GPU one device copy."""
        n = src.numel()
        if n < _SPLIT_COPY_BYTES or dst.device.type != "cpu" or src.device.type != "cpu":
            copy_bytes(dst, src)
            return
        half = n // 2
        other = self._copy_pool.submit(copy_bytes, dst[half:], src[half:])
        copy_bytes(dst[:half], src[:half])
        other.result()

    def _send_all(self, buckets: Iterable[Bucket], stats: SyncStats) -> None:
        """Send buckets in order, pipelined: once bucket k's pieces are posted, bucket k+1 is
        announced (so the engine has its metadata before bucket k's bytes are done), and
        bucket k's answers are collected once bucket k+1's bytes are out (they are there by
        then: the engine finishes k before it receives k+1). Every announced bucket is
        broadcast unless the group failed, and a failure closes the group, so no engine is
        left waiting for bytes."""
        it = iter(buckets)
        nxt = next(it, None)
        nxt_fl = self._announce(nxt.meta) if nxt is not None else None
        prev: _InFlight | None = None
        while nxt is not None:
            cur, cur_fl = nxt, nxt_fl
            try:
                works = self._post(cur, stats)
            except Exception as e:  # noqa: BLE001 - a dead peer surfaces as any gloo/NCCL error
                self._broadcast_failed(e, cur_fl, prev)
            nxt = next(it, None)  # stream mode: the next bucket's tensors (views)
            nxt_fl = self._announce(nxt.meta) if nxt is not None else None
            try:
                for work in works:
                    work.wait()
            except Exception as e:  # noqa: BLE001
                self._broadcast_failed(e, cur_fl, prev)
            stats.bytes += cur.meta.nbytes
            del cur, works  # stream mode: the source tensors may go
            if prev is not None:
                self._collect(prev, stats)
            prev = cur_fl
        if prev is not None:
            self._collect(prev, stats)

    def _announce(self, meta: BucketMeta) -> "_InFlight":
        if self.broken:
            raise WeightSyncError(meta.version, meta.index, self.broken, stage=self.stage)
        timeout, payload = self.config.timeout_s, meta.to_json()
        fl = _InFlight(meta, [self._io.submit(asyncio.wait_for(
            l.update_bucket(self.group_name, payload), timeout)) for l in self.links])
        for f in fl.answers:
            f.add_done_callback(lambda f: fl.failed_at.setdefault(id(f), time.monotonic())
                                if not f.cancelled() and f.exception() is not None else None)
        return fl

    def _scratch(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._scratch_bufs[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self._scratch_bufs[slot] = torch.empty(nbytes, dtype=torch.uint8,
                                                         device=self.device)
        return buf

    def _post(self, bucket: Bucket, stats: SyncStats) -> list:
        """Post every piece of a bucket asynchronously; returns the works to wait for. Pieces
        that straddle tensors are gathered into two alternating scratch buffers (the gather
        of one overlaps the send of the other); the rest go straight from the tensors (or the
        snapshot)."""
        works, slot_work, used = [], [None, None], []

        def scratch(n):
            slot = len(used) % 2
            if slot_work[slot] is not None:
                slot_work[slot].wait()  # the piece it held is out
            used.append(slot)
            return self._scratch(slot, n)

        for a, b in bucket.meta.chunks():
            gathered = len(used)
            work = self.group.broadcast_async(bucket.piece(a, b, scratch), 0)
            if len(used) > gathered:
                slot_work[used[-1]] = work
            works.append(work)
            stats.pieces += 1
        return works

    def _broadcast_failed(self, e: BaseException, fl: "_InFlight", prev: "_InFlight | None"):
        """Raise the WeightSyncError for a failed broadcast, naming the likely culprit."""
        meta, timeout, t_err = fl.meta, self.config.timeout_s, time.monotonic()
        if prev is not None:  # the previous bucket's failure broke the group: name it
            for link, f in zip(self.links, prev.answers):
                if f.done() and not f.cancelled() and f.exception() is not None:
                    self._fail(WeightSyncError(prev.meta.version, prev.meta.index,
                                               _why(f.exception(), timeout),
                                               stage=self.stage, engine=link.name))
        # Blame engines whose call failed well before the broadcast gave up (they caused it);
        # else those still silent a moment later (hung). Healthy peers fail too, but only once
        # the broken group is torn down.
        answers, failed_at = fl.answers, fl.failed_at
        early = [l.name for l, f in zip(self.links, answers)
                 if failed_at.get(id(f), t_err) < t_err - 0.5]
        concurrent.futures.wait(answers, timeout=1.0)
        silent = [l.name for l, f in zip(self.links, answers) if not f.done() or (
            id(f) in failed_at and isinstance(f.exception(), asyncio.TimeoutError))]
        culprits = early or silent or [l.name for l, f in zip(self.links, answers)
                                       if id(f) in failed_at]
        self._fail(WeightSyncError(meta.version, meta.index, f"broadcast failed: "
                                   f"{_why(e, timeout)}", stage=self.stage,
                                   engine=", ".join(culprits) or None))

    def _collect(self, fl: "_InFlight", stats: SyncStats) -> None:
        """Every engine's answer for one bucket, within the timeout; checks checksums."""
        meta, timeout = fl.meta, self.config.timeout_s
        deadline = time.monotonic() + timeout + 5
        results = []
        for link, f in zip(self.links, fl.answers):
            try:
                r = f.result(max(0.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - the engine's failure, whatever it was
                self._fail(WeightSyncError(meta.version, meta.index, _why(e, timeout),
                                           stage=self.stage, engine=link.name))
            if meta.checksum is not None and r.get("checksum") != meta.checksum:
                self._fail(WeightSyncError(meta.version, meta.index, f"checksum "
                                           f"{r.get('checksum')} != sent {meta.checksum}",
                                           stage=self.stage, engine=link.name))
            results.append(r)
        stats.buckets += 1
        stats.results = results

    def _fail(self, err: WeightSyncError):
        """Mark the group broken and close it now: an engine still waiting on it (for a bucket
        already announced) then fails at once instead of at its group timeout."""
        self.broken = f"update group unusable after a failed sync ({err}); reconnect"
        logger.error("%s", err)
        group, self.group = self.group, None
        if group is not None:
            group.close()
        raise err

    def send(self, named: Iterable[tuple[str, torch.Tensor]], version: str,
             direct: bool = True) -> SyncStats:
        """Stream the stage bucket by bucket (the caller waits throughout). Nothing is packed:
        pieces go out from the exported tensors themselves, so they must stay unchanged until
        this returns; at most two buckets' worth of them are referenced at a time."""
        t0 = time.perf_counter()
        stats = SyncStats(str(version), self.stage)
        packer = self._packer(str(version), None, direct)

        def buckets():
            for name, t in named:
                yield from packer.add(name, t)
            yield from packer.finish()

        self._send_all(buckets(), stats)
        stats.transfer_s = stats.blocking_s = time.perf_counter() - t0
        logger.info("weights v%s stage %d sent: %.1f MB in %d buckets, %.3f s (%.2f GB/s)",
                    version, self.stage, stats.bytes / 1e6, stats.buckets, stats.transfer_s,
                    stats.gbps)
        return stats

    def snapshot(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> Snapshot:
        """Copy the stage into the snapshot buffers; after this the trainer may change its
        weights. Waits for a still-running transfer first (it reads the same buffers)."""
        t0 = time.perf_counter()
        self.wait()

        def buffer(index, nbytes):
            buf = self._snap_bufs.get(index)
            if buf is None or buf.numel() < nbytes:
                buf = self._snap_bufs[index] = torch.empty(nbytes, dtype=torch.uint8,
                                                           device=self.device)
            return buf

        packer = self._packer(str(version), buffer, direct=False, copy=self._snapshot_copy)
        buckets = [b for name, t in named for b in packer.add(name, t)]
        buckets += list(packer.finish())
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return Snapshot(str(version), buckets, time.perf_counter() - t0)

    def start(self, snap: Snapshot) -> None:
        """Send a snapshot from the background thread; `wait()` collects the outcome."""
        self._bg = self._bg_pool.submit(self._send_snapshot, snap)

    def _send_snapshot(self, snap: Snapshot) -> SyncStats:
        t0 = time.perf_counter()
        stats = SyncStats(snap.version, self.stage, blocking_s=snap.blocking_s)
        self._send_all(snap.buckets, stats)
        stats.transfer_s = time.perf_counter() - t0
        logger.info("weights v%s stage %d sent in background: %.1f MB, %d buckets, %.3f s",
                    snap.version, self.stage, stats.bytes / 1e6, stats.buckets, stats.transfer_s)
        return stats

    def wait(self, timeout: float | None = None) -> SyncStats | None:
        """Join the background transfer, if any; re-raises its WeightSyncError."""
        bg, self._bg = self._bg, None
        return None if bg is None else bg.result(timeout)

    def close(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - already reported; closing must go on
            pass
        self._bg_pool.shutdown(wait=True)
        self._copy_pool.shutdown(wait=True)
        self._io.submit(self._each(lambda l: l.close())).result(10)
        self._io.close()
        if self.group is not None:
            self.group.close()
            self.group = None


def _why(e: BaseException, timeout: float) -> str:
    if isinstance(e, (asyncio.TimeoutError, concurrent.futures.TimeoutError, TimeoutError)):
        return f"no answer within {timeout:g} s"
    return f"{type(e).__name__}: {e}"
