"""The Megatron trainer's side of weight sync: what every trainer rank calls.

Owns the choice of sender (TP-rank-0 of each pipeline stage of the first data-parallel
replica holds a `WeightProducer`; the other TP ranks of that replica only take part in
`export_hf`'s gathers, other replicas only in the agreement on success) and the cross-rank ordering of a
sync: one version is finished on every stage before the next starts, failures are agreed on
by all ranks, and without dual buffer global rank 0 pauses the engines around the update.

`sync(version)`: with dual buffer, returns once this stage is snapshotted (the transfer runs
in the background; the next `sync` or `wait` collects it); without, returns once the engines
serve the new version.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from .producer import SyncStats, WeightProducer
from .protocol import SyncConfig, WeightSyncError

logger = logging.getLogger(__name__)


class TrainerWeightSync:
    def __init__(self, worker, links: list, config: SyncConfig, *, address: str,
                 base_port: int, group_name: str = "megarl-weights", backend: str | None = None,
                 export_dtype: torch.dtype | None = None, pause_mode: str = "abort"):
        ps = worker.ps
        self.worker, self.config, self.export_dtype = worker, config, export_dtype
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.num_stages = ps.get_pipeline_model_parallel_world_size()
        # One data-parallel replica (the first) holds every weight once: only its ranks
        # export, and its TP-rank-0 of each stage sends.
        self.exporter = ps.get_data_parallel_rank() == 0
        self.sender = self.exporter and ps.get_tensor_model_parallel_rank() == 0
        self.coordinator = dist.get_rank() == 0  # stage 0's sender
        self.pause_mode = pause_mode
        self.producer = None
        self._pending = None  # version whose background transfer is not yet collected
        if self.sender:
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            device = "cuda" if backend == "nccl" else "cpu"
            self.producer = WeightProducer(links, config, stage=self.stage,
                                           num_stages=self.num_stages,
                                           group_name=f"{group_name}-pp{self.stage}",
                                           backend=backend, device=device)
        self._address, self._port = address, base_port + self.stage

    def connect(self) -> None:
        if self.sender:
            self.producer.connect(self._address, self._port)
        dist.barrier()

    def _agree(self, err: Exception | None, version: str) -> None:
        """Every rank learns whether any rank failed; all raise together."""
        flag = torch.tensor([0 if err is None else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if err is not None:
            raise err
        if flag.item():
            raise WeightSyncError(version, None, "failed on another trainer rank")

    def wait(self) -> SyncStats | None:
        """Collect the background transfer of the previous version on every stage."""
        if self._pending is None:
            return None
        version, self._pending = self._pending, None
        err, stats = None, None
        try:
            stats = self.producer.wait() if self.sender else None
        except Exception as e:  # noqa: BLE001 - agreed on below, then re-raised
            err = e
        self._agree(err, version)
        return stats

    def sync(self, version: str) -> SyncStats | None:
        version = str(version)
        t0 = time.perf_counter()
        self.wait()
        named = self.worker.export_hf(self.export_dtype) if self.exporter else iter(())
        if self.config.dual_buffer:
            if self.sender:
                snap = self.producer.snapshot(named, version)
                self.producer.start(snap)
            else:
                for _ in named:  # the TP gathers need every rank
                    pass
            self._pending = version
            blocking = time.perf_counter() - t0
            logger.info("weights v%s: trainer blocked %.3f s (snapshot)", version, blocking)
            return SyncStats(version, self.stage, blocking_s=blocking)
        return self._sync_paused(named, version, t0)

    def _sync_paused(self, named, version: str, t0: float) -> SyncStats | None:
        err, stats = None, None
        try:
            if self.coordinator:
                self.producer.pause_engines(self.pause_mode)
        except Exception as e:  # noqa: BLE001
            err = WeightSyncError(version, None, f"pause failed: {e}")
        self._agree(err, version)
        try:
            if self.sender:
                stats = self.producer.send(named, version, direct=True)
        except Exception as e:  # noqa: BLE001
            err = e
        for _ in named:  # after a failure, keep up with the other TP ranks' gathers
            pass
        self._agree(err, version)
        if self.coordinator:
            self.producer.resume_engines()
        if stats is not None:
            stats.blocking_s = time.perf_counter() - t0
        return stats

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
