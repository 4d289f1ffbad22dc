"""The engine side of a bucketed weight sync: receive in bounded pieces, stage, hand over.

Owns the incoming version on one engine: which stages and buckets of it have arrived, the
staging buffer (the second of the dual buffers, kept between versions so it is allocated
once), the one receive piece that bounds transient memory, and the verify-mode checksums.
When does a version go live? The engine decides (megarl.rollout.engine swaps it in between two
decode steps); this module only says when a version is complete.

Two modes, chosen per bucket by the producer:
- staged (dual buffer): bytes land in the staging buffer while generation continues on the
  live weights; a failure drops the staged version and the engine keeps serving the old one.
- direct (no dual buffer): the engine is paused and bytes land in the live weights, so no
  second buffer exists; a failure leaves a half-written model, so the engine is marked broken
  until a later sync completes.
Every declared byte is received even when a bucket is rejected, so the group stays in step.

Order: the producer announces bucket k+1 while bucket k is still on the wire, and the calls
may reach the engine in any order, so each stage's buckets take turns: bucket k+1 posts its
receives only once bucket k's have finished (a broadcast is matched by the order in which
both sides post it). After a transport failure the rest of that version is refused without
touching the group. Pieces are posted asynchronously and waited for together, except those
that straddle tensors, which go through the one piece buffer.

Staging tensors change hands: `take` gives a complete version's tensors to the engine, which
may make them live by reference (megarl.rollout.weights.WeightStore.swap) and hands back the
tensors that stopped being live (`recycle`), so the two buffers alternate without a copy.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from megarl.rollout.protocol import BadRequest

from .buckets import locate, scatter
from .protocol import BucketMeta, Digest, Entry, byte_view

logger = logging.getLogger(__name__)


class _ChecksumMismatch(RuntimeError):
    pass


@dataclass
class _Incoming:
    version: str
    num_stages: int
    direct: bool
    stages_done: set[int] = field(default_factory=set)
    next_bucket: dict[int, int] = field(default_factory=dict)  # stage -> expected index
    names: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)


class BucketConsumer:
    """Receives `BucketMeta` buckets into a `megarl.rollout.weights.WeightStore`."""

    turn_timeout_s = 300.0  # how long bucket k+1 waits for bucket k's call to arrive and finish

    def __init__(self, store):
        self.store = store
        self._lock = threading.Lock()  # bookkeeping only; stages write disjoint tensors
        self._turns = threading.Condition()
        self._receiving: set[int] = set()  # stages with a bucket on the wire
        self._ended: dict[int, tuple[str, int, bool]] = {}  # stage -> (version, index, failed)
        self._incoming: _Incoming | None = None
        self._staging: dict[str, torch.Tensor] = {}
        self._pieces: dict[int, torch.Tensor] = {}  # receive buffer per stage
        self.broken: str | None = None  # set when a direct update failed half-way
        self.peak_piece_bytes = 0  # largest receive buffer ever allocated (transient memory)

    @property
    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._staging.values())

    # -- validation ---------------------------------------------------------------------------
    def _check(self, meta: BucketMeta) -> None:
        for e in meta.entries:
            p = self.store.params.get(e.name)
            if p is None:
                raise BadRequest("bucket", f"unknown parameter {e.name!r}")
            if tuple(e.shape) != tuple(p.shape):
                raise BadRequest("bucket", f"{e.name}: shape {list(e.shape)} != model's "
                                 f"{list(p.shape)}")
            if e.dtype != str(p.dtype).removeprefix("torch."):
                raise BadRequest("bucket", f"{e.name}: dtype {e.dtype} != model's {p.dtype}; "
                                 "export in the engine's dtype")
            if not 0 <= e.start <= e.end <= e.tensor_nbytes:
                raise BadRequest("bucket", f"{e.name}: byte range {e.start}:{e.end} outside "
                                 f"{e.tensor_nbytes}")

    def _begin(self, meta: BucketMeta, live_ok: bool) -> _Incoming:
        """Find or open the incoming version this bucket belongs to; raise if out of order."""
        with self._lock:
            inc = self._incoming
            if inc is None or inc.version != meta.version:
                if inc is not None:
                    logger.warning("weight version %s superseded by %s before it was complete "
                                   "(stages %s of %d); dropping it", inc.version, meta.version,
                                   sorted(inc.stages_done), inc.num_stages)
                inc = self._incoming = _Incoming(meta.version, meta.num_stages, meta.direct)
            want = inc.next_bucket.get(meta.stage, 0)
            if meta.index != want or meta.stage in inc.stages_done:
                raise BadRequest("bucket", f"version {meta.version} stage {meta.stage}: got "
                                 f"bucket {meta.index}, expected {want}")
            if meta.direct != inc.direct or (meta.direct and not live_ok):
                raise BadRequest("bucket", "a direct (no dual buffer) update needs a paused "
                                 "engine and may not mix with staged buckets")
            inc.next_bucket[meta.stage] = want + 1
            return inc

    # -- receiving ----------------------------------------------------------------------------
    def _piece(self, stage: int, nbytes: int, device) -> torch.Tensor:
        key = stage  # a stage receives one bucket at a time (turns), so one buffer each
        buf = self._pieces.get(key)
        if buf is None or buf.numel() < nbytes or buf.device != torch.device(device):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._pieces[key] = buf
            self.peak_piece_bytes = max(self.peak_piece_bytes, nbytes)
        return buf

    def _dest(self, direct: bool):
        def dest(e: Entry) -> torch.Tensor:
            p = self.store.params[e.name]
            if direct:
                return byte_view(p.data)
            t = self._staging.get(e.name)
            if t is None:
                t = self._staging[e.name] = torch.empty_like(p, memory_format=torch.contiguous_format)
            return byte_view(t)
        return dest

    def _drain(self, group, meta: BucketMeta, device) -> None:
        for a, b in meta.chunks():
            group.broadcast(self._piece(meta.stage, min(meta.chunk_bytes, meta.nbytes),
                                        device)[: b - a], 0)

    # -- ordering -----------------------------------------------------------------------------
    def _take_turn(self, meta: BucketMeta) -> None:
        """Wait until this stage's previous bucket has finished receiving (bucket 0 waits only
        for the wire to be free); refuse if it failed in transport."""
        def ready():
            if meta.stage in self._receiving:
                return False
            ended = self._ended.get(meta.stage)
            return meta.index == 0 or (ended is not None
                                       and ended[:2] == (meta.version, meta.index - 1))

        with self._turns:
            if not self._turns.wait_for(ready, self.turn_timeout_s):
                raise RuntimeError(f"bucket {meta.index - 1} of version {meta.version} stage "
                                   f"{meta.stage} never arrived")
            ended = self._ended.get(meta.stage)
            if meta.index > 0 and ended[2]:
                raise RuntimeError(f"bucket {meta.index - 1} of version {meta.version} stage "
                                   f"{meta.stage} failed; the update group is unusable")
            self._receiving.add(meta.stage)

    def _end_turn(self, meta: BucketMeta, failed: bool) -> None:
        with self._turns:
            self._receiving.discard(meta.stage)
            self._ended[meta.stage] = (meta.version, meta.index, failed)
            self._turns.notify_all()

    # -- receiving ----------------------------------------------------------------------------
    def receive(self, group, meta: BucketMeta, device="cpu", live_ok: bool = False) -> dict:
        """Receive one bucket (blocking; run it off the model thread), after this stage's
        previous bucket.

        Returns {"complete": bool, "checksum": str | None}; `complete` means every stage of
        `meta.version` has arrived and `take()` may be called. Raises BadRequest for a bad
        bucket (after draining it) and re-raises transport failures after dropping the version.
        """
        try:
            self._take_turn(meta)
        except RuntimeError as e:
            self.fail(meta.version, str(e))
            raise
        failed = True
        try:
            try:
                self._check(meta)
                inc = self._begin(meta, live_ok)
            except BadRequest:
                self._drain(group, meta, device)
                failed = False
                raise
            t0 = time.perf_counter()
            try:
                got = self._receive_pieces(group, meta, device)
            except Exception as e:
                failed = not isinstance(e, _ChecksumMismatch)  # else the group is in step
                self.fail(meta.version, f"bucket {meta.index} of stage {meta.stage}: {e}")
                raise
            failed = False
            logger.debug("bucket %d of version %s stage %d: %.1f MB in %.1f ms", meta.index,
                         meta.version, meta.stage, meta.nbytes / 1e6,
                         (time.perf_counter() - t0) * 1e3)
        finally:
            self._end_turn(meta, failed)
        with self._lock:
            inc.names.update(e.name for e in meta.entries)
            if meta.last:
                inc.stages_done.add(meta.stage)
            complete = len(inc.stages_done) == inc.num_stages
        return {"complete": complete, "checksum": got, "version": meta.version,
                "bucket": meta.index, "stage": meta.stage}

    def _receive_pieces(self, group, meta: BucketMeta, device) -> str | None:
        """Post every piece; returns the bucket's checksum in verify mode (raises on mismatch).

        A piece inside one tensor is received in place (no copy, no extra memory) and waited
        for with the others; one that straddles tensors goes through the piece buffer."""
        dest = self._dest(meta.direct)
        hasher = Digest() if meta.checksum is not None else None
        posted = []  # (work, view) in byte order

        def settle():
            for work, view in posted:
                work.wait()
                if hasher is not None:
                    hasher.update(view)
            posted.clear()

        for a, b in meta.chunks():
            i = locate(meta, a, b)
            if i is not None:
                e = meta.entries[i]
                t0 = e.start + a - e.offset
                view = dest(e)[t0: t0 + b - a]
                posted.append((group.broadcast_async(view, 0), view))
            else:
                view = self._piece(meta.stage, min(meta.chunk_bytes, meta.nbytes), device)
                view = view[: b - a]
                posted.append((group.broadcast_async(view, 0), view))
                settle()
                scatter(meta, a, view, dest)
        settle()
        if hasher is None:
            return None
        got = hasher.hexdigest()
        if got != meta.checksum:
            raise _ChecksumMismatch(f"checksum mismatch: received {got}, sent {meta.checksum}")
        return got

    def fail(self, version: str, reason: str) -> None:
        with self._lock:
            inc = self._incoming
            if inc is None or inc.version != version:
                return
            self._incoming = None
            if inc.direct:
                self.broken = f"weight version {version} half-written ({reason})"
        logger.error("weight version %s dropped: %s%s", version, reason,
                     "; engine marked broken" if inc.direct else "; old weights kept")

    def take(self, version: str) -> tuple[dict[str, torch.Tensor], bool]:
        """Hand over a complete version: (staged tensors by name, direct?). Direct versions
        are already live, so their dict is empty. The staged tensors leave the staging buffer
        (the caller owns them now; `recycle` gives buffers back)."""
        with self._lock:
            inc = self._incoming
            if inc is None or inc.version != version or len(inc.stages_done) != inc.num_stages:
                raise BadRequest("bucket", f"weight version {version} is not complete")
            self._incoming = None
            if inc.direct:
                self.broken = None
                return {}, True
            staged = {n: self._staging.pop(n) for n in inc.names}
        logger.info("weight version %s received: %d tensors in %.3f s", version,
                    len(inc.names), time.monotonic() - inc.started)
        return staged, False

    def recycle(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take back buffers that are no longer live, to stage the next version in. The caller
        must hold no other reference it writes through or reads as live weights."""
        with self._lock:
            self._staging.update(tensors)
