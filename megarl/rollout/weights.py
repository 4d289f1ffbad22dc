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
versa. `new_update_group` serves both sides: rank 0 (the trainer) hosts the store.
"""
from __future__ import annotations

import base64
import datetime
import io
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.rollout.protocol import BadRequest

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


# -- the update process group ------------------------------------------------------------------
def new_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                     group_name: str, backend: str = "gloo", timeout_s: float = 300.0
                     ) -> "UpdateGroup":
    """Join (rank > 0) or host (rank 0) a weight-update group.

    Blocks until all `world_size` ranks have joined, so the trainer must fire the engines'
    init requests before it calls this itself.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0),
                          timeout=timeout)
    device = "cuda" if backend == "nccl" else "cpu"
    # The three prefixes SGLang's init_custom_process_group ends up with (see module doc).
    prefixed = dist.PrefixStore(f"{device}/", dist.PrefixStore(
        f"{group_name}/", dist.PrefixStore(group_name, store)))
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        raise BadRequest("backend", f"unsupported backend {backend!r}; expected gloo or nccl")
    logger.info("joined weight-update group %r as rank %d of %d (%s, %s:%s)", group_name, rank,
                world_size, backend, master_address, master_port)
    return UpdateGroup(pg, store, group_name, rank, world_size)


@dataclass
class UpdateGroup:
    pg: object
    store: object  # held so rank 0's rendezvous server lives as long as the group
    name: str
    rank: int
    world_size: int

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        self.pg.broadcast(tensor, root).wait()

    def broadcast_async(self, tensor: torch.Tensor, root: int = 0):
        """Post a broadcast; returns its work (`.wait()`). Posts are matched across ranks in
        the order each rank makes them; `tensor` must stay untouched until the wait."""
        return self.pg.broadcast(tensor, root)

    def close(self) -> None:
        """Tear down the group, then the store. Leaving both to interpreter exit can destroy a
        still-joinable C++ thread in an unlucky order ("terminate called...", SIGABRT)."""
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()
        del pg
        self.store = None


def broadcast_tensors(group: UpdateGroup, tensors: list[torch.Tensor], root: int = 0) -> None:
    """One broadcast per tensor, in order (SGLang's receive loop does the same)."""
    for t in tensors:
        group.broadcast(t, root)


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

    def stage(self, named: list[tuple[str, torch.Tensor]],
              into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Validate everything, then copy into a staging dict (cast to the model's dtype)."""
        self.check([n for n, _ in named], [t.shape for _, t in named])
        staged = {} if into is None else into
        for name, t in named:
            p = self.params[name]
            staged[name] = t.detach().to(device=p.device, dtype=p.dtype, copy=True)
        return staged

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

    def receive(self, group: UpdateGroup, names: list[str], dtypes: list[str], shapes: list[list[int]],
                device: torch.device) -> dict[str, torch.Tensor]:
        """Receive one broadcast per tensor, then validate; nothing is applied here.

        Every declared tensor is received even when the update will be rejected: the sender is
        already broadcasting, and skipping receives would desynchronize the group.
        """
        if not (len(names) == len(dtypes) == len(shapes)):
            raise BadRequest("names", f"names, dtypes and shapes differ in length "
                             f"({len(names)}, {len(dtypes)}, {len(shapes)})")
        torch_dtypes = [parse_dtype(d) for d in dtypes]
        received = []
        for name, dt, shape in zip(names, torch_dtypes, shapes):
            buf = torch.empty(tuple(shape), dtype=dt, device=device)
            group.broadcast(buf, 0)
            received.append((name, buf))
        return self.stage(received)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.params:
            raise BadRequest("name", f"unknown parameter {name!r}")
        return self.params[name]
