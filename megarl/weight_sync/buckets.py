"""Packing HF-named tensors into byte buckets, and scattering received bytes back out.

Pure tensor bookkeeping, no communication: the producer streams (name, tensor) pairs into
`BucketPacker`, which lays them out in buckets of at most `bucket_bytes` and splits a tensor
that does not fit across as many buckets as it needs. A packer with a `buffer` copies the
bytes into flat uint8 buffers (a snapshot the trainer may then overwrite); one without keeps
views of the tensors themselves (zero copy: the caller keeps them unchanged until sent).
`Bucket.piece` hands out one broadcast's bytes either way; the consumer calls `scatter` for
every received piece that straddles tensors. Both sides work on bytes, so any dtype mix
shares a bucket and the copy is bit-exact by construction.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .protocol import BucketMeta, Digest, Entry, byte_view, copy_bytes

logger = logging.getLogger(__name__)

# buffer(index, nbytes) -> a uint8 tensor of at least nbytes for bucket `index`
BufferFn = Callable[[int, int], torch.Tensor]


@dataclass
class Bucket:
    """One bucket's metadata and its bytes: `segments[i]` holds the bytes of `meta.entries[i]`
    (views of the packed `flat` buffer, or of the source tensors when not packed)."""

    meta: BucketMeta
    segments: list[torch.Tensor]
    flat: torch.Tensor | None = None

    def piece(self, a: int, b: int, scratch: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """Bytes [a, b) of the bucket: a view when they are contiguous in memory (packed, or
        inside one tensor), else gathered into `scratch(b - a)`."""
        if self.flat is not None:
            return self.flat[a:b]
        i = locate(self.meta, a, b)
        if i is not None:
            e = self.meta.entries[i]
            return self.segments[i][a - e.offset: b - e.offset]
        out = scratch(b - a)[: b - a]
        for e, seg in zip(self.meta.entries, self.segments):
            lo, hi = max(a, e.offset), min(b, e.offset + e.end - e.start)
            if lo < hi:
                copy_bytes(out[lo - a: hi - a], seg[lo - e.offset: hi - e.offset])
        return out


def locate(meta: BucketMeta, a: int, b: int) -> int | None:
    """Index of the entry that holds all of bucket bytes [a, b), or None if they straddle."""
    # Entries tile the bucket in offset order; the last one starting at or before `a` is the
    # non-empty one holding it (empty entries share their successor's offset).
    i = bisect.bisect_right([e.offset for e in meta.entries], a) - 1
    if i < 0:
        return None
    e = meta.entries[i]
    return i if b <= e.offset + e.end - e.start else None


class BucketPacker:
    """Lays buckets out in export order; yields each one once it is known whether it is the
    last.

    A full bucket is held back until the next byte arrives (or `finish`), so the final bucket
    is always flagged `last` and no empty bucket is ever sent, except by a stage that has no
    tensors at all (the consumer still needs to hear that the stage is done).
    """

    def __init__(self, version: str, bucket_bytes: int, chunk_bytes: int,
                 buffer: BufferFn | None, *, stage: int = 0, num_stages: int = 1,
                 verify: bool = False, direct: bool = False,
                 copy: Callable[[torch.Tensor, torch.Tensor], None] = copy_bytes):
        self.version, self.bucket_bytes, self.chunk_bytes = version, bucket_bytes, chunk_bytes
        self.stage, self.num_stages, self.verify, self.direct = stage, num_stages, verify, direct
        self._buffer, self._copy = buffer, copy
        self._index = 0
        self._meta: BucketMeta | None = None
        self._flat: torch.Tensor | None = None
        self._segments: list[torch.Tensor] = []
        self.total_bytes = 0

    def _new_bucket(self) -> None:
        self._meta = BucketMeta(self.version, self.stage, self.num_stages, self._index, False, 0,
                                self.chunk_bytes, direct=self.direct)
        if self._buffer is not None:
            self._flat = self._buffer(self._index, self.bucket_bytes)
        self._index += 1

    def _seal(self, last: bool) -> Bucket:
        meta, segments = self._meta, self._segments
        meta.last = last
        flat = None if self._flat is None else self._flat[: meta.nbytes]
        if self.verify:
            h = Digest()
            for seg in segments:
                h.update(seg)
            meta.checksum = h.hexdigest()
        self._meta = self._flat = None
        self._segments = []
        return Bucket(meta, segments, flat)

    def add(self, name: str, tensor: torch.Tensor) -> Iterator[Bucket]:
        """Pack one tensor; yields every bucket it completes except a still-open last one."""
        src = byte_view(tensor.detach().contiguous())
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape, total, done = tuple(tensor.shape), src.numel(), 0
        while True:
            if self._meta is not None and self._meta.nbytes == self.bucket_bytes and done < total:
                yield self._seal(last=False)
            if self._meta is None:
                self._new_bucket()
            meta = self._meta
            n = min(total - done, self.bucket_bytes - meta.nbytes)
            if self._flat is None:
                self._segments.append(src[done: done + n])
            else:
                seg = self._flat[meta.nbytes: meta.nbytes + n]
                self._copy(seg, src[done: done + n])
                self._segments.append(seg)
            meta.entries.append(Entry(name, dtype, shape, done, done + n, meta.nbytes))
            meta.nbytes += n
            done += n
            if done >= total:
                break
        self.total_bytes += total

    def finish(self) -> Iterator[Bucket]:
        if self._meta is None and self._index == 0:
            self._new_bucket()
        if self._meta is not None:
            yield self._seal(last=True)


def scatter(meta: BucketMeta, lo: int, piece: torch.Tensor,
            dest: Callable[[Entry], torch.Tensor]) -> None:
    """Copy bucket bytes [lo, lo + len(piece)) into the tensors they belong to.

    `dest(entry)` returns the flat uint8 view of the whole destination tensor.
    """
    hi = lo + piece.numel()
    for e in meta.entries:
        a, b = max(lo, e.offset), min(hi, e.offset + e.end - e.start)
        if a < b:
            t0 = e.start + a - e.offset
            copy_bytes(dest(e)[t0: t0 + b - a], piece[a - lo: b - lo])
