"""The Ray transport: one placement group per task group, a Ray actor per worker.

A device is a GPU on clusters and a CPU "slot" on a CPU machine (one worker process with a
thread budget). Tasks of one group share its devices: several models (the actor, the frozen
reference) can each run one process per device, each asking for a share of the device.
"""
from __future__ import annotations

import logging
import os

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.rollout import auth as rollout_auth

from .actors import MegatronRank, RolloutRank, ServerRank
from .topology import GroupPlan
from .transport import Transport

logger = logging.getLogger(__name__)


def init_ray(cfg) -> None:
    """Start (or join) Ray. On one CPU machine the logical CPU count is the device count."""
    if ray.is_initialized():
        return
    t = cfg.trainer
    kw = dict(include_dashboard=False, ignore_reinit_error=True, logging_level=logging.WARNING,
              log_to_driver=True)
    # the run's rollout token reaches the workers with their environment, not in any call
    key = rollout_auth.api_key()
    token = {rollout_auth.API_KEY_ENV: key} if key else {}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": token}, **kw)
        return
    if t.device == "cpu":
        kw["num_cpus"] = t.nnodes * t.n_gpus_per_node
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(),
                                                       os.environ.get("PYTHONPATH")])),
           **token}
    # megarl runs only actors, each in a worker process of its own: the idle workers a new
    # Ray prestarts for tasks (one per CPU, ~0.3 s of CPU each) would never be used
    ray.init(runtime_env={"env_vars": env}, _system_config={"prestart_worker_first_driver": False},
             **kw)


class DeviceGroup:
    """The devices of one task group, reserved as a Ray placement group."""

    def __init__(self, plan: GroupPlan, device: str, timeout_s: float = 600.0):
        self.plan = plan
        self.device = device
        bundle = {"GPU": 1, "CPU": 1} if device == "cuda" else {"CPU": 1}
        # PACK fills as few nodes as possible: a group that is a fraction of the nodes gets
        # whole nodes of its own (the validated ratios make the counts whole).
        self.pg = placement_group([dict(bundle) for _ in range(plan.num_devices)],
                                  strategy="PACK", name=f"megarl-{plan.name}")
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise TimeoutError(
                f"group {plan.name}: {plan.num_devices} {device} device(s) not free within "
                f"trainer.placement_timeout_s = {timeout_s:g} s (Ray's cluster: "
                f"{ray.available_resources()})") from None
        logger.info("group %s: %d %s device(s) reserved", plan.name, plan.num_devices, device)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def num_devices(self) -> int:
        return self.plan.num_devices

    def options(self, index: int, share: float) -> dict:
        """Ray actor options for a process on device `index` using `share` of it."""
        opts = {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=index), "num_cpus": share}
        if self.device == "cuda":
            opts["num_gpus"] = share
        return opts

    def gpu_ids(self, indices, timeout_s: float = 120.0) -> list[str] | None:
        """Ray's GPU ids of devices `indices` (each bundle's GPU, as Ray names it), in that
        order; None on CPU. A launched server spans several bundles while its actor holds
        one, so it is told the others' ids rather than assuming they follow its own. Ask
        before the server's actor takes its share of the first bundle: each probe asks for
        a sliver of its bundle's GPU."""
        if self.device != "cuda":
            return None
        refs = [_gpu_ids.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=i)).remote() for i in indices]
        return [i for ids in ray.get(refs, timeout=timeout_s) for i in ids]

    def remove(self) -> None:
        remove_placement_group(self.pg)


@ray.remote(num_cpus=0, num_gpus=0.001)
def _gpu_ids() -> list[str]:
    return [str(i) for i in ray.get_gpu_ids()]


# The Ray shells of the per-rank objects; their names are the worker processes' titles
# (`ray::MegatronActor`), which is how a person (and the multi-host tests) finds them.
@ray.remote
class MegatronActor(MegatronRank):
    """The Ray shell of `MegatronRank`."""


@ray.remote
class RolloutActor(RolloutRank):
    """The Ray shell of `RolloutRank`."""


@ray.remote
class ServerActor(ServerRank):
    """The Ray shell of `ServerRank`."""


_SHELLS = {"megatron": MegatronActor, "rollout": RolloutActor, "server": ServerActor}


class RayTransport(Transport):
    """Workers as Ray actors in their task group's placement group."""

    name = "ray"

    def __init__(self, cfg):
        init_ray(cfg)
        self.placement_timeout_s = float(cfg.trainer.placement_timeout_s)

    def devices(self, plan: GroupPlan, device: str) -> DeviceGroup:
        return DeviceGroup(plan, device, self.placement_timeout_s)

    def spawn(self, kind, devices, index, share, tag, *args, **kwargs):
        return _SHELLS[kind].options(**devices.options(index, share)).remote(*args, **kwargs)

    def call(self, worker, method, *args, **kwargs):
        return getattr(worker, method).remote(*args, **kwargs)

    def wait(self, calls, timeout_s=None):
        return ray.get(list(calls), timeout=timeout_s)

    def awaitable(self, call):
        return call  # an ObjectRef is awaitable

    def stop(self, worker, timeout_s):
        ray.kill(worker, no_restart=True)

    def shutdown(self, workers, timeout_s):
        try:
            self.wait(self.broadcast(workers, "shutdown"), timeout_s)
            clean = True
        except Exception:  # noqa: BLE001 - shutting down anyway
            clean = False
        for w in workers:
            ray.kill(w)
        return clean

    def is_lost(self, err):
        return isinstance(err, (ray.exceptions.RayActorError,
                                ray.exceptions.ActorUnavailableError))

    def close(self):
        ray.shutdown()
