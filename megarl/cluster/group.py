"""Worker groups: the handles the driver calls, one per model or engine set.

`MegatronGroup` is one Megatron model (the actor, the frozen reference, the critic, or the
logp replica) as one process per device of its task group, forming one torch.distributed
world; it shards batches over the data-parallel ranks and gathers the results. `RolloutGroup`
is the generate group's rollout servers. Both are written once over a `Transport`
(cluster/transport.py), Ray's or torchrun's; their methods are coroutines, so the asyncio
driver overlaps groups.
"""
from __future__ import annotations

import asyncio
import logging

import torch

from megarl.algo.actor_loss import MAX_METRICS

from .spec import MegatronSpec
from .transport import Transport

logger = logging.getLogger(__name__)


def split_batch(batch: dict, parts: int) -> list[dict]:
    """Split every tensor along dim 0 into `parts` near-equal chunks (data parallel)."""
    n = next(v for v in batch.values() if torch.is_tensor(v)).shape[0]
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [{k: v[a:b] if torch.is_tensor(v) else v for k, v in batch.items()}
            for a, b in zip(bounds, bounds[1:])]


def dp_order(batch: dict, parts: int, micro) -> list[torch.Tensor] | None:
    """With a token budget and data parallelism: the rows of each DP share, balanced by real
    tokens (long-tailed lengths would otherwise leave one rank with most of the work while
    the others wait at the step's collectives). None: contiguous shares (`split_batch`)."""
    from megarl.backends.megatron.packing import TokenBudget, balanced_partition, row_lengths

    if parts == 1 or not isinstance(micro, TokenBudget):
        return None
    shares = balanced_partition(row_lengths(batch), parts, equal_size=True)
    return [torch.tensor(s, dtype=torch.long) for s in shares]


ERROR_GRACE_S = 2.0  # after a rank's failure, how long the others get to report theirs


class WorkerLost(RuntimeError):
    """A rank of a Megatron group is gone (its process, or its host, died)."""


def _secondary(e: BaseException) -> bool:
    """An error a rank raised only because another rank failed (that one says why)."""
    return bool(getattr(getattr(e, "cause", e), "elsewhere", False))


class MegatronGroup:
    def __init__(self, transport: Transport, devices, cfg, spec: MegatronSpec,
                 share: float = 1.0, processes_per_device: int = 1):
        """`spec`: what each rank is told (cluster/spec.py); `cfg` only places them."""
        self.t, self.role = transport, spec.role
        n = devices.num_devices
        threads = transport.threads(cfg, processes_per_device)
        self.actors = [transport.spawn("megatron", devices, i, share, self.role, i, n, threads)
                       for i in range(n)]
        self.single_node = cfg.trainer.nnodes == 1
        self._spec, self._devices = spec, devices
        # set-up has no step's work to scale with: the floor of every state's deadline
        self.setup_timeout_s = float(cfg.trainer.state_timeout_s)

    @staticmethod
    def ready_all(groups: list["MegatronGroup"]) -> None:
        """Wait for the spawned workers of `groups` and build the model on them; separate from
        the constructor so that every group's workers start (process, imports) before any is
        waited for. Under Ray each group's workers are processes of their own, so every
        group's rendezvous, then every group's model build, run side by side; a torchrun rank
        may host several groups, which it serves strictly in turn."""
        if not groups:
            return
        t, first = groups[0].t, groups[0]
        if t.name != "ray":
            for g in groups:
                where = g._each("rendezvous", [g.actors[0]], g.single_node)[0]
                g._built(g._each("setup", g.actors, g._spec, *where))
            return
        where = first._wait([t.call(g.actors[0], "rendezvous", g.single_node) for g in groups],
                            "rendezvous")
        # Each rendezvous is a free port, not yet bound: two asked at once may be told the
        # same one, which the later group is then asked again to avoid.
        for i, g in enumerate(groups):
            while tuple(where[i]) in {tuple(w) for w in where[:i]}:
                where[i] = g._wait([t.call(g.actors[0], "rendezvous", g.single_node)],
                                   "rendezvous")[0]
        calls = [t.broadcast(g.actors, "setup", g._spec, *w) for g, w in zip(groups, where)]
        for g, c in zip(groups, calls):
            g._built(g._wait(c, "setup"))

    def _wait(self, calls: list, what: str) -> list:
        """Set-up calls, waited for at most `trainer.state_timeout_s`: a worker that never
        answers (wedged while starting) fails the set-up by name instead of holding it."""
        try:
            return self.t.wait(calls, self.setup_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{self.role} {what} on group {self._devices.name} did not finish "
                               f"within trainer.state_timeout_s = {self.setup_timeout_s:g} s: "
                               "a worker is wedged") from None

    def _built(self, ranks: list[dict]) -> None:
        self.ranks = ranks
        self.dp = self.ranks[0]["dp_size"]
        # Devices are global indices: under torchrun, the ranks.
        logger.info("%s model: %d process(es) on group %s (devices %s), DP=%d, over %s",
                    self.role, len(self.actors), self._devices.name,
                    list(self._devices.plan.devices), self.dp, self.t.name)

    def _each(self, method: str, workers: list, *args) -> list:
        """One call on each worker, waited for (set-up, before the run's loop starts)."""
        return self._wait(self.t.broadcast(workers, method, *args), method)

    async def _all(self, what: str, calls) -> list:
        """Await one call per rank. On failure raise the error that says why: a lost rank
        (named with its host, as the transport's own error may name only a worker id), else
        the first rank's own error rather than one that only reports another rank's failure."""
        futs = [asyncio.ensure_future(self.t.awaitable(c)) for c in calls]
        try:
            await asyncio.wait(futs, return_when=asyncio.FIRST_EXCEPTION)
            if all(f.done() and not f.cancelled() and f.exception() is None for f in futs):
                return [f.result() for f in futs]
            # The other ranks may be blocked in a collective with the failed one: a short
            # grace for their own errors, not a wait for their timeouts.
            await asyncio.wait(futs, timeout=ERROR_GRACE_S)
        except asyncio.CancelledError:
            for f in futs:
                f.cancel()
            raise
        errors = []
        for i, f in enumerate(futs):
            if not f.done():  # left running: its outcome is retrieved, never reported
                f.add_done_callback(lambda f: f.cancelled() or f.exception())
            elif not f.cancelled() and f.exception() is not None:
                errors.append((i, f.exception()))
        for i, e in errors:
            if self.t.is_lost(e):
                r = self.ranks[i] if i < len(getattr(self, "ranks", [])) else {}
                where = f" on host {r['host']} (pid {r['pid']})" if "host" in r else ""
                first = (str(e).strip().splitlines() or [""])[0]
                raise WorkerLost(f"{self.role} rank {i}{where} was lost during {what}: "
                                 f"{type(e).__name__}: {first}") from e
        raise min(errors, key=lambda ie: (_secondary(ie[1]), ie[0]))[1]

    def _shards(self, batch: dict, micro=None) -> list[dict]:
        """Each rank's data-parallel share. With a token budget (`micro` a `TokenBudget`),
        shares balanced by real tokens, row counts equal to within one (`dp_order` puts the
        per-share outputs back in batch order); else contiguous row ranges."""
        order = dp_order(batch, self.dp, micro)
        if order is None:
            parts = split_batch(batch, self.dp)
        else:
            parts = [{k: v[idx] if torch.is_tensor(v) else v for k, v in batch.items()}
                     for idx in order]
        return [parts[r["dp_rank"]] for r in self.ranks]

    def _merge(self, batch: dict, micro, by_dp: dict, keys) -> dict:
        """Per-DP-rank outputs back into one [B, ...] tensor per key, in batch order."""
        order = dp_order(batch, self.dp, micro)
        out = {k: torch.cat([by_dp[d][k] for d in range(self.dp)]) for k in keys}
        if order is not None:
            where = torch.cat(order)
            for k, v in out.items():
                placed = torch.empty_like(v)
                placed[where] = v
                out[k] = placed
        return out

    async def compute_logp(self, batch: dict, temperature: float, micro_batch_size: int,
                           with_entropy: bool = False) -> dict:
        shards = self._shards(batch, micro_batch_size)
        refs = [self.t.call(a, "compute_logp", s, temperature, micro_batch_size, with_entropy)
                for a, s in zip(self.actors, shards)]
        results = await self._all("compute_logp", refs)
        by_dp = {}
        for r, out in zip(self.ranks, results):
            by_dp.setdefault(r["dp_rank"], out)
        return self._merge(batch, micro_batch_size, by_dp, results[0])

    async def train(self, mini_batches: list[dict], micro_batch_size: int,
                    temperature: float) -> list[dict]:
        """One optimizer step per mini-batch; metrics averaged over data-parallel replicas."""
        per_rank = [[] for _ in self.actors]
        for mb in mini_batches:
            for i, s in enumerate(self._shards(mb, micro_batch_size)):
                per_rank[i].append(s)
        # Every rank normalises its shard by the whole mini-batch's count (MegatronRank.train).
        masks = [mb["response_mask"] for mb in mini_batches]
        results = await self._all("train", [self.t.call(a, "train", mbs, micro_batch_size,
                                                        temperature, masks)
                                            for a, mbs in zip(self.actors, per_rank)])
        leaders = [res for r, res in zip(self.ranks, results) if r["tp_rank"] == 0
                   and r["pp_rank"] == 0]
        steps = []
        for j in range(len(mini_batches)):
            keys = leaders[0][j].keys()
            # maxima (importance weights, ratios) reduce with max; everything else averages
            steps.append({k: max(l[j][k] for l in leaders) if k in MAX_METRICS
                          else sum(l[j][k] for l in leaders) / len(leaders) for k in keys})
        return steps

    async def serve_replicas(self, version: int) -> list[dict]:
        """The logp group: every rank's weight receiver, as engine links for the trainer's
        weight sync (one update-group rank each; never routed to for generation)."""
        urls = await self._all("serve_replica", self.t.broadcast(self.actors, "serve_replica",
                                                                 self.single_node, version))
        return [{"url": u, "tp": 1, "pause": False} for u in urls]

    async def compute_logp_at(self, batch: dict, temperature: float, micro_batch_size: int,
                              version: int, timeout_s: float) -> tuple[dict, int]:
        """`compute_logp` on the logp group's replica, under weight version `version`."""
        refs = [self.t.call(a, "compute_logp_at", s, temperature, micro_batch_size, version,
                            timeout_s)
                for a, s in zip(self.actors, self._shards(batch, micro_batch_size))]
        results = await self._all("compute_logp_at", refs)
        by_dp = {}
        for r, res in zip(self.ranks, results):
            by_dp.setdefault(r["dp_rank"], res["out"])
        out = self._merge(batch, micro_batch_size, by_dp, by_dp[0])
        return out, min(res["version"] for res in results)

    async def compute_values(self, batch: dict, micro_batch_size: int) -> dict:
        """The critic's values [B, S] (`MegatronWorker.compute_values`)."""
        refs = [self.t.call(a, "compute_values", s, micro_batch_size)
                for a, s in zip(self.actors, self._shards(batch, micro_batch_size))]
        results = await self._all("compute_values", refs)
        by_dp = {}
        for r, out in zip(self.ranks, results):
            by_dp.setdefault(r["dp_rank"], out)
        return self._merge(batch, micro_batch_size, by_dp, ["values"])

    async def train_critic(self, mini_batches: list[dict], micro_batch_size: int) -> list[dict]:
        """One critic optimizer step per mini-batch; metrics averaged over DP replicas."""
        per_rank = [[] for _ in self.actors]
        for mb in mini_batches:
            for i, s in enumerate(self._shards(mb, micro_batch_size)):
                per_rank[i].append(s)
        masks = [mb["response_mask"] for mb in mini_batches]
        results = await self._all("train_critic",
                                  [self.t.call(a, "train_critic", mbs, micro_batch_size, masks)
                                   for a, mbs in zip(self.actors, per_rank)])
        leaders = [res for r, res in zip(self.ranks, results)
                   if r["tp_rank"] == 0 and r["pp_rank"] == 0]
        return [{k: sum(ld[j][k] for ld in leaders) / len(leaders) for k in leaders[0][j]}
                for j in range(len(mini_batches))]

    sync_initialised = False

    async def init_weight_sync(self, engines: list[dict]) -> None:
        """Host one update group per pipeline stage and have the engines join them."""
        [(addr, _)] = await self._all("rendezvous", [self.t.call(self.actors[0], "rendezvous",
                                                                 self.single_node)])
        await self._all("init_weight_sync",
                        self.t.broadcast(self.actors, "init_weight_sync", engines, addr))
        self.sync_initialised = True

    async def sync_weights(self, version: int) -> dict:
        return (await self._all("sync_weights",
                                self.t.broadcast(self.actors, "sync_weights", version)))[0]

    async def wait_weight_sync(self) -> dict:
        return (await self._all("wait_weight_sync",
                                self.t.broadcast(self.actors, "wait_weight_sync")))[0]

    async def replace_engine(self, index: int, engine: dict) -> None:
        """Rollout engine `index` was replaced: every rank's sender takes the new one into its
        update group at the next version."""
        await self._all("replace_engine",
                        self.t.broadcast(self.actors, "replace_engine", index, engine))

    async def refit_engine(self, index: int) -> dict:
        """The replacement in slot `index` gets the newest published version now, out of
        band ({"version", "seconds", "bytes"}), or {} when it waits for the next one."""
        return (await self._all("refit_engine",
                                self.t.broadcast(self.actors, "refit_engine", index)))[0]

    async def save(self, path: str, **meta) -> None:
        await self._all("save", self.t.broadcast(self.actors, "save", path, **meta))

    async def load(self, path: str) -> None:
        await self._all("load", self.t.broadcast(self.actors, "load", path))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        if not self.t.shutdown(self.actors, timeout_s):
            logger.warning("%s group did not shut down cleanly", self.role)


class RolloutGroup:
    """The rollout engines of the generate group, all speaking SGLang's HTTP API:
    - `embedded`: one in-process embedded engine server per device;
    - `sglang`: one launched server per rollout replica (`rollout.tensor_model_parallel_size`
      devices each, started from the replica's first), or, with `rollout.server_urls`,
      servers the user runs (none launched).
    `engines` is what the trainer's weight sync needs of each: URL, TP, and whether generation
    pauses while a version loads (stock SGLang: yes; the embedded engine stages: no)."""

    def __init__(self, transport: Transport, devices, cfg, servers: tuple = (),
                 share: float = 1.0, processes_per_device: int = 1, log_dir: str = "logs"):
        """`servers`: the launched servers' specs (cluster/spec.py), one per replica."""
        r = cfg.actor_rollout_ref.rollout
        self.t, self.cfg = transport, cfg
        self.actors = []
        self._start = None  # engine index -> a new worker in its place (None: not restartable)
        single = cfg.trainer.nnodes == 1
        if r.name == "sglang" and r.server_urls:
            self.urls = list(r.server_urls)  # their TP was checked by config.preflight
        else:
            if r.name == "sglang":
                tp = r.tensor_model_parallel_size
                count = len(servers)
                self._start = lambda j: transport.spawn(
                    "server", devices, j * tp, share, f"server{j}", servers[j], single,
                    cfg.trainer.device == "cuda", log_dir,
                    gpu_ids=devices.gpu_ids(range(j * tp, (j + 1) * tp)))
            else:
                model = cfg.actor_rollout_ref.model.path
                ctx = cfg.data.max_prompt_length + cfg.data.max_response_length
                threads = transport.threads(cfg, processes_per_device)
                # One machine keeps the servers on loopback; across nodes they bind the node's
                # address (None).
                host = "127.0.0.1" if single else None
                count = devices.num_devices
                routed = bool(r.enable_rollout_routing_replay)
                self._start = lambda i: transport.spawn(
                    "rollout", devices, i, share, f"rollout{i}", model, threads,
                    cfg.trainer.seed + i, ctx, host=host, routed_experts=routed,
                    trust_remote_code=bool(cfg.actor_rollout_ref.model.trust_remote_code))
            self.actors = [self._start(i) for i in range(count)]
            self.urls = None  # known once ready()

    def ready(self) -> "RolloutGroup":
        """Wait for the spawned servers (see MegatronGroup.ready_all)."""
        if self.urls is None:
            self.urls = self.t.wait(self.t.broadcast(self.actors, "url"))
        self.engines = engine_links(self.cfg, self.urls)
        logger.info("rollout servers: %s (%s) over %s", ", ".join(self.urls),
                    self.cfg.actor_rollout_ref.rollout.name, self.t.name)
        return self

    async def restart(self, i: int) -> str:
        """Engine `i` died: a new one on the same devices (what is left of the old one
        stopped first); returns its URL. Servers the user runs (`rollout.server_urls`) are
        not megarl's to restart; under torchrun a rank that is itself gone cannot be (torchrun
        restarts no process)."""
        if self._start is None:
            raise RuntimeError("rollout.server_urls: servers megarl did not start are not "
                               "restarted")
        await asyncio.to_thread(self.t.stop, self.actors[i], 30.0)
        self.actors[i] = self._start(i)
        limit = float(self.cfg.actor_rollout_ref.rollout.server_start_timeout_s)
        try:
            # bounded: under Ray a replacement whose host is gone waits for placement for ever
            self.urls[i] = await asyncio.wait_for(
                self.t.awaitable(self.t.call(self.actors[i], "url")), limit)
        except asyncio.TimeoutError:
            await asyncio.to_thread(self.t.stop, self.actors[i], 10.0)
            raise RuntimeError(f"rollout engine {i}: its replacement did not start within "
                               f"actor_rollout_ref.rollout.server_start_timeout_s = {limit:g} s "
                               "(is its host gone?)") from None
        self.engines[i] = engine_links(self.cfg, [self.urls[i]])[0]
        logger.info("rollout engine %d restarted at %s", i, self.urls[i])
        return self.urls[i]

    def shutdown(self, timeout_s: float = 60.0) -> None:
        if not self.t.shutdown(self.actors, timeout_s):
            logger.warning("rollout group did not shut down cleanly")


def engine_links(cfg, urls: list[str]) -> list[dict]:
    """What the weight sync needs of each engine (see RolloutGroup)."""
    r = cfg.actor_rollout_ref.rollout
    sglang = r.name == "sglang"
    tp = r.tensor_model_parallel_size if sglang else 1
    return [{"url": u, "tp": tp, "pause": sglang} for u in urls]
