"""Engine-side weight updates: validation, staging, atomic swap, and the update process group.

Owns how new weights enter an engine. An update is validated as a whole (every name known,
every shape right) and staged into a second buffer before any parameter is touched, so a
rejected update leaves the old weights intact and a good one swaps in at a single safe point
between decode steps (megarl.rollout.engine decides when). Which version the weights carry is
the engine's business; this module only moves tensors.

The update group is built exactly the way SGLang builds it (`init_custom_process_group`:
rendezvous `TCPStore` → `PrefixStore(group_name)` → torch's `_new_process_group_helper`, which
nests `PrefixStore(f"{group_name}/")` and `PrefixStore(f"{device}/")`), but from the public
constructors, so a trainer that can talk to SGLang can talk to the embedded engine and vice
versa. `new_update_group` serves both sides: rank 0 (the trainer) hosts the store;
`EngineRanks` is an engine's TP ranks in it.

It also owns stock SGLang's weight wire formats as a receiver sees them (read from the pinned
release's `weight_sync/tensor_bucket.py` and `utils/weight_checker.py`): the flattened bucket's
layout and checks, and the `/weights_checker` checksums. The trainer's side packs buckets in
megarl.weight_sync.buckets.
"""
from __future__ import annotations

import base64
import concurrent.futures
import datetime
import functools
import hashlib
import io
import logging
import math
import re
import socket
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.rollout.protocol import BadRequest
from megarl.utils.net import gloo_device

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
    "half": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}


def parse_dtype(name: str, field: str = "dtypes") -> torch.dtype:
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise BadRequest(field, f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


# -- stock SGLang's weight wire formats ---------------------------------------------------------
LOAD_FORMAT = "flattened_bucket"  # one uint8 broadcast of whole tensors back to back


def bucket_layout(names: list[str], dtypes: list[str], shapes: list[list[int]]
                  ) -> list[tuple[str, torch.dtype, tuple[int, ...], int, int]]:
    """(name, dtype, shape, start, end) byte ranges of a flattened bucket, checked the way
    stock SGLang checks them before it receives (`FlattenedTensorBucket.empty`): no negative
    dimension, every tensor aligned to its element size, not empty."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise BadRequest("names", f"names, dtypes and shapes differ in length "
                         f"({len(names)}, {len(dtypes)}, {len(shapes)})")
    out, at = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        dtype = parse_dtype(dt)
        if not isinstance(shape, (list, tuple)) or any(not isinstance(d, int) or d < 0
                                                       for d in shape):
            raise BadRequest("shapes", f"Negative dimension in received tensor {name}: {shape}")
        if at % dtype.itemsize:
            raise BadRequest("dtypes", f"Unaligned received tensor {name}: byte offset {at}, "
                             f"dtype {dt}")
        size = math.prod(shape) * dtype.itemsize  # exact: torch.Size.numel wraps at 64 bits
        out.append((name, dtype, tuple(shape), at, at + size))
        at += size
    if not out:
        raise BadRequest("names", "Cannot create empty tensor bucket")
    return out


def unpack_bucket(flat: torch.Tensor, layout) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor inside a received flat uint8 bucket (no copy)."""
    return [(name, flat[a:b].view(dtype).view(shape)) for name, dtype, shape, a, b in layout]


def tensor_checksum(t: torch.Tensor) -> str:
    """Stock SGLang's `/weights_checker` checksum of one tensor as computed on CPU
    (`tensor_hash`: sha256 of the raw bytes, first 8 bytes big-endian, 16 hex digits)."""
    h = hashlib.sha256(memoryview(byte_view(t.detach().cpu().contiguous()).numpy()))
    return f"{int.from_bytes(h.digest()[:8], 'big'):016x}"


def overall_checksum(checksums: dict[str, str]) -> str:
    """Stock SGLang's `per_gpu_checksum` over per-tensor checksums."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


# -- the update process group ------------------------------------------------------------------
def new_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                     group_name: str, backend: str = "gloo", timeout_s: float = 300.0
                     ) -> "UpdateGroup":
    """Join (rank > 0) or host (rank 0) a weight-update group.

    Blocks until all `world_size` ranks have joined, so the trainer must fire the engines'
    init requests before it calls this itself.
    """
    if backend not in ("gloo", "nccl"):
        raise BadRequest("backend", f"unsupported backend {backend!r}; expected gloo or nccl")
    if backend == "nccl" and not dist.is_nccl_available():
        # before the rendezvous: a rank that cannot build its side must not hold the others
        raise BadRequest("backend", "nccl: this torch build has no NCCL (a CPU build?); "
                         "use gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0),
                          timeout=timeout)
    device = "cuda" if backend == "nccl" else "cpu"
    # The three prefixes SGLang's init_custom_process_group ends up with (see module doc).
    prefixed = dist.PrefixStore(f"{device}/", dist.PrefixStore(
        f"{group_name}/", dist.PrefixStore(group_name, store)))
    if backend == "gloo":
        # Bound to the interface that reaches the rendezvous host, not to whatever the hostname
        # resolves to (often loopback on a cluster node: peers would be told 127.0.0.1).
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [gloo_device(master_address)]
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    else:
        # The same bound as gloo's: without options NCCL takes torch's default (10 minutes,
        # or 30 in some builds), which is how long a broadcast a peer never joins would hold
        # the trainer's communicator before the watchdog ends it. Not a high-priority stream:
        # weight traffic must not get ahead of training's own kernels.
        opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=False)
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    logger.info("joined weight-update group %r as rank %d of %d (%s, %s:%s)", group_name, rank,
                world_size, backend, master_address, master_port)
    return UpdateGroup(pg, store, group_name, rank, world_size, backend)


@dataclass
class UpdateGroup:
    pg: object
    store: object  # held so rank 0's rendezvous server lives as long as the group
    name: str
    rank: int
    world_size: int
    backend: str = "gloo"

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        self.pg.broadcast(tensor, root).wait()

    def broadcast_async(self, tensor: torch.Tensor, root: int = 0):
        """Post a broadcast; returns its work (`.wait()`). Posts are matched across ranks in
        the order each rank makes them; `tensor` must stay untouched until the wait."""
        return self.pg.broadcast(tensor, root)

    def close(self) -> None:
        """Tear down the group, then the store. Leaving both to interpreter exit can destroy a
        still-joinable C++ thread in an unlucky order ("terminate called...", SIGABRT). Not
        while an operation on it is pending: see EngineRanks.close, WeightProducer._rebuild."""
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()
        del pg
        self.store = None

    def abort(self) -> None:
        """End a broadcast that cannot complete (a peer refused it or is gone), now, then drop
        the group. Under NCCL only: `ProcessGroupNCCL.abort` aborts the communicator, which
        makes the pending kernel return, so the bound is the caller's deadline rather than
        the watchdog's (which by default tears the whole process down). Gloo has no such
        use: its pending wait ends at the group's own timeout, and tearing it down under that
        wait can stall the process, so a gloo group is closed once the wait has ended."""
        if self.backend != "nccl":
            raise ValueError(f"abort is for NCCL update groups; {self.name!r} is {self.backend}")
        pg, self.pg = self.pg, None
        if pg is not None:
            pg.abort()
        del pg
        self.store = None

    def __enter__(self) -> "UpdateGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_for_listener(host: str, port: int, timeout_s: float) -> None:
    """Poll until something accepts TCP connections at host:port, for up to `timeout_s`.

    The trainer hosts the rendezvous store only after it has fired the engines' init
    requests, so an engine waits for it; this wait is plain Python, bounded and quiet, where
    torch's TCPStore client retries inside C++ past its own timeout and logs every retry. A
    connection that is accepted and closed unused is ignored by the store."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, left))):
                return
        except OSError as e:
            if time.monotonic() + delay >= deadline:
                raise TimeoutError(f"nothing accepted a connection at {host}:{port} within "
                                   f"{timeout_s:g} s ({e})") from None
        time.sleep(delay)
        delay = min(2 * delay, 0.5)


def in_daemon_thread(fn) -> concurrent.futures.Future:
    """`fn()` on a fresh daemon thread. For gloo waits: one stuck until its group's timeout
    must hold up nothing queued behind it, nor block the process's exit."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        if not fut.set_running_or_notify_cancel():  # its waiter gave up before the start
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(e)

    threading.Thread(target=run, daemon=True, name="megarl-gloo-wait").start()
    return fut


class EngineRanks:
    """The update-group memberships of one engine: SGLang joins every TP rank r of an engine
    as `rank_offset + r`, and each of them receives every broadcast. The embedded engine runs
    one model, so its extra TP ranks receive into scratch buffers; they exist so that the
    group has the shape a stock TP engine gives it (and a wrong rank offset fails here)."""

    def __init__(self, groups: list[UpdateGroup]):
        self.groups = groups
        self._lock = threading.Lock()
        self._busy = 0  # receives in progress
        self._close_when_idle = False
        self._scratch_bufs: dict[int, torch.Tensor] = {}

    @classmethod
    def join(cls, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str, backend: str, tp_size: int, timeout_s: float = 300.0
             ) -> "EngineRanks":
        wait_for_listener(master_address, master_port, timeout_s)
        # Each join blocks until the whole group has formed: all TP ranks join at once. On
        # daemon threads, not a pool: a join whose peer accepts the connection but never
        # answers can wait past any timeout, and must not hold up the process's exit.
        futs = [in_daemon_thread(functools.partial(
                    new_update_group, master_address, master_port, rank_offset + r, world_size,
                    group_name, backend, timeout_s)) for r in range(tp_size)]
        concurrent.futures.wait(futs)
        failed = [f.exception() for f in futs if f.exception() is not None]
        if failed:  # leave no rank joined behind a failed one
            for f in futs:
                if f.exception() is None:
                    f.result().close()
            raise failed[0]
        return cls([f.result() for f in futs])

    def _scratch(self, rank: int, like: torch.Tensor) -> torch.Tensor:
        """Where extra TP rank `rank` receives: kept between calls for flattened buckets
        (uint8, the bulk of the bytes), fresh otherwise."""
        if like.dtype != torch.uint8:
            return torch.empty_like(like)
        buf = self._scratch_bufs.get(rank)
        if buf is None or buf.numel() < like.numel() or buf.device != like.device:
            buf = self._scratch_bufs[rank] = torch.empty(like.numel(), dtype=torch.uint8,
                                                         device=like.device)
        return buf[: like.numel()]

    @property
    def busy(self) -> int:
        return self._busy

    def receive(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Receive one broadcast per buffer, in order, on every TP rank; returns rank 0's."""
        with self._lock:
            self._busy += 1
        try:
            works = []
            for buf in buffers:
                for r, g in enumerate(self.groups):
                    works.append(g.broadcast_async(buf if r == 0 else self._scratch(r, buf), 0))
            for w in works:
                w.wait()
            # Under NCCL `wait()` only ordered this thread's stream after the receive: the
            # bytes are in once that stream has run to here, which is what the engine's
            # answer ("received") must mean. On CPU the waits above already blocked.
            if buffers and buffers[0].device.type == "cuda":
                torch.cuda.current_stream(buffers[0].device).synchronize()
            return buffers
        finally:
            with self._lock:
                self._busy -= 1
                close = self._close_when_idle and self._busy == 0
            if close:
                self._close()

    def close(self) -> None:
        """Leave the group. A receive still pending (the sender gave up mid-broadcast) ends
        only at the group's timeout, and tearing a gloo group down under it can stall the
        process: the group is then closed when that receive ends. Under NCCL the pending
        receive is ended now by aborting the communicator (else only the watchdog ends it,
        and with it the process)."""
        with self._lock:
            if self._busy and self.groups and self.groups[0].backend == "nccl":
                groups, self.groups = self.groups, []
            elif self._busy:
                self._close_when_idle = True
                return
            else:
                groups = None
        if groups is not None:
            for g in groups:
                g.abort()
            return
        self._close()

    def _close(self) -> None:
        for g in self.groups:
            g.close()


# -- serializing tensors for /update_weights_from_tensor --------------------------------------
def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """base64 `torch.save` of [(name, tensor)], loadable with `weights_only=True` (no pickle
    code execution on the receiving side)."""
    buf = io.BytesIO()
    torch.save([(n, t.detach().cpu().contiguous()) for n, t in named], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(data: str) -> list[tuple[str, torch.Tensor]]:
    try:
        obj = torch.load(io.BytesIO(base64.b64decode(data, validate=True)), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any decoding failure is the client's bad input
        raise BadRequest("serialized_named_tensors",
                         f"not a base64 torch.save of [(name, tensor)]: {e}") from None
    if not isinstance(obj, list) or not all(
            isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str)
            and isinstance(x[1], torch.Tensor) for x in obj):
        raise BadRequest("serialized_named_tensors", "expected a list of (name, tensor) pairs")
    return [(n, t) for n, t in obj]


# -- the model's side --------------------------------------------------------------------------
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.gate_up_proj$")


def expert_views(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint-named views of fused MoE expert tensors.

    transformers 5 holds a Qwen3-MoE layer's experts fused, `experts.gate_up_proj`
    [E, 2I, H] (each expert's gate rows, then its up rows) and `experts.down_proj` [E, H, I],
    while checkpoints, trainers and stock SGLang name them per expert
    (`experts.<e>.gate_proj.weight` ...). Each view shares the fused tensor's storage, so an
    update under the per-expert name lands in the fused tensor (by copy: `swap` sees the
    storage shared and never rebinds it)."""
    views = {}
    for name, fused in params.items():
        m = _FUSED_EXPERTS.match(name)
        down = params.get(f"{m.group(1)}.down_proj") if m else None
        if down is None or fused.dim() != 3 or down.dim() != 3:
            continue
        half = fused.shape[1] // 2
        for e in range(fused.shape[0]):
            pre = f"{m.group(1)}.{e}."
            views[pre + "gate_proj.weight"] = fused[e, :half]
            views[pre + "up_proj.weight"] = fused[e, half:]
            views[pre + "down_proj.weight"] = down[e]
    return views


class WeightStore:
    """The model's named tensors by HF name, and the stage-then-swap update path.

    `swap` makes staged tensors live by reference (`param.data = staged`) when nothing else can
    see the old storage: the tensor objects in `params` are the only way the model reaches its
    weights (true of the HF models the embedded engine runs: tied weights are one Parameter
    under two names). Tensors that share storage with another distinct tensor in `params` are
    swapped by copy, so such aliasing stays intact.
    """

    def __init__(self, model):
        self.model = model
        # remove_duplicate=False lists tied weights under both names (lm_head.weight and
        # embed_tokens.weight), as a trainer exporting HF names may send either.
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        for name, buf in model.named_buffers(remove_duplicate=False):
            if buf.is_floating_point() and "rotary" not in name:
                self.params.setdefault(name, buf)
        self.params.update(expert_views(self.params))
        owners: dict[int, set[int]] = {}
        for t in self.params.values():
            owners.setdefault(t.untyped_storage().data_ptr(), set()).add(id(t))
        self._aliased = {n for n, t in self.params.items()
                         if len(owners[t.untyped_storage().data_ptr()]) > 1}

    def check(self, names: list[str], shapes: list[list[int]] | list[torch.Size]) -> None:
        """Raise BadRequest naming the first unknown name or wrong shape."""
        for i, (name, shape) in enumerate(zip(names, shapes)):
            if name not in self.params:
                raise BadRequest("names", f"unknown parameter {name!r} (index {i})")
            want = tuple(self.params[name].shape)
            if tuple(shape) != want:
                raise BadRequest("shapes", f"{name}: shape {list(shape)} != model's {list(want)}")

    @torch.no_grad()
    def stage(self, named: list[tuple[str, torch.Tensor]],
              spare: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Validate everything, then copy into a staging dict (cast to the model's dtype),
        reusing `spare` tensors (taken out of it) where one of the right kind is there."""
        self.check([n for n, _ in named], [t.shape for _, t in named])
        spare = {} if spare is None else spare
        staged = {}
        for name, t in named:
            p, buf = self.params[name], spare.pop(name, None)
            if (buf is not None and buf.shape == p.shape and buf.dtype == p.dtype
                    and buf.device == p.device and buf.is_contiguous()):
                buf.copy_(t)
            else:
                buf = t.detach().to(device=p.device, dtype=p.dtype, copy=True)
            staged[name] = buf
        return staged

    @torch.no_grad()
    def load_live(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy straight into the live parameters (stock SGLang's load: call it between two
        decode steps). A failure half-way leaves the model partly updated, as there."""
        for name, t in named:
            self.params[name].copy_(t)

    @torch.no_grad()
    def swap(self, staged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Make staged tensors live; cannot fail after `stage`. Takes ownership of `staged`:
        each tensor becomes the parameter's storage when it can (same shape, dtype, device,
        contiguous, not a view, parameter not aliased), else is copied in. Returns, by name,
        the tensors that are no longer live (the displaced storage, or the copied-from staged
        tensor), for reuse as the next staging buffer."""
        out = {}
        for name, t in staged.items():
            p = self.params[name]
            if (name not in self._aliased and t._base is None and t.is_contiguous()
                    and p.data.is_contiguous() and t.shape == p.shape and t.dtype == p.dtype
                    and t.device == p.device):
                out[name], p.data = p.data, t
            else:
                p.copy_(t)
                out[name] = t
        return out

    def get(self, name: str) -> torch.Tensor:
        if name not in self.params:
            raise BadRequest("name", f"unknown parameter {name!r}")
        return self.params[name]
