"""How the driver reaches its worker processes: one interface, two implementations.

A *transport* places a worker (a plain per-rank object of cluster/actors.py) on a device of a
task group, calls its methods, and reports when one is lost. The worker groups
(cluster/group.py) are written once over this interface:

- `RayTransport` (cluster/placement.py): a Ray actor per worker, placed in the task group's
  placement group;
- `TorchrunTransport` (cluster/torchrun.py): the processes torchrun started, one per device,
  driven over the torchrun store; Ray is neither started nor imported.

A call is issued at once and returns the transport's own handle for it; `wait` blocks on
several (for set-up, outside the event loop's work) and `awaitable` lets the asyncio driver
overlap them.
"""
from __future__ import annotations

import abc
import os
from typing import Any, Awaitable

from megarl.utils.errors import ConfigError

from .topology import GroupPlan

class Transport(abc.ABC):
    """Spawn workers, call them, broadcast a call to many, and watch their health."""

    name: str

    @abc.abstractmethod
    def devices(self, plan: GroupPlan, device: str):
        """The devices of one task group (`.name`, `.num_devices`, `.gpu_ids(indices)`: the
        GPU ids a launched server is given, or None, `.remove()`)."""

    @abc.abstractmethod
    def spawn(self, kind: str, devices, index: int, share: float, tag: str, *args, **kwargs):
        """A new worker of `kind` (megatron, rollout or server: the per-rank classes of
        cluster/actors.py) on device `index` of `devices`, using `share` of it, built with
        `args`; `tag` names it among the workers on that device (a role, an engine)."""

    @abc.abstractmethod
    def call(self, worker, method: str, *args, **kwargs) -> Any:
        """Issue `worker.method(*args)` now; the returned handle is for `wait`/`awaitable`."""

    def broadcast(self, workers: list, method: str, *args, **kwargs) -> list:
        """The same call on every worker (one message, many receivers)."""
        return [self.call(w, method, *args, **kwargs) for w in workers]

    @abc.abstractmethod
    def wait(self, calls: list, timeout_s: float | None = None) -> list:
        """Block until every call has returned; their results in order (a failure raises)."""

    @abc.abstractmethod
    def awaitable(self, call) -> Awaitable:
        """The call as something the driver's event loop can await."""

    @abc.abstractmethod
    def stop(self, worker, timeout_s: float) -> None:
        """End one worker now (a failed engine before its replacement starts)."""

    @abc.abstractmethod
    def shutdown(self, workers: list, timeout_s: float) -> bool:
        """Ask each worker to shut down, then release them; False if one did not in time."""

    @abc.abstractmethod
    def is_lost(self, err: BaseException) -> bool:
        """Whether a call failed because its worker (its process or host) is gone."""

    def health(self):
        """A concurrent future that fails, naming the worker, as soon as one is lost even
        with no call to it in flight; None where losses show only through failed calls."""
        return None

    def threads(self, cfg, processes_per_device: int) -> int:
        """CPU threads for one worker process."""
        return thread_budget(cfg, processes_per_device)

    def close(self) -> None:
        """Release what the transport itself holds (after every group has shut down)."""


def thread_budget(cfg, processes_per_device: int) -> int:
    """CPU threads for one worker process: the machine's cores split over its processes."""
    t = cfg.trainer
    if t.device == "cuda":
        return 4
    per_node = max(1, t.n_gpus_per_node * processes_per_device)
    return max(1, (os.cpu_count() or 1) // per_node)


def make_transport(cfg) -> Transport:
    """The transport `trainer.launcher` names; only the chosen one's modules are imported,
    so torchrun runs where Ray is not installed."""
    launcher = cfg.trainer.launcher
    if launcher == "ray":
        from .placement import RayTransport

        return RayTransport(cfg)
    if launcher == "torchrun":
        from .torchrun import TorchrunTransport

        return TorchrunTransport()
    raise ConfigError(f"trainer.launcher: {launcher!r} is not one of ray, torchrun")
