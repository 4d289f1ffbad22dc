"""Packing HF-named tensors into flat byte buckets, and scattering received bytes back out.

Pure tensor bookkeeping, no communication: the producer streams (name, tensor) pairs into
`BucketPacker`, which fills flat uint8 buffers of at most `bucket_bytes` and splits a tensor
that does not fit across as many buckets as it needs; the consumer calls `scatter` for every
received piece. Both sides work on bytes, so any dtype mix shares a bucket and the copy is
bit-exact by construction.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator

import torch

from .protocol import BucketMeta, Entry, byte_view, digest

logger = logging.getLogger(__name__)

# buffer(index, nbytes) -> a uint8 tensor of at least nbytes for bucket `index`
BufferFn = Callable[[int, int], torch.Tensor]


class BucketPacker:
    """Fills buckets in export order; yields each one once it is known whether it is the last.

    A full bucket is held back until the next byte arrives (or `finish`), so the final bucket
    is always flagged `last` and no empty bucket is ever sent, except by a stage that has no
    tensors at all (the consumer still needs to hear that the stage is done).
    """

    def __init__(self, version: str, bucket_bytes: int, chunk_bytes: int, buffer: BufferFn, *,
                 stage: int = 0, num_stages: int = 1, verify: bool = False, direct: bool = False):
        self.version, self.bucket_bytes, self.chunk_bytes = version, bucket_bytes, chunk_bytes
        self.stage, self.num_stages, self.verify, self.direct = stage, num_stages, verify, direct
        self._buffer = buffer
        self._index = 0
        self._meta: BucketMeta | None = None
        self._flat: torch.Tensor | None = None
        self.total_bytes = 0

    def _new_bucket(self) -> None:
        self._meta = BucketMeta(self.version, self.stage, self.num_stages, self._index, False, 0,
                                self.chunk_bytes, direct=self.direct)
        self._flat = self._buffer(self._index, self.bucket_bytes)
        self._index += 1

    def _seal(self, last: bool) -> tuple[BucketMeta, torch.Tensor]:
        meta, flat = self._meta, self._flat[: self._meta.nbytes]
        meta.last = last
        if self.verify:
            meta.checksum = digest(flat)
        self._meta = self._flat = None
        return meta, flat

    def add(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[BucketMeta, torch.Tensor]]:
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
            self._flat[meta.nbytes: meta.nbytes + n].copy_(src[done: done + n])
            meta.entries.append(Entry(name, dtype, shape, done, done + n, meta.nbytes))
            meta.nbytes += n
            done += n
            if done >= total:
                break
        self.total_bytes += total

    def finish(self) -> Iterator[tuple[BucketMeta, torch.Tensor]]:
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
            dest(e)[t0: t0 + b - a].copy_(piece[a - lo: b - lo])
