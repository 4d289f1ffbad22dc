"""Packing HF-named tensors into flattened buckets, and unpacking a received bucket.

Pure tensor bookkeeping, no communication. `BucketPacker` takes (name, tensor) pairs in export
order and lays them into buckets of whole tensors, one dtype per bucket, at most
`bucket_bytes` each (a larger tensor forms a bucket of its own). It keeps one open bucket per
dtype, so the few fp32 tensors of a bf16 model (norms, say) share buckets rather than each
closing the bf16 bucket in progress. A bucket references its tensors until `Bucket.flat`
packs them (one copy; a one-tensor bucket is sent from the tensor's own bytes, no copy).
Tensors an engine fuses on load share one bucket (`TOGETHER`): stock SGLang's DeepSeek-V3
loader fuses q_a_proj with kv_a_proj_with_mqa only when both arrive in one update call and
silently drops a lone half, so the packer holds the first until its partner comes.
`plan_buckets` runs the same layout on shapes alone (dry runs, memory plans); the receiving
side is megarl.rollout.weights.unpack_bucket.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from megarl.rollout.weights import byte_view

from .protocol import BucketMeta, TensorSpec, copy_bytes

# Names that must travel in one bucket: the group key (the layer's attention) and how many
# members it has. A model without a query latent (q_lora_rank null) has no q_a_proj: its
# kv_a_proj_with_mqa is loaded alone by stock, and goes out at `finish` at the latest.
TOGETHER = (re.compile(r"^(.*\.self_attn\.)(?:q_a_proj|kv_a_proj_with_mqa)\.weight$"), 2)

# buffer(index, nbytes) -> a uint8 tensor of at least nbytes to pack bucket `index` into
BufferFn = Callable[[int, int], torch.Tensor]


@dataclass
class Bucket:
    meta: BucketMeta
    tensors: list[torch.Tensor | None] = field(default_factory=list)
    packed: torch.Tensor | None = None  # set once the bytes are snapshotted
    # where the snapshot copy ends on the trainer's stream (CUDA: an event the send waits for)
    ready: object | None = None

    def flat(self, buffer: BufferFn | None = None,
             copy: Callable[[torch.Tensor, torch.Tensor], None] = copy_bytes) -> torch.Tensor:
        """The bucket's bytes as one flat uint8 tensor: the snapshot if there is one, a view
        of a lone tensor, or the tensors packed into `buffer(index, nbytes)`."""
        if self.packed is not None:
            return self.packed
        if len(self.tensors) == 1 and buffer is None:
            return byte_view(self.tensors[0].detach().contiguous())
        n = self.meta.nbytes
        out = (buffer(self.meta.index, n) if buffer is not None
               else torch.empty(n, dtype=torch.uint8, device=self.tensors[0].device))[:n]
        at = 0
        for t in self.tensors:
            src = byte_view(t.detach().contiguous())
            copy(out[at: at + src.numel()], src)
            at += src.numel()
        return out

    def snapshot(self, buffer: BufferFn, copy=copy_bytes) -> "Bucket":
        """Copy the bytes now (into `buffer`), drop the tensor references."""
        self.packed = self.flat(buffer, copy)
        self.tensors = []
        return self


class BucketPacker:
    """Lays (name, tensor) pairs out in flattened buckets; yields each bucket once it is
    sealed. Indices follow sealing order, which is the order buckets go on the wire."""

    def __init__(self, version: int, bucket_bytes: int, stage: int = 0):
        self.version, self.bucket_bytes, self.stage = version, int(bucket_bytes), stage
        self._open: dict[str, Bucket] = {}  # dtype -> bucket being filled
        self._held: dict[str, list] = {}  # TOGETHER key -> (spec, tensor) waiting for partners
        self._index = 0

    def _seal(self, b: Bucket) -> Bucket:
        b.meta.index = self._index
        self._index += 1
        return b

    def add_spec(self, spec: TensorSpec, tensor: torch.Tensor | None = None) -> Iterator[Bucket]:
        pattern, members = TOGETHER
        m = pattern.match(spec.name)
        if m is None:
            yield from self._add([(spec, tensor)])
            return
        group = self._held.setdefault(m.group(1), [])
        group.append((spec, tensor))
        if len(group) == members:
            yield from self._add(self._held.pop(m.group(1)))

    def _add(self, items: list) -> Iterator[Bucket]:
        """Lay `items` ((spec, tensor) pairs of one dtype) into one bucket: the open bucket
        of their dtype where they fit, else a new one; together at least `bucket_bytes`, a
        bucket of their own (the open one stays open). Mixed dtypes go one by one."""
        dtype = items[0][0].dtype
        if any(s.dtype != dtype for s, _ in items):
            for item in items:
                yield from self._add([item])
            return
        specs, tensors = [s for s, _ in items], [t for _, t in items]
        n = sum(s.nbytes for s in specs)
        if n >= self.bucket_bytes:
            yield self._seal(Bucket(BucketMeta(self.version, self.stage, -1, specs), tensors))
            return
        b = self._open.get(dtype)
        if b is not None and b.meta.nbytes + n > self.bucket_bytes:
            yield self._seal(self._open.pop(dtype))
            b = None
        if b is None:
            b = self._open[dtype] = Bucket(BucketMeta(self.version, self.stage, -1))
        b.meta.specs.extend(specs)
        b.tensors.extend(tensors)

    def add(self, name: str, tensor: torch.Tensor) -> Iterator[Bucket]:
        yield from self.add_spec(TensorSpec.of(name, tensor), tensor)

    def finish(self) -> Iterator[Bucket]:
        for key in list(self._held):  # groups short of a member (no query latent)
            yield from self._add(self._held.pop(key))
        for dtype in list(self._open):
            yield self._seal(self._open.pop(dtype))


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int, version: int = 0,
                 stage: int = 0) -> list[BucketMeta]:
    """The buckets `BucketPacker` would send for these tensors, without any tensor."""
    p = BucketPacker(version, bucket_bytes, stage)
    out = [b.meta for s in specs for b in p.add_spec(s)]
    return out + [b.meta for b in p.finish()]
