"""torchrun mode: every device is a process that torchrun started; no Ray.

`launch/torchrun.sh` starts `megarl train` once per device on every node. All processes
compute the same group plan (cluster/topology.py); global rank r *is* device r (node-major:
rank = node_rank × nproc_per_node + local_rank), so each task group owns the rank range of its
devices. Global rank 0 runs the unchanged driver; every other rank runs `serve`, a command loop
that builds and calls the same per-rank objects the Ray actors wrap (`MegatronRank`,
`RolloutRank`, `ServerRank`). `TorchrunTransport` is the driver's side of it: the worker groups
(cluster/group.py) run over it as they run over Ray's. Ray is never imported here.

The control plane is the TCPStore that torchrun's agents already host (MASTER_ADDR:MASTER_PORT):
rank 0 writes `cmd/<rank>/<seq>` (pickled and signed: utils/control_auth.py; a value that is
not signed with the job's secret is refused unread), the rank executes it and writes
`res/<rank>/<seq>`, signed the same way.
Commands to one rank run in order, one at a time, like calls on a Ray actor; different ranks
run concurrently. Nothing here touches the default process group of the torchrun world: an
actor rank's default group must be its *model's* world (Megatron's parallel_state assumes so),
which `MegatronRank.setup` creates on its own address and port, exactly as under Ray.

Restarts (`trainer.max_restarts`, torchrun's `--max-restarts`): torchrun's agent restarts a
node's processes when one of them fails; each try is a *life* (TORCHELASTIC_RESTART_COUNT). A
life's keys live under its own prefix, so nothing of a dead life is read by the next, except
its records (`megarl/<run id>/life/<n>/`, in the agents' store, which outlives the workers):
which ranks checked in (host, pid), whether the set-up finished, rank 0's account of the
failure and each rank's last word. Every rank of a failed life exits non-zero, so every node's
agent restarts its ranks and the nodes stay in the same life; a rank that sees a newer life
begin leaves at once. Rank 0 of the next life waits until every rank has checked in (a host
that was cut off may come back), reads the records into the losses the driver reports, and
resumes from the newest checkpoint.

Deliberately left out: fractional device shares (all models placed on a device live in one
process; an actor and a reference model on the same ranks share its parallel state and so need
the same TP×PP), elastic membership (a restart needs every node back: the placement is static),
and Ray's placement groups. Batches travel through the store, which suits control-sized data;
weights travel on the weight-sync group as usual.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback

from megarl.utils.control_auth import ForgedMessage, Sealer
from megarl.utils.errors import ConfigError, lost_too_often
from megarl.utils.net import route_address

from .actors import MegatronRank, RolloutRank, ServerRank, on_torchrun_node
from .transport import Transport, thread_budget

logger = logging.getLogger(__name__)

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_CONTROL: "Control | None" = None   # this process's link to the others, set by `main`
# A rank whose heartbeat has not moved for this long is taken for dead: rank 0 fails the calls
# waiting on it, and the other ranks leave when rank 0 goes quiet (no rank hangs for ever).
HEARTBEAT_ENV = "MEGARL_TORCHRUN_HEARTBEAT_S"
# A rank's last word when its agent stops it because another rank of its node failed.
STOPPED = "stopped by its torchrun agent (SIGTERM)"


class RemoteError(RuntimeError):
    """A command failed on another rank; the message carries that rank's traceback."""


class RankLost(RemoteError):
    """The rank a command was for is gone (no heartbeat): its process or host died."""


# ------------------------------------------------------------------ per-rank objects
_KINDS = {"megatron": MegatronRank, "rollout": RolloutRank, "server": ServerRank}


def _execute(objects: dict, msg: tuple):
    """Run one command against this rank's objects: create one, or call a method on one."""
    name, method, args, kwargs = msg
    if method == "__init__":
        try:
            objects[name] = _KINDS[args[0]](*args[1:], **kwargs)
        except Exception as e:
            # Nobody waits on a spawn: its first call is what reports the failure.
            objects[name] = e
            raise
        return None
    obj = objects[name]
    if isinstance(obj, Exception):
        raise RuntimeError(f"{name} ({method}): this rank's {name} failed to start: "
                           f"{type(obj).__name__}: {obj}") from obj
    return getattr(obj, method)(*args, **kwargs)


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
        agent_max = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
        if agent_max is not None and int(agent_max) != t.max_restarts:
            raise ConfigError(
                f"trainer.max_restarts={t.max_restarts} but torchrun was started with "
                f"--max-restarts {agent_max}: the agent restarts the processes, so the two must "
                "agree (launch/torchrun.sh passes the key's value)")
        self.max_restarts, self.placement_timeout_s = t.max_restarts, t.placement_timeout_s
        self.sealer = Sealer.from_env()
        self.life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.master = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # With the agent's store, torchrun would make *every* env:// init_process_group a
        # client of that store; the model worlds host their own stores, so turn it off here.
        agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None) == "True"
        self._host_store = not agent_store and self.rank == 0
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        self._prefix = f"megarl/{run_id}/{self.life}/"
        self._records = f"megarl/{run_id}/life/"
        self.store = self._connect(self._host_store)
        self.records = self._connect(prefix=self._records)
        self.node_ip = route_address(self.master[0])
        self.store.set(f"node/{self.rank}", self.node_ip)  # for messages that name a host
        self._say(f"rank/{self.rank}", f"host {self.node_ip}, pid {os.getpid()}")
        self.records.add(f"{self.life}/joined", 1)
        self.losses: list[str] = []  # rank 0: what ended each earlier life (`join`)
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

    def _connect(self, host: bool = False, prefix: str | None = None):
        """A store client. Every blocking user gets its own: a TCPStore client serialises its
        operations, so a waiter would otherwise hold up every other caller."""
        import torch.distributed as dist

        store = dist.TCPStore(self.master[0], self.master[1], is_master=host,
                              timeout=datetime.timedelta(seconds=600))
        return dist.PrefixStore(prefix or self._prefix, store)

    # ---------------------------------------------------------------- lives and their records
    def _say(self, what: str, text: str) -> None:
        """Record `what` (rank/<r>, started, loss, end/<r>) of this life; best effort, for
        the next life's account of this one (the store may be unreachable already)."""
        try:
            self.records.set(f"{self.life}/{what}", text)
        except Exception as err:  # noqa: BLE001 - a record, not the run
            logger.debug("rank %d: could not record %s: %s", self.rank, what, err)

    def _record(self, life: int, what: str) -> str | None:
        key = f"{life}/{what}"
        return self.records.get(key).decode() if self.records.check([key]) else None

    def what_ended(self, life: int) -> str:
        """An earlier life's loss as its records tell it: rank 0's account of the failure,
        and every rank that left no last word (a SIGKILL, a crash, a host lost)."""
        words, loss = [], self._record(life, "loss")
        if loss:
            words.append(loss)
        joined = {r: self._record(life, f"rank/{r}") for r in range(self.world)}
        silent = [r for r, who in joined.items()
                  if who and self._record(life, f"end/{r}") is None]
        if silent:
            who = "; ".join(f"rank {r} ({joined[r]})" for r in silent)
            words.append(f"no word from {who}: killed, or its host lost")
        never = [r for r, who in joined.items() if not who]
        if not words and never:  # stopped while starting, if nothing else explains the loss
            words.append(f"rank(s) {never} never checked in (did not start, or died starting)")
        if not words:
            ends = [(r, self._record(life, f"end/{r}")) for r in range(self.world)]
            words = [f"rank {r}: {e}" for r, e in ends if e != STOPPED] or [f"every rank {STOPPED}"]
        return "; ".join(words)

    def newer_life(self) -> list[int]:
        """Ranks that checked in to the next life: their node's agent restarted them, so this
        life is over."""
        if self.records.add(f"{self.life + 1}/joined", 0) == 0:
            return []
        return [r for r in range(self.world) if self._record(self.life + 1, f"rank/{r}")]

    def join(self) -> None:
        """Rank 0, before the driver: wait until every rank of this life has checked in (after
        a restart, a host that was cut off may be coming back), then read what ended the
        earlier lives."""
        deadline = time.monotonic() + self.placement_timeout_s
        while (n := self.records.add(f"{self.life}/joined", 0)) < self.world:
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world)
                           if not self._record(self.life, f"rank/{r}")]
                raise TimeoutError(
                    f"torchrun life {self.life}: {n} of {self.world} ranks checked in within "
                    f"trainer.placement_timeout_s = {self.placement_timeout_s:g} s; missing: "
                    f"ranks {missing} (their nodes' torchrun did not start them again)")
            time.sleep(0.1)
        self.losses = [self.what_ended(k) for k in range(self.life)]
        if self.life and self._record(0, "started") is None:
            # as under Ray: a run whose first set-up failed (a config, a path) is not retried
            raise RuntimeError(f"the run's first set-up failed; not retried: {self.losses[0]}")

    def started(self) -> None:
        """The driver's set-up is done: a failure from here on is a loss to restart from."""
        self._say("started", "1")

    def _stopped(self, signum, frame) -> None:
        """SIGTERM: the agent stops this node's ranks (another failed) or the job is
        cancelled. Say so, and, on the last life, name every loss: nothing runs after it."""
        self._say(f"end/{self.rank}", STOPPED)
        if self.rank == 0 and self.max_restarts and self.life >= self.max_restarts:
            time.sleep(1.0)  # the others' last words, sent at the same moment
            try:  # every life's account (this rank may have been stopped before `join`)
                logger.error("%s", lost_too_often([self.what_ended(k)
                                                   for k in range(self.life + 1)],
                                                  self.max_restarts))
            except Exception:  # noqa: BLE001 - the store may be gone with the failure
                logger.error("%s", lost_too_often([*self.losses, STOPPED], self.max_restarts))
        _leave(128 + signum)

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
        """Whether `rank`'s heartbeat has stood still for `heartbeat_s` (on this clock); one
        that never beat yet (its process is still starting: a restarted node's ranks come up
        when their agent restarts them) gets `placement_timeout_s`."""
        count, now = store.add(f"beat/{rank}", 0), time.monotonic()
        seen = self._seen.get(rank)
        if seen is None or seen[0] != count:
            self._seen[rank] = (count, now)
            return False
        return now - seen[1] > (self.heartbeat_s if count else self.placement_timeout_s)

    # ---------------------------------------------------------------- rank 0: calling
    def call(self, rank: int, name: str, method: str, *args, **kwargs) -> cf.Future:
        """Run `objects[name].method(*args)` on `rank`; the future holds its result."""
        msg = (name, method, args, kwargs)
        if rank == self.rank:
            return self._local.submit(_execute, self.objects, msg)
        if rank in self._dead:
            fut = cf.Future()
            fut.set_exception(RankLost(f"rank {rank}: {name}.{method}: the rank (host "
                                       f"{self.host_of(rank)}) is gone"))
            return fut
        fut: cf.Future = cf.Future()
        with self._lock:  # callers on several threads (the driver, teardown, weight senders)
            seq = self._seq[rank]
            self._seq[rank] += 1
            self._pending[f"res/{rank}/{seq}"] = (fut, f"rank {rank}: {name}.{method}")
        key = f"cmd/{rank}/{seq}"
        self.store.set(key, self.sealer.seal(self._prefix + key, msg))
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
                blob = store.get(key)
                store.delete_key(key)
                try:
                    status, value = self.sealer.open(self._prefix + key, blob)
                except ForgedMessage as err:
                    # someone else wrote there; the rank's own result is still to come
                    logger.error("rank 0: refused a result (%s); still waiting for the rank's",
                                 err)
                    continue
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
        restarted = self.newer_life()
        if restarted and not self.lost.done():
            hosts = sorted({self.host_of(r) for r in restarted})
            self.lost.set_exception(RankLost(
                f"rank(s) {restarted} on host(s) {', '.join(hosts)} were restarted by their "
                "node's torchrun (a rank there failed)"))
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
                fut.set_exception(RankLost(f"{what}: {gone}"))
            if not self.lost.done():
                self.lost.set_exception(RankLost(f"{gone} (host down, cut off or killed)"))

    def release(self, timeout_s: float = 120.0, failed: bool = False) -> None:
        """Tell every other rank to leave its loop, and wait until each has. After a failure
        they exit non-zero, so that every node's agent restarts its ranks (a node whose
        ranks all succeeded would leave the run)."""
        acks = [self.call(r, "", "__exit__", failed) for r in range(self.world)
                if r != self.rank]
        done, late = cf.wait(acks, timeout=timeout_s)
        if late:
            logger.warning("%d rank(s) did not acknowledge the end of the run", len(late))
        self._stop.set()
        self._local.shutdown(wait=False)

    # ---------------------------------------------------------------- other ranks: serving
    def serve(self) -> bool:
        """Execute rank 0's commands in order until it says the run is over; whether the run
        failed. Commands run on a thread of their own, so this (main) thread keeps watching
        rank 0 and takes SIGTERM while a long command runs."""
        seq, work = 0, cf.ThreadPoolExecutor(1, thread_name_prefix=f"megarl-rank{self.rank}")
        logger.info("rank %d/%d serving (node %s, life %d)", self.rank, self.world,
                    self.node_ip, self.life)
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
                    self._check_driver()
            blob = self.store.get(key)
            self.store.delete_key(key)
            try:
                msg = self.sealer.open(self._prefix + key, blob)
            except ForgedMessage as err:
                # not rank 0's: refused unread; its command for this slot is still to come
                logger.error("rank %d: refused a command (%s); still waiting for rank 0's",
                             self.rank, err)
                continue
            res = f"res/{self.rank}/{seq}"
            if msg[1] == "__exit__":
                self.store.set(res, self.sealer.seal(self._prefix + res, ("ok", None)))
                failed = bool(msg[2] and msg[2][0])
                break
            fut = work.submit(_execute, self.objects, msg)
            while not cf.wait([fut], timeout=1.0).done:
                self._check_driver()
            try:
                out = ("ok", fut.result())
            except Exception:  # noqa: BLE001 - the failure belongs to rank 0's caller
                logger.exception("rank %d: %s.%s failed", self.rank, msg[0], msg[1])
                out = ("error", traceback.format_exc())
            self.store.set(res, self.sealer.seal(self._prefix + res, out))
            seq += 1
        self._stop.set()
        work.shutdown(wait=False)
        logger.info("rank %d: run over%s", self.rank, " (it failed)" if failed else "")
        return failed

    def _check_driver(self) -> None:
        """Raise when this rank should leave: rank 0 silent, or a newer life begun."""
        if self._silent(self.store, 0):
            raise RuntimeError(f"rank {self.rank}: rank 0 (the driver) has had no heartbeat for "
                               f"{self.heartbeat_s:.0f} s; leaving")
        restarted = self.newer_life()
        if restarted:
            raise RuntimeError(f"rank {self.rank}: rank(s) {restarted} began life "
                               f"{self.life + 1} of the run (their node restarted them); leaving")


def _control() -> Control:
    if _CONTROL is None:
        raise ConfigError("trainer.launcher=torchrun: this process was not started through "
                          "`megarl train` under torchrun (see launch/torchrun.sh)")
    return _CONTROL


def _leave(code: int) -> None:
    """Exit now, without joining threads that may be blocked on a host that is gone. The
    rollout servers this rank started (a replacement too) go first, their whole process
    groups: SGLang drains requests on SIGTERM, with the trainer gone possibly for ever."""
    launcher = sys.modules.get("megarl.backends.sglang.launcher")  # none started without it
    if launcher is not None:
        launcher.stop_all_servers()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _brief(err: BaseException) -> str:
    """`Type: message` on one line (a remote failure's message carries a whole traceback:
    its first and last lines say what failed and why)."""
    lines = f"{type(err).__name__}: {err}".strip().splitlines()
    return lines[0] if len(lines) < 3 else f"{lines[0]} ... {lines[-1].strip()}"


def main(cfg, run_driver) -> int:
    """`megarl train` under torchrun: rank 0 runs `run_driver(life)`, the others serve it.
    `life` (this Control) tells the driver the earlier lives' losses and hears when the
    set-up is done."""
    global _CONTROL
    if cfg.trainer.device == "cpu" and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        # A CPU run on a GPU host: with the GPUs visible, the process groups pick NCCL and every
        # rank the same GPU ("Duplicate GPU detected", seen on an H100 host). Hidden before
        # anything here asks CUDA, the run is the CPU one it says it is.
        logger.info("trainer.device=cpu: CUDA devices hidden from this rank")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    _CONTROL = ctl = Control(cfg)
    signal.signal(signal.SIGTERM, ctl._stopped)
    on_torchrun_node(ctl.node_ip)  # the per-rank objects bind and name this node's address
    if ctl.rank != 0:
        try:
            failed = ctl.serve()
        except Exception as err:
            # rank 0 is gone or cannot be reached: nothing will ever call this rank again, and
            # its servers' threads must not keep it alive
            logger.exception("rank %d on host %s: lost the driver (rank 0 at %s:%d); leaving",
                             ctl.rank, ctl.node_ip, *ctl.master)
            ctl._say(f"end/{ctl.rank}", _brief(err))
            _leave(1)
        ctl._say(f"end/{ctl.rank}", "failed with the run" if failed else "done")
        if failed:
            _leave(1)
        return 0
    try:
        ctl.join()
        run_driver(ctl)
    except ConfigError as err:  # said in one line by the command line; nothing is stuck yet
        ctl._say("loss", _brief(err))
        ctl._say("end/0", "failed")
        ctl.release(failed=True)
        raise
    except Exception as err:
        # The run failed. Threads still blocked on a host that is gone (a weight delivery,
        # an engine call) would hold this process's exit for their whole timeouts: report,
        # let the other ranks go, and leave now, stopping the servers this rank started
        # (`_leave`); torchrun sees the failure in the exit status and, with restarts left,
        # starts the next life.
        logger.exception("rank 0: the run failed")
        ctl._say("loss", _brief(err))
        ctl._say("end/0", "failed")
        ctl.release(timeout_s=10.0, failed=True)
        _leave(1)
    ctl._say("end/0", "done")
    ctl.release()
    return 0


# ------------------------------------------------------------------ the transport
class _Handle:
    """One object on one rank: `tag` names it among that rank's objects."""

    def __init__(self, rank: int, tag: str):
        self.rank, self.tag = rank, tag


class RankGroup:
    """The ranks of one task group: torchrun mode's device group (nothing to reserve)."""

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

    def gpu_ids(self, indices) -> None:
        """None: a torchrun rank's GPU is its local rank (ServerRank)."""
        return None

    def remove(self) -> None:
        pass  # nothing reserved: torchrun owns the processes


class TorchrunTransport(Transport):
    """Workers as objects on the torchrun ranks, called through the store (`Control`); a
    rank's calls run one at a time in order, like a Ray actor's."""

    name = "torchrun"

    def __init__(self):
        self.ctl = _control()

    def devices(self, plan, device):
        return RankGroup(plan, device)

    def spawn(self, kind, devices, index, share, tag, *args, **kwargs):
        # `share` has no meaning here: every model on a device lives in its one process.
        w = _Handle(devices.ranks[index], tag)
        # Later calls queue behind this one on the rank; one that fails says it was never made.
        self.ctl.call(w.rank, tag, "__init__", kind, *args, **kwargs)
        return w

    def call(self, worker, method, *args, **kwargs) -> cf.Future:
        return self.ctl.call(worker.rank, worker.tag, method, *args, **kwargs)

    def wait(self, calls, timeout_s=None):
        calls = list(calls)
        cf.wait(calls, timeout=timeout_s)
        return [f.result(timeout=0) for f in calls]

    def awaitable(self, call):
        return asyncio.wrap_future(call)

    def stop(self, worker, timeout_s):
        try:
            self.call(worker, "shutdown").result(timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - what is left of it may not answer
            logger.warning("rank %d: shutting down %s: %s", worker.rank, worker.tag, e)

    def shutdown(self, workers, timeout_s):
        done, late = cf.wait(self.broadcast(workers, "shutdown"), timeout=timeout_s)
        return not late and not any(f.exception() for f in done)

    def is_lost(self, err):
        return isinstance(err, RankLost)

    def health(self):
        return self.ctl.lost

    def threads(self, cfg, processes_per_device):
        """Every model on a device shares its one process. OMP_NUM_THREADS, when set (torchrun
        sets 1 for several processes per node), wins over the core split."""
        env = os.environ.get("OMP_NUM_THREADS")
        return int(env) if env else thread_budget(cfg, 1)
