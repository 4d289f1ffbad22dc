"""What travels between a weight-sync producer and its consumers, and how syncs fail.

Owns the bucket wire format (`BucketMeta`), the sync settings (`SyncConfig`) and the error a
failed sync raises (`WeightSyncError`). A bucket is a flat byte range of one pipeline stage's
HF-named tensors, concatenated in export order; an `Entry` says which bytes of which tensor
sit where in the bucket, so a tensor larger than a bucket spans several buckets. The metadata
reaches each engine through its API (`/update_weights_from_distributed` with
`load_format="megarl_bucket"` and a `bucket` field, or the same call in process) before the
bucket's bytes are broadcast on the update group, in pieces of at most `chunk_bytes` — the
way SGLang's `flattened_bucket` format announces names/dtypes/shapes before one broadcast.

Deliberately simple: byte-level copies (no dtype alignment rules), one checksum per bucket
(blake2b over its bytes, only in verify mode).
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import torch

LOAD_FORMAT = "megarl_bucket"
MiB = 1 << 20
# Tensors below this share broadcasts: about where a broadcast's fixed cost (~50-100 us over
# loopback gloo) outweighs copying the bytes in and out of a shared piece.
SMALL_TENSOR_BYTES = 1 * MiB


@dataclass(frozen=True)
class Entry:
    """Bytes [start, end) of tensor `name` live at bucket bytes [offset, offset + end - start)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    offset: int

    @property
    def tensor_nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass
class BucketMeta:
    """One bucket of one stage's part of weight version `version`."""

    version: str
    stage: int  # pipeline stage that produced it (one update group per stage)
    num_stages: int  # the version is complete once every stage sent its `last` bucket
    index: int
    last: bool
    nbytes: int
    chunk_bytes: int  # the consumer's piece size: one broadcast per piece
    entries: list[Entry] = field(default_factory=list)
    checksum: str | None = None  # verify mode: digest of the bucket's bytes
    direct: bool = False  # no dual buffer: write straight into the (paused) live weights

    def chunks(self) -> list[tuple[int, int]]:
        """Byte ranges of the broadcasts that carry this bucket, in order, each at most
        `chunk_bytes`. Pieces are cut at tensor boundaries, so most lie inside one tensor:
        the producer sends them from the tensor itself and the consumer receives them in
        place (no copy on either side). Tensors smaller than `chunk_bytes // 8` and
        `SMALL_TENSOR_BYTES` share pieces (copied on both sides), so a run of tiny tensors
        (norms, biases) is not one broadcast each."""
        step = max(1, self.chunk_bytes)
        small = min(step // 8, SMALL_TENSOR_BYTES)
        out, a = [], 0  # a: start of the open piece of small tensors
        for e in self.entries:
            s, n = e.offset, e.end - e.start
            if n < small or n == 0:
                if s + n - a > step:
                    out.append((a, s))
                    a = s
                continue
            if a < s:
                out.append((a, s))
            out += [(x, min(x + step, s + n)) for x in range(s, s + n, step)]
            a = s + n
        if a < self.nbytes:
            out.append((a, self.nbytes))
        return out

    def to_json(self) -> dict:
        d = asdict(self)
        d["entries"] = [[e.name, e.dtype, list(e.shape), e.start, e.end, e.offset]
                        for e in self.entries]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "BucketMeta":
        entries = [Entry(n, dt, tuple(int(x) for x in s), int(a), int(b), int(o))
                   for n, dt, s, a, b, o in d["entries"]]
        return cls(**{**d, "entries": entries})


@dataclass
class SyncConfig:
    """Sizes in MiB, as in `actor_rollout_ref.rollout.*`."""

    produce_bucket_mb: float = 512
    consume_bucket_mb: float = 128
    dual_buffer: bool = False
    verify: bool = False
    timeout_s: float = 120.0  # per bucket: metadata call + broadcast + every engine's answer

    def __post_init__(self):
        if self.consume_bucket_mb <= 0 or self.produce_bucket_mb <= 0:
            raise ValueError("bucket sizes must be positive")
        # A piece larger than the bucket would just be the bucket.
        self.consume_bucket_mb = min(self.consume_bucket_mb, self.produce_bucket_mb)

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.produce_bucket_mb * MiB))

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.consume_bucket_mb * MiB))

    @classmethod
    def from_rollout_config(cls, rollout, **overrides) -> "SyncConfig":
        return cls(produce_bucket_mb=rollout.param_update_preduce_bucket_size_mb,
                   consume_bucket_mb=rollout.param_update_consume_bucket_size_mb,
                   dual_buffer=rollout.enable_dual_buffer, **overrides)


class WeightSyncError(RuntimeError):
    """A sync failed; says which version, stage, bucket and engine."""

    def __init__(self, version: str, bucket: int | None, cause: str, *, stage: int = 0,
                 engine: str | None = None):
        self.version, self.bucket, self.stage, self.engine = version, bucket, stage, engine
        where = f"bucket {bucket}" if bucket is not None else "setup"
        who = f" engine {engine}:" if engine else ""
        super().__init__(f"weight sync of version {version} failed at stage {stage} {where}:"
                         f"{who} {cause}")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst[:] = src` for flat uint8 tensors of one length, as the transfer path copies.

    On CPU a plain single-threaded memcpy (numpy; releases the GIL): torch splits a large
    copy over its OpenMP threads, which stall at their barrier whenever a core is taken, and
    during a transfer the cores are taken by the transfer itself (48 MB in 4 MiB copies: 5 ms
    this way, 35-90 ms with torch's two threads on a busy 2-core box)."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        dst.detach().numpy()[...] = src.detach().numpy()
    else:
        dst.copy_(src)


class Digest:
    """Incremental checksum of uint8 tensors (device tensors are copied to host first), so a
    bucket hashed whole on the producer matches one hashed piece by piece on the consumer."""

    def __init__(self):
        self._h = hashlib.blake2b(digest_size=16)

    def update(self, data: torch.Tensor) -> "Digest":
        self._h.update(memoryview(data.detach().cpu().contiguous().numpy()))
        return self

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def digest(data: torch.Tensor) -> str:
    return Digest().update(data).hexdigest()
