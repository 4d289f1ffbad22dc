"""The Megatron trainer's side of weight sync: what every trainer rank calls.

Owns the choice of sender (TP-rank-0 of each pipeline stage of the first data-parallel replica
holds a `WeightProducer`; the other TP ranks of that replica only take part in `export_hf`'s
gathers, other replicas only in the agreement on success) and the order of one version across
stages. Stock SGLang loads every bucket as it arrives, inside one begin/end session, so:

    coordinator (stage 0's sender): pause (stock SGLang) -> begin
    stage 0, then stage 1, ... each sends its buckets (turns, via a small store rank 0 hosts)
    the last stage's last bucket carries the version
    coordinator, once the last stage is done: end -> flush -> continue

Engines a stage found stale are passed on with its turn, so later stages and the coordinator
leave them out too. `sync(version)`: with dual buffer, returns once this stage is snapshotted
(the delivery runs in the background; the next `sync` or `wait` collects it); without, once the
engines serve the new version. Failures are agreed on by all ranks; all raise together.

`refit(slot)`: out of band, the newest version this trainer published, again, to one engine
only (the replacement of a dead one), over an update group of its own. A replacement otherwise
waits for the next SYNC, and with no other engine live that SYNC never comes: it needs the very
samples only an engine can make.
"""
from __future__ import annotations

import datetime
import json
import logging
import time

import torch
import torch.distributed as dist

from .producer import SyncStats, WeightProducer
from .transports import EngineLink
from .protocol import NoEngineToSend, SyncConfig, WeightSyncError
from .verify import SentDigest

logger = logging.getLogger(__name__)

_CLOSED = "closed"  # the turn key the coordinator sets once a version is live


class _StageTurns:
    """Stage s sends after stage s-1 is done; the coordinator closes after the last stage.
    Keys live in a TCPStore hosted by global rank 0, one set per sync (`seq`)."""

    def __init__(self, store, num_stages: int, timeout_s: float):
        self.store, self.num_stages, self.timeout_s = store, num_stages, timeout_s

    def done(self, seq: int, stage: int, ok: bool, stale: dict[str, str], error: str = ""):
        if self.store is not None:
            self.store.set(f"{seq}/{stage}", json.dumps({"ok": ok, "stale": stale,
                                                          "error": error}))

    def wait(self, seq: int, stage: int) -> dict:
        """Stage `stage`'s outcome (blocks until it is done); `_CLOSED`: the coordinator's."""
        if self.store is None or stage == -1:
            return {"ok": True, "stale": {}, "error": ""}
        key = f"{seq}/{stage}"
        self.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
        return json.loads(self.store.get(key))


class TrainerWeightSync:
    def __init__(self, worker, links: list, config: SyncConfig, *, address: str,
                 group_name: str = "megarl-weights", backend: str | None = None,
                 export_dtype: torch.dtype | None = None):
        ps = worker.ps
        self.worker, self.config, self.export_dtype = worker, config, export_dtype
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.num_stages = ps.get_pipeline_model_parallel_world_size()
        # One data-parallel replica (the first) holds every weight once: only its ranks
        # export, and its TP-rank-0 of each stage sends. Experts split over EP are the
        # exception: their EP ranks are other data-parallel ranks, and every one of them
        # takes part in the export's EP gathers.
        # (context-parallel ranks hold the same weights as their CP rank 0: they stay out)
        first = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        self.exporter = first or (worker.args.is_moe
                                  and ps.get_expert_model_parallel_world_size() > 1)
        self.sender = first and ps.get_tensor_model_parallel_rank() == 0
        self.coordinator = dist.get_rank() == 0  # stage 0's sender
        self.address = address
        self.producer = None
        self.turns = None
        self._seq = 0
        self._pending = None  # version whose background delivery is not yet collected
        self._collected = None  # a delivery's stats collected by a refit, for the next sync
        self._deferred = None  # ... or its failure
        self._published = None  # the newest version sent (sync), none before the first
        self._group_name, self._backend = group_name, backend
        if self.sender:
            backend = backend or config.backend or \
                ("nccl" if torch.cuda.is_available() else "gloo")
            device = "cuda" if backend == "nccl" else "cpu"
            self.producer = WeightProducer(links, config, stage=self.stage,
                                           group_name=f"{group_name}-pp{self.stage}",
                                           backend=backend, device=device)

    def connect(self) -> None:
        """Every stage's sender hosts its update group; with PP > 1 rank 0 also hosts the
        store the stages take turns through."""
        from megarl.utils.launch import free_port

        store = None
        if self.num_stages > 1:
            where = [(self.address, free_port(self.address)) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(where, src=0)
            if self.sender:
                store = dist.TCPStore(where[0][0], where[0][1], is_master=self.coordinator,
                                      timeout=datetime.timedelta(seconds=self.config.timeout_s),
                                      wait_for_workers=False)
        # A version waits for every earlier stage's whole transfer.
        self.turns = _StageTurns(store, self.num_stages, self.config.timeout_s * 20)
        # One stage's group after another: stock SGLang serves init_weights_update_group
        # calls one at a time, each blocking its scheduler until that group's rendezvous is
        # complete (0.5.23 managers/communicator.py). Joined all at once, two engines could
        # take the stages' joins in opposite orders and wait on each other for ever.
        for stage in range(self.num_stages):
            if self.sender and stage == self.stage:
                self.producer.connect(self.address)
            dist.barrier()

    def _unless_replaced(self, e: Exception, version: int) -> Exception | None:
        """`e`, or None where every engine is gone and megarl replaces engines: the version
        is published all the same, and each replacement gets it out of band (`refit`)."""
        if isinstance(e, NoEngineToSend) and self.config.engines_replaced:
            logger.error("weights v%d stage %d reached no engine (%s); the trainer keeps "
                         "it for the replacements", version, self.stage, e.cause)
            return None
        return e

    @staticmethod
    def _failed_anywhere(err: Exception | None) -> bool:
        # on the default group's device: NCCL has no CPU backend (seen on an H100)
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor([0 if err is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _agree(self, err: Exception | None, version: int) -> None:
        """Every rank learns whether any rank failed; all raise together."""
        failed = self._failed_anywhere(err)
        if err is not None:
            raise err
        if failed:
            raise WeightSyncError(version, None, "failed on another trainer rank",
                                 elsewhere=True)

    def _deliver(self, buckets, version: int, seq: int, stats: SyncStats,
                 producer: WeightProducer | None = None, what: str = "delivered"
                 ) -> SyncStats:
        """This stage's part of one version, in its turn; the coordinator opens and closes."""
        p, last = producer or self.producer, self.stage == self.num_stages - 1
        t0 = time.perf_counter()
        p.sent_checksums = SentDigest()
        before = self.turns.wait(seq, self.stage - 1)
        err = None
        try:
            if not before["ok"]:
                raise WeightSyncError(version, None, f"stage {self.stage - 1} failed: "
                                      f"{before['error']}", stage=self.stage)
            p.exclude(before["stale"], seq)
            if self.coordinator:
                p.open_version(version)
            p.send(buckets, version, set_version=last, stats=stats)
        except Exception as e:  # noqa: BLE001 - reported to the other stages, then raised
            err = self._unless_replaced(e, version)
        self.turns.done(seq, self.stage, err is None, p.stale, str(err or ""))
        if self.coordinator:
            final = self.turns.wait(seq, self.num_stages - 1)
            try:
                p.close_version(final["stale"])
            except NoEngineToSend as e:  # already said, where the send found none
                err = err or (None if self.config.engines_replaced else e)
            except Exception as e:  # noqa: BLE001 - the other stages wait for the close
                err = err or e
            stats.pause_s = time.perf_counter() - t0
            if err is None and not final["ok"]:
                err = WeightSyncError(version, None, final["error"], stage=self.num_stages - 1)
            self.turns.done(seq, _CLOSED, err is None, {})
        if self.config.verify and err is None:  # once the version is live on the engines
            if self.turns.wait(seq, _CLOSED)["ok"]:
                p.verify(version, p.sent_checksums)
        p.sent_checksums = SentDigest()
        stats.transfer_s = time.perf_counter() - t0
        stats.stale = p.stale_now()
        if err is not None:
            raise err
        logger.info("weights v%d stage %d %s: %.1f MB in %d buckets, %.3f s "
                    "(%.2f GB/s)%s", version, self.stage, what, stats.bytes / 1e6, stats.buckets,
                    stats.transfer_s, stats.gbps,
                    f"; stale engines {stats.stale}" if stats.stale else "")
        return stats

    def wait(self) -> SyncStats | None:
        """Collect the background delivery of the previous version on every stage."""
        if self._deferred is not None:
            err, self._deferred = self._deferred, None
            raise err
        if self._pending is None:
            collected, self._collected = self._collected, None
            return collected
        version, self._pending = self._pending, None
        err, stats = None, None
        try:
            stats = self.producer.wait() if self.sender else None
        except Exception as e:  # noqa: BLE001 - agreed on below, then re-raised
            err = e
        self._agree(err, version)
        return stats

    def sync(self, version: int) -> SyncStats | None:
        version = int(version)
        t0 = time.perf_counter()
        prev = self.wait()
        self._published = version
        self._seq += 1
        seq = self._seq
        named = self.worker.export_hf(self.export_dtype) if self.exporter else iter(())
        stats = SyncStats(version, self.stage)
        if self.config.dual_buffer:
            if self.sender:
                snap = self.producer.snapshot(named, version)
                stats.blocking_s = snap.blocking_s
                self.producer.start(lambda: self._deliver(snap.buckets, version, seq, stats))
            else:
                for _ in named:  # the TP gathers need every rank
                    pass
            self._pending = version
            blocking = time.perf_counter() - t0
            logger.info("weights v%d: trainer blocked %.3f s (snapshot)", version, blocking)
            # What this sync blocked for, and how the PREVIOUS version's delivery went (it was
            # collected above): the transfer of a version is known only at the next sync.
            out = prev or SyncStats(version, self.stage)
            out.blocking_s = blocking
            return out
        err = None
        try:
            if self.sender:
                self._deliver(self.producer.stream(named, version), version, seq, stats)
        except Exception as e:  # noqa: BLE001 - agreed on below, then re-raised
            err = e
        for _ in named:  # after a failure, keep up with the other TP ranks' gathers
            pass
        self._agree(err, version)
        stats.blocking_s = time.perf_counter() - t0
        return stats if self.sender else None

    def refit(self, slot: int, weights_current: bool) -> SyncStats | None:
        """Send the newest published version to engine slot `slot` alone (its replacement,
        already given to `replace_engine`), over a group of its own that is gone afterwards;
        the slot joins the shared group at the next version as before. Every trainer rank
        calls it; the decision below is the same on each (same config, same history).

        The bytes: with the dual buffer, the snapshot, which holds that version until the next
        sync; without it, the live weights, but only when no train step has changed them since
        (`weights_current`). Otherwise None: that train step leads to a SYNC, which brings the
        replacement in. None too before any sync: the replacement loaded the files every
        engine started from."""
        version = self._published
        if version is None or not (self.config.dual_buffer or weights_current):
            logger.info("engine slot %d: no out-of-band weights (%s); it joins at the next "
                        "version", slot, "nothing published yet" if version is None
                        else "trained since the last version, no dual buffer")
            return None
        t0 = time.perf_counter()
        if self.config.dual_buffer:
            # the snapshot's own delivery first: an engine holds one update session at a time.
            # Its failure is the next sync's to raise, as without the refit.
            try:
                self._collected = self.wait() or self._collected
            except Exception as e:  # noqa: BLE001 - raised again by the next sync / wait
                self._deferred = e
                raise
        self._seq += 1
        seq, stats, err, p = self._seq, SyncStats(version, self.stage), None, None
        if self.sender:
            link = self.producer.link_of(slot)
            p = WeightProducer([EngineLink(link.name, link.tp_size, link.pause_for_update)],
                               self.config, stage=self.stage,
                               group_name=f"{self._group_name}-refit-pp{self.stage}",
                               backend=self.producer.backend, device=self.producer.device)
        named = (self.worker.export_hf(self.export_dtype)
                 if self.exporter and not self.config.dual_buffer else iter(()))
        for stage in range(self.num_stages):  # one stage's group after another (connect)
            if p is not None and stage == self.stage:
                try:
                    p.connect(self.address)
                except Exception as e:  # noqa: BLE001 - agreed on below, then re-raised
                    err = e
            dist.barrier()
        # Every stage connected, or none sends: a stage that never sends would leave the
        # next one waiting for its turn.
        if not self._failed_anywhere(err) and p is not None:
            try:
                buckets = (self.producer.last_snapshot.buckets if self.config.dual_buffer
                           else p.stream(named, version))
                self._deliver(buckets, version, seq, stats, producer=p, what="refit")
            except Exception as e:  # noqa: BLE001 - agreed on below, then re-raised
                err = e
        if p is not None:
            p.leave()
            p.close()
        for _ in named:  # after a failure, keep up with the other TP ranks' gathers
            pass
        self._agree(err, version)
        stats.blocking_s = time.perf_counter() - t0
        if self.coordinator:
            logger.info("engine slot %d refit to weights v%d out of band in %.2f s (%s)",
                        slot, version, stats.blocking_s,
                        "snapshot" if self.config.dual_buffer else "live weights")
        return stats

    def replace_engine(self, index: int, link) -> None:
        """A new engine in slot `index`; it joins the update group at the next version."""
        if self.producer is not None:
            # due from the next sync on, whatever a background delivery is doing now
            self.producer.replace_link(index, link, after=self._seq)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
