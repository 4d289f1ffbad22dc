"""Process-group set-up for the Megatron backend: torch.distributed + Megatron parallel_state.

gloo on the CPU, NCCL on GPUs. Works under torchrun (env:// rendezvous) or with an explicit
rank/world/master address, which is how Ray workers and tests start it.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os

import torch
import torch.distributed as dist

from megarl.utils.net import is_loopback, pin_socket_interfaces

logger = logging.getLogger(__name__)


def has_gloo_groups() -> bool:
    """Whether Megatron's gloo twins of its groups are made: on CPU only (on CUDA the NCCL
    groups serve; the distributed optimizer must not ask for gloo ones)."""
    return not torch.cuda.is_available()


def init_distributed(tp: int = 1, pp: int = 1, *, cp: int = 1, ep: int = 1,
                     etp: int | None = None, vpp: int | None = None,
                     rank: int | None = None,
                     world_size: int | None = None, master_addr: str | None = None,
                     master_port: int | None = None, timeout_s: float = 600.0,
                     seed: int = 1234) -> None:
    """Initialise torch.distributed (if not yet) and Megatron's TP/PP/DP groups, and its
    context-parallel groups of `cp` ranks (context_parallel.py), and its
    expert groups for a mixture of experts (`ep` expert-parallel ranks, each expert split over
    `etp` ranks; None: over the TP ranks, Megatron's default); every group times a collective
    out after `timeout_s` (gloo raises; NCCL's watchdog aborts)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from . import _patches

    _patches.apply()
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        os.environ.setdefault("MASTER_ADDR", master_addr or "127.0.0.1")
        if master_port is not None:
            os.environ["MASTER_PORT"] = str(master_port)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # Across hosts, the groups bind the interface that reaches the master, not the
        # hostname's address (often loopback on cluster nodes); see megarl.utils.net.
        if not is_loopback(os.environ["MASTER_ADDR"]):
            iface = pin_socket_interfaces(os.environ["MASTER_ADDR"])
            logger.info("rank %d: process groups on interface %s (toward %s)", rank,
                        os.environ.get("GLOO_SOCKET_IFNAME", iface), os.environ["MASTER_ADDR"])
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
            torch.cuda.set_device(local)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by TP×PP×CP = {tp}×{pp}×{cp}")
    etp = tp if etp is None else etp
    if (world // pp) % (ep * etp):
        raise ValueError(f"world size {world} over PP={pp} is not divisible by EP×ETP = "
                         f"{ep}×{etp}")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(),
                ps.get_expert_tensor_parallel_world_size(),
                ps.get_context_parallel_world_size(),
                ps.get_virtual_pipeline_model_parallel_world_size() or 1)
        if have != (tp, pp, ep, etp, cp, vpp or 1):
            raise RuntimeError(f"Megatron parallel_state already initialised with "
                               f"TP/PP/EP/ETP/CP/VPP {have}, not "
                               f"{(tp, pp, ep, etp, cp, vpp or 1)}")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp,
                                 virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1
                                 else None,
                                 expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp,
                                 create_gloo_process_groups=has_gloo_groups(),
                                 distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)))
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        torch.manual_seed(seed)
        _patches.cpu_rng_tracker()
    logger.info("rank %d/%d: TP=%d PP=%d%s DP=%d%s%s (%s)", dist.get_rank(), world, tp, pp,
                f" VPP={vpp}" if vpp and vpp > 1 else "", ps.get_data_parallel_world_size(),
                f" CP={cp}" if cp > 1 else "",
                f" EP={ep} ETP={etp}" if ep > 1 or etp != tp else "", dist.get_backend())


def destroy_distributed() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def rank_program():
    """The body of a program that makes process groups (torch.distributed's default group,
    Megatron's groups): they are destroyed when the body leaves, normally or by an error.

    Left to interpreter exit, gloo's C++ threads are torn down by static destructors in no set
    order, and a busy machine sometimes aborts the process after its work is done ("terminate
    called without an active exception", SIGABRT): a passing rank reported as failed. Every
    rank program the tests spawn runs inside this (tests/unit/test_rank_programs.py checks)."""
    try:
        yield
    finally:
        destroy_distributed()
