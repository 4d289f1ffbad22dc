"""What travels between the trainer and the engines in a weight sync, and how syncs fail.

Owns the wire contract of one update, which is stock SGLang's (read from the pinned release,
`megarl.backends.sglang.SGLANG_VERSION`: `io_struct.UpdateWeightsFromDistributedReqInput`,
`weight_sync/tensor_bucket.py`):

- a bucket is a list of WHOLE tensors of ONE dtype; it travels as one
  `/update_weights_from_distributed` call (`names`, `dtypes`, `shapes`,
  `load_format="flattened_bucket"`, `flush_cache=False`) followed by ONE broadcast, from rank 0
  of the update group, of the tensors' bytes packed back to back. One dtype per bucket keeps
  every tensor's byte offset aligned to its element size, which the receiver checks (no
  padding exists in the format). A tensor larger than a bucket travels alone;
- the version is set by `weight_version` on the last update call of the version (SGLang records
  it after that call has loaded), or by `/update_weight_version`;
- every call sits inside `/begin_weight_update` ... `/end_weight_update` (0.5.21+).

Versions are integers everywhere in megarl; `wire_version` turns one into SGLang's string at the
HTTP edge. `update_group_ranks` gives each engine's `rank_offset`: SGLang joins engine TP rank r
as `rank_offset + r`, so offsets count every engine's TP ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.rollout.weights import LOAD_FORMAT, dtype_name

MiB = 1 << 20


def wire_version(version: int) -> str:
    """SGLang's weight_version string for megarl's integer version."""
    return str(int(version))


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "TensorSpec":
        return cls(name, dtype_name(t.dtype), tuple(int(d) for d in t.shape))


@dataclass
class BucketMeta:
    """One flattened bucket of one pipeline stage's part of a weight version."""

    version: int
    stage: int
    index: int
    specs: list[TensorSpec] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def request(self, group_name: str, weight_version: int | None = None) -> dict:
        """The `/update_weights_from_distributed` body for this bucket: only fields stock
        SGLang reads. `weight_version` goes on the version's last call only."""
        body = {"names": [s.name for s in self.specs], "dtypes": [s.dtype for s in self.specs],
                "shapes": [list(s.shape) for s in self.specs], "group_name": group_name,
                "flush_cache": False, "load_format": LOAD_FORMAT}
        if weight_version is not None:
            body["weight_version"] = wire_version(weight_version)
        return body


def update_group_ranks(tp_sizes: list[int]) -> tuple[list[int], int]:
    """(rank_offset per engine, world size): the trainer is rank 0, engine i's TP rank r is
    `offset[i] + r`."""
    offsets, nxt = [], 1
    for tp in tp_sizes:
        if int(tp) < 1:
            raise ValueError(f"engine TP size must be >= 1, got {tp}")
        offsets.append(nxt)
        nxt += int(tp)
    return offsets, nxt


@dataclass
class SyncConfig:
    """Sizes in MiB, as in `actor_rollout_ref.rollout.*` (checked there: consume <= produce).

    `produce_bucket_mb`: how much of a stage the trainer gathers (TP all-gather, export) and
    holds before sending. `consume_bucket_mb`: the largest flattened bucket on the wire, i.e.
    the largest receive buffer an engine allocates (a single larger tensor goes alone)."""

    produce_bucket_mb: float = 512
    consume_bucket_mb: float = 128
    dual_buffer: bool = False
    verify: bool = False
    timeout_s: float = 120.0  # per bucket, the floor: update call + broadcast + answers
    backend: str | None = None  # the update group's; None: nccl where CUDA is, else gloo
    min_bandwidth_mbps: float = 50.0
    engines_replaced: bool = False
    """megarl replaces dead engines (it launched them, `engine_max_restarts` > 0) and sends a
    replacement the newest version out of band: a version that finds every engine gone is then
    published all the same (the trainer keeps it), not a failed sync."""
    """MB/s a bucket's transfer may not fall below: a bucket of n bytes waits at most
    `bucket_timeout_s(n)`. Stock SGLang gives its side of the group torch's default (30
    minutes under NCCL) and no field to change it, so this bound is the trainer's: past it
    the engines that have not answered are failed and the group is built anew."""

    def __post_init__(self):
        if self.consume_bucket_mb <= 0 or self.produce_bucket_mb <= 0:
            raise ValueError("bucket sizes must be positive")
        if self.min_bandwidth_mbps <= 0 or self.timeout_s <= 0:
            raise ValueError("min_bandwidth_mbps and timeout_s must be positive")

    def bucket_timeout_s(self, nbytes: int) -> float:
        """The longest one bucket of `nbytes` may take end to end (every wait of a sync is
        bounded by this or by `timeout_s` for calls that move no weights)."""
        return self.timeout_s + nbytes / (self.min_bandwidth_mbps * 1e6)

    @property
    def produce_bytes(self) -> int:
        return max(1, int(self.produce_bucket_mb * MiB))

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.consume_bucket_mb * MiB))

    @classmethod
    def from_rollout_config(cls, rollout, **overrides) -> "SyncConfig":
        return cls(produce_bucket_mb=rollout.param_update_preduce_bucket_size_mb,
                   consume_bucket_mb=rollout.param_update_consume_bucket_size_mb,
                   dual_buffer=rollout.enable_dual_buffer,
                   backend=None if rollout.get("update_group_backend") in (None, "auto")
                   else rollout.update_group_backend,
                   engines_replaced=(rollout.engine_max_restarts > 0
                                     and not (rollout.name == "sglang"
                                              and rollout.get("server_urls"))),
                   **{"verify": rollout.verify_weight_sync,
                      "timeout_s": float(rollout.weight_sync_timeout_s),
                      "min_bandwidth_mbps": float(rollout.weight_sync_min_bandwidth_mbps),
                      **overrides})


class WeightSyncError(RuntimeError):
    """A sync failed; says which version, stage, bucket and engine."""

    def __init__(self, version, bucket: int | None, cause: str, *, stage: int = 0,
                 engine: str | None = None, elsewhere: bool = False):
        self.version, self.bucket, self.stage, self.engine = version, bucket, stage, engine
        self.cause = cause
        # Raised by a rank that only learnt another rank failed: the other's error says why.
        self.elsewhere = elsewhere
        where = f"bucket {bucket}" if bucket is not None else "setup"
        who = f" engine {engine}:" if engine else ""
        super().__init__(f"weight sync of version {version} failed at stage {stage} {where}:"
                         f"{who} {cause}")

    def __reduce__(self):
        # Crosses process boundaries (Ray, the torchrun control channel): the default would
        # call __init__ with the message alone.
        return (_sync_error, (self.version, self.bucket, self.cause, self.stage, self.engine,
                              self.elsewhere))


class NoEngineToSend(WeightSyncError):
    """Every engine of the update group failed; nothing is left to send the version to."""


def _sync_error(version, bucket, cause, stage, engine, elsewhere) -> WeightSyncError:
    return WeightSyncError(version, bucket, cause, stage=stage, engine=engine,
                           elsewhere=elsewhere)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst[:] = src` for flat uint8 tensors of one length.

    On CPU a plain single-threaded memcpy (numpy; releases the GIL): torch splits a large
    copy over its OpenMP threads, which stall at their barrier whenever a core is taken, and
    during a transfer the cores are taken by the transfer itself."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        dst.detach().numpy()[...] = src.detach().numpy()
    else:
        dst.copy_(src)
