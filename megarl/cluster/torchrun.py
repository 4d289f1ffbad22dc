"""torchrun mode: every device is a process that torchrun started; no Ray.

`launch/torchrun.sh` starts `megarl train` once per device on every node. All processes
compute the same group plan (cluster/topology.py); global rank r *is* device r (node-major:
rank = node_rank × nproc_per_node + local_rank), so each task group owns the rank range of its
devices. Global rank 0 runs the unchanged driver; every other rank runs `serve`, a command loop
that builds and calls the same per-rank objects the Ray actors wrap (`MegatronRank`,
`RolloutRank`).

The control plane is the TCPStore that torchrun's agents already host (MASTER_ADDR:MASTER_PORT):
rank 0 writes `cmd/<rank>/<seq>` (pickled), the rank executes it and writes `res/<rank>/<seq>`.
Commands to one rank run in order, one at a time, like calls on a Ray actor; different ranks
run concurrently. Nothing here touches the default process group of the torchrun world: an
actor rank's default group must be its *model's* world (Megatron's parallel_state assumes so),
which `MegatronRank.setup` creates on its own address and port, exactly as under Ray.

Deliberately left out: fractional device shares (all models placed on a device live in one
process; an actor and a reference model on the same ranks share its parallel state and so need
the same TP×PP), restarting failed ranks, and Ray's placement groups. Batches travel through
the store, which suits control-sized data; weights travel on the weight-sync group as usual.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import datetime
import logging
import os
import pickle
import sys
import threading
import time
import traceback

from megarl.utils.errors import ConfigError
from megarl.utils.net import route_address

from .actors import MegatronRank, RolloutRank, ServerRank
from .group import MegatronGroup, engine_links
from .placement import thread_budget

logger = logging.getLogger(__name__)

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_CONTROL: "Control | None" = None   # this process's link to the others, set by `main`
# A rank whose heartbeat has not moved for this long is taken for dead: rank 0 fails the calls
# waiting on it, and the other ranks leave when rank 0 goes quiet (no rank hangs for ever).
HEARTBEAT_ENV = "MEGARL_TORCHRUN_HEARTBEAT_S"


class RemoteError(RuntimeError):
    """A command failed on another rank; the message carries that rank's traceback."""


def _threads(cfg) -> int:
    """Threads per process: every model on a device shares its one process. OMP_NUM_THREADS,
    when set (torchrun sets 1 for several processes per node), wins over the core split."""
    env = os.environ.get("OMP_NUM_THREADS")
    return int(env) if env else thread_budget(cfg, 1)


# ------------------------------------------------------------------ per-rank objects
class _Megatron(MegatronRank):
    def rendezvous(self, single_node: bool) -> tuple[str, int]:
        """This rank's node address (not Ray's idea of it) and a free port."""
        from megarl.utils.launch import free_port

        return _control().node_ip, free_port()


class _Server(ServerRank):
    def __init__(self, cfg_yaml: str, index: int, cuda: bool, log_dir: str):
        base = int(os.environ.get("LOCAL_RANK", 0)) if cuda else None
        super().__init__(cfg_yaml, index, _control().node_ip, base, log_dir)


class _Rollout(RolloutRank):
    def __init__(self, model_path: str, threads: int, seed: int, context_length: int):
        # Bind the node's address: the driver may be on another node.
        super().__init__(model_path, threads, seed, context_length, host=_control().node_ip)


_KINDS = {"megatron": _Megatron, "rollout": _Rollout, "server": _Server}


def _execute(objects: dict, msg: tuple):
    """Run one command against this rank's objects: create one, or call a method on one."""
    name, method, args, kwargs = msg
    if method == "__init__":
        objects[name] = _KINDS[args[0]](*args[1:], **kwargs)
        return None
    return getattr(objects[name], method)(*args, **kwargs)


# ------------------------------------------------------------------ control plane
class Control:
    """One process's view of the torchrun world: its rank, the store, and (on rank 0) the
    calls in flight to other ranks."""

    def __init__(self, cfg):
        missing = [k for k in _ENV if k not in os.environ]
        if missing:
            raise ConfigError(f"trainer.launcher=torchrun: {', '.join(missing)} not set; start "
                              "`megarl train` with launch/torchrun.sh (or torchrun)")
        t = cfg.trainer
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if self.world != t.nnodes * t.n_gpus_per_node:
            raise ConfigError(
                f"trainer.nnodes × trainer.n_gpus_per_node = {t.nnodes} × {t.n_gpus_per_node} "
                f"but torchrun started WORLD_SIZE={self.world} processes (one per device)")
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is not None and int(local) != t.n_gpus_per_node:
            raise ConfigError(f"trainer.n_gpus_per_node={t.n_gpus_per_node} but torchrun "
                              f"started {local} processes on this node (--nproc-per-node)")
        self.master = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # With the agent's store, torchrun would make *every* env:// init_process_group a
        # client of that store; the model worlds host their own stores, so turn it off here.
        agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None) == "True"
        self._host_store = not agent_store and self.rank == 0
        self._prefix = "megarl/{}/{}/".format(os.environ.get("TORCHELASTIC_RUN_ID", "run"),
                                              os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.store = self._connect(self._host_store)
        self.node_ip = route_address(self.master[0])
        self.store.set(f"node/{self.rank}", self.node_ip)  # for messages that name a host
        self._hosts: dict[int, str] = {}
        self.objects: dict = {}
        # rank 0 only: its own share of every call runs on one thread, in call order.
        self._local = cf.ThreadPoolExecutor(1, thread_name_prefix="megarl-rank0")
        self._seq = {r: 0 for r in range(self.world)}
        self._pending: dict[str, tuple[cf.Future, str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._collector = None
        self.heartbeat_s = float(os.environ.get(HEARTBEAT_ENV, 60))
        self._seen: dict[int, tuple[int, float]] = {}
        self.lost: cf.Future = cf.Future()
        """Rank 0: fails with the first rank whose heartbeat stops, whether or not a call to
        it is in flight (a rank serving an engine is reached over HTTP and the weight sync's
        collectives, not through calls); the driver stops the run on it."""
        self._dead: set[int] = set()
        threading.Thread(target=self._beat, daemon=True, name="megarl-heartbeat").start()

    def _connect(self, host: bool = False):
        """A store client. Every blocking user gets its own: a TCPStore client serialises its
        operations, so a waiter would otherwise hold up every other caller."""
        import torch.distributed as dist

        store = dist.TCPStore(self.master[0], self.master[1], is_master=host,
                              timeout=datetime.timedelta(seconds=600))
        return dist.PrefixStore(self._prefix, store)

    def _beat(self) -> None:
        try:
            store = self._connect()
            while not self._stop.wait(self.heartbeat_s / 6):
                store.add(f"beat/{self.rank}", 1)
        except Exception as err:  # noqa: BLE001 - the store is gone: the run is over anyway
            logger.debug("rank %d: heartbeat stopped: %s", self.rank, err)

    def host_of(self, rank: int) -> str:
        """The address `rank` published for its node ("?" if it never did)."""
        if rank not in self._hosts:
            key = f"node/{rank}"
            try:
                self._hosts[rank] = (self.store.get(key).decode()
                                     if self.store.check([key]) else "?")
            except Exception:  # noqa: BLE001 - only for a message
                return "?"
        return self._hosts[rank]

    def _silent(self, store, rank: int) -> bool:
        """Whether `rank`'s heartbeat has stood still for `heartbeat_s` (on this clock)."""
        count, now = store.add(f"beat/{rank}", 0), time.monotonic()
        seen = self._seen.get(rank)
        if seen is None or seen[0] != count:
            self._seen[rank] = (count, now)
            return False
        return now - seen[1] > self.heartbeat_s

    # ---------------------------------------------------------------- rank 0: calling
    def call(self, rank: int, name: str, method: str, *args, **kwargs) -> cf.Future:
        """Run `objects[name].method(*args)` on `rank`; the future holds its result."""
        msg = (name, method, args, kwargs)
        if rank == self.rank:
            return self._local.submit(_execute, self.objects, msg)
        if rank in self._dead:
            fut = cf.Future()
            fut.set_exception(RemoteError(f"rank {rank}: {name}.{method}: the rank (host "
                                          f"{self.host_of(rank)}) is gone"))
            return fut
        seq = self._seq[rank]
        self._seq[rank] += 1
        fut: cf.Future = cf.Future()
        with self._lock:
            self._pending[f"res/{rank}/{seq}"] = (fut, f"rank {rank}: {name}.{method}")
        self.store.set(f"cmd/{rank}/{seq}", pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
        if self._collector is None:
            self._collector = threading.Thread(target=self._collect, daemon=True,
                                               name="megarl-results")
            self._collector.start()
        return fut

    def _collect(self) -> None:
        """Hand results back to their futures as the ranks write them."""
        store = self._connect()
        checked, nap = time.monotonic(), 0.001
        while not self._stop.is_set():
            with self._lock:
                keys = list(self._pending)
            if time.monotonic() - checked > 1.0:
                checked = time.monotonic()
                self._fail_silent(store, keys)
                continue
            got = False
            for key in keys:
                if not store.check([key]):
                    continue
                status, value = pickle.loads(store.get(key))
                store.delete_key(key)
                with self._lock:
                    fut, what = self._pending.pop(key)
                if status == "ok":
                    fut.set_result(value)
                else:
                    fut.set_exception(RemoteError(f"{what} failed:\n{value}"))
                got = True
            nap = 0.001 if got else min(0.02, nap * 1.5)
            time.sleep(nap)

    def _fail_silent(self, store, keys: list[str]) -> None:
        for rank in set(range(self.world)) - {self.rank} - self._dead:
            if not self._silent(store, rank):
                continue
            self._dead.add(rank)
            with self._lock:
                lost = [k for k in self._pending if int(k.split("/")[1]) == rank]
                futs = [self._pending.pop(k) for k in lost]
            gone = (f"rank {rank} on host {self.host_of(rank)} has had no heartbeat for "
                    f"{self.heartbeat_s:.0f} s")
            logger.error("%s (host down, cut off or killed); failing its calls: %s", gone,
                         ", ".join(what.split(": ", 1)[1] for _, what in futs) or "none")
            for fut, what in futs:
                fut.set_exception(RemoteError(f"{what}: {gone}"))
            if not self.lost.done():
                self.lost.set_exception(RemoteError(f"{gone} (host down, cut off or killed)"))

    def release(self, timeout_s: float = 120.0) -> None:
        """Tell every other rank to leave its loop, and wait until each has."""
        acks = [self.call(r, "", "__exit__") for r in range(self.world) if r != self.rank]
        done, late = cf.wait(acks, timeout=timeout_s)
        if late:
            logger.warning("%d rank(s) did not acknowledge the end of the run", len(late))
        self._stop.set()
        self._local.shutdown(wait=False)

    # ---------------------------------------------------------------- other ranks: serving
    def serve(self) -> None:
        """Execute rank 0's commands in order until it says the run is over."""
        seq = 0
        logger.info("rank %d/%d serving (node %s)", self.rank, self.world, self.node_ip)
        while True:
            key = f"cmd/{self.rank}/{seq}"
            # Poll rather than block in `wait`, so a rank 0 that vanished is noticed (and
            # c10d does not log a socket timeout on every quiet stretch).
            nap, checked = 0.001, time.monotonic()
            while not self.store.check([key]):
                time.sleep(nap)
                nap = min(0.05, nap * 1.5)
                if time.monotonic() - checked > 1.0:
                    checked = time.monotonic()
                    if self._silent(self.store, 0):
                        raise RuntimeError(f"rank {self.rank}: rank 0 (the driver) has had no "
                                           f"heartbeat for {self.heartbeat_s:.0f} s; leaving")
            msg = pickle.loads(self.store.get(key))
            self.store.delete_key(key)
            if msg[1] == "__exit__":
                self.store.set(f"res/{self.rank}/{seq}", pickle.dumps(("ok", None)))
                break
            try:
                out = ("ok", _execute(self.objects, msg))
            except Exception:  # noqa: BLE001 - the failure belongs to rank 0's caller
                logger.exception("rank %d: %s.%s failed", self.rank, msg[0], msg[1])
                out = ("error", traceback.format_exc())
            self.store.set(f"res/{self.rank}/{seq}", pickle.dumps(out, pickle.HIGHEST_PROTOCOL))
            seq += 1
        self._stop.set()
        logger.info("rank %d: run over", self.rank)


def _control() -> Control:
    if _CONTROL is None:
        raise ConfigError("trainer.launcher=torchrun: this process was not started through "
                          "`megarl train` under torchrun (see launch/torchrun.sh)")
    return _CONTROL


def _leave(code: int) -> None:
    """Exit now, without joining threads that may be blocked on a host that is gone."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(cfg, run_driver) -> int:
    """`megarl train` under torchrun: rank 0 runs `run_driver()`, the others serve it."""
    global _CONTROL
    _CONTROL = ctl = Control(cfg)
    if ctl.rank != 0:
        try:
            ctl.serve()
        except Exception:
            # rank 0 is gone or cannot be reached: nothing will ever call this rank again, and
            # its servers' threads must not keep it alive
            logger.exception("rank %d on host %s: lost the driver (rank 0 at %s:%d); leaving",
                             ctl.rank, ctl.node_ip, *ctl.master)
            _leave(1)
        return 0
    try:
        run_driver()
    except ConfigError:  # said in one line by the command line; nothing is stuck yet
        ctl.release()
        raise
    except Exception:
        # The run failed. Threads still blocked on a host that is gone (a weight delivery,
        # an engine call) would hold this process's exit for their whole timeouts: report,
        # let the other ranks go, and leave now. The servers this rank started die with it
        # (PR_SET_PDEATHSIG); torchrun sees the failure in the exit status.
        logger.exception("rank 0: the run failed")
        ctl.release(timeout_s=10.0)
        _leave(1)
    ctl.release()
    return 0


# ------------------------------------------------------------------ group handles
class _Method:
    def __init__(self, handle: "_Handle", method: str):
        self.handle, self.method = handle, method

    def future(self, *args, **kwargs) -> cf.Future:
        h = self.handle
        return h.ctl.call(h.rank, h.name, self.method, *args, **kwargs)

    def remote(self, *args, **kwargs):
        """Like a Ray actor method: the call is issued now, the result is awaitable."""
        return asyncio.wrap_future(self.future(*args, **kwargs))


class _Handle:
    """One object on one rank, called as `handle.method.remote(...)` like a Ray actor, so
    `MegatronGroup`'s sharding and gathering run unchanged on top of it."""

    def __init__(self, ctl: Control, rank: int, name: str, kind: str, *args):
        self.ctl, self.rank, self.name = ctl, rank, name
        self.ready = ctl.call(rank, name, "__init__", kind, *args)

    def __getattr__(self, method: str) -> _Method:
        return _Method(self, method)


class RankGroup:
    """The ranks of one task group: torchrun mode's stand-in for a Ray `DeviceGroup`."""

    def __init__(self, plan, device: str):
        self.plan, self.device = plan, device

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def num_devices(self) -> int:
        return self.plan.num_devices

    @property
    def ranks(self) -> list[int]:
        return list(self.plan.devices)

    def remove(self) -> None:
        pass  # nothing reserved: torchrun owns the processes


def no_ray(cfg) -> None:
    """torchrun mode's `init_ray`: the processes already exist."""


class TorchrunMegatronGroup(MegatronGroup):
    """`MegatronGroup` over torchrun ranks; the same async interface for the driver."""

    def __init__(self, devices: RankGroup, cfg, role: str, share: float = 1.0,
                 processes_per_device: int = 1):
        ctl = _control()
        arr = cfg.actor_rollout_ref
        if role in ("ref", "critic") and "actor-train" in devices.plan.tasks:
            a = arr.actor.megatron
            r = arr.ref.megatron if role == "ref" else cfg.critic.megatron
            if (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) != \
                    (r.tensor_model_parallel_size, r.pipeline_model_parallel_size):
                key = "actor_rollout_ref.ref" if role == "ref" else "critic"
                raise ConfigError(
                    f"{key}.megatron: with trainer.launcher=torchrun a {role} model on the "
                    "actor's devices shares its processes, so it needs the actor's "
                    "tensor/pipeline parallel sizes (or its own task group)")
        from omegaconf import OmegaConf

        self.role, self.ctl = role, ctl
        n, threads = devices.num_devices, _threads(cfg)
        self.actors = [_Handle(ctl, r, role, "megatron", i, n, threads)
                       for i, r in enumerate(devices.ranks)]
        self.single_node = cfg.trainer.nnodes == 1
        addr, port = self.actors[0].rendezvous.future(self.single_node).result()
        yaml = OmegaConf.to_yaml(cfg, resolve=True)
        futs = [a.setup.future(yaml, role, addr, port) for a in self.actors]
        self.ranks = [f.result() for f in futs]
        self.dp = self.ranks[0]["dp_size"]
        self.leaders = {}
        for a, r in zip(self.actors, self.ranks):
            self.leaders.setdefault(r["dp_rank"], a)
        logger.info("%s model: ranks %s (group %s), DP=%d", role, devices.ranks, devices.name,
                    self.dp)

    async def init_weight_sync(self, engines: list[dict]) -> None:
        addr, _ = await self.actors[0].rendezvous.remote(self.single_node)
        await self._all("init_weight_sync",
                        [a.init_weight_sync.remote(engines, addr) for a in self.actors])
        self.sync_initialised = True

    def shutdown(self, timeout_s: float = 60.0) -> None:
        done, late = cf.wait([a.shutdown.future() for a in self.actors], timeout=timeout_s)
        if late or any(f.exception() for f in done):
            logger.warning("%s group did not shut down cleanly", self.role)


class TorchrunRolloutGroup:
    """The rollout engines over torchrun ranks, as `RolloutGroup` (cluster/group.py) places
    them under Ray: an embedded server per rank, or a launched server per replica from the
    replica's first rank (its `LOCAL_RANK` is the base GPU), on the node's address."""

    def __init__(self, devices: RankGroup, cfg, share: float = 1.0,
                 processes_per_device: int = 1, log_dir: str = "logs"):
        ctl = _control()
        r = cfg.actor_rollout_ref.rollout
        self.cfg = cfg
        self.actors = []
        self._start = None  # engine index -> a new server object on its rank
        if r.name == "sglang" and r.server_urls:
            self.urls = list(r.server_urls)
        elif r.name == "sglang":
            from omegaconf import OmegaConf

            yaml = OmegaConf.to_yaml(cfg, resolve=True)
            ranks = devices.ranks[::r.tensor_model_parallel_size]
            self._start = lambda j: _Handle(ctl, ranks[j], f"server{j}", "server", yaml, j,
                                            cfg.trainer.device == "cuda", log_dir)
            self.actors = [self._start(j) for j in range(len(ranks))]
            self.urls = [f.result() for f in [a.url.future() for a in self.actors]]
        else:
            model = cfg.actor_rollout_ref.model.path
            ctx = cfg.data.max_prompt_length + cfg.data.max_response_length
            threads = _threads(cfg)
            ranks = devices.ranks
            self._start = lambda i: _Handle(ctl, ranks[i], "rollout", "rollout", model, threads,
                                            cfg.trainer.seed + i, ctx)
            self.actors = [self._start(i) for i in range(len(ranks))]
            self.urls = [f.result() for f in [a.url.future() for a in self.actors]]
        self.engines = engine_links(cfg, self.urls)
        logger.info("rollout servers: %s (%s)", ", ".join(self.urls), r.name)

    async def restart(self, i: int) -> str:
        """Engine `i` died: its rank stops what is left of it and starts a new one (a rank
        that is itself gone cannot: torchrun restarts no process); returns the new URL."""
        if self._start is None:
            raise RuntimeError("rollout.server_urls: servers megarl did not start are not "
                               "restarted")
        try:
            await asyncio.wait_for(self.actors[i].shutdown.remote(), 30)
        except Exception as e:  # noqa: BLE001 - what is left of it may not answer
            logger.warning("rollout engine %d: shutting down the old server: %s", i, e)
        self.actors[i] = self._start(i)
        self.urls[i] = await self.actors[i].url.remote()
        self.engines[i] = engine_links(self.cfg, [self.urls[i]])[0]
        logger.info("rollout engine %d restarted at %s", i, self.urls[i])
        return self.urls[i]

    def shutdown(self, timeout_s: float = 60.0) -> None:
        done, late = cf.wait([a.shutdown.future() for a in self.actors], timeout=timeout_s)
        if late or any(f.exception() for f in done):
            logger.warning("rollout group did not shut down cleanly")
