"""Megatron dist-checkpoint save/load for a worker's model (any TP/PP on either side).

`megatron.core.dist_checkpointing` stores global tensors with their shard layout, so a
checkpoint saved at TP=2 loads at TP=1 (and any other split). Saving is collective; all ranks
write into one temp directory beside the destination and rank 0 renames it into place after a
barrier, so a crash never leaves a half-written checkpoint under the final name.
Its writer forks worker processes: entry points that save need an
`if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.backends.megatron.hf.hf_io import SIDE_FILES, commit_dir

logger = logging.getLogger(__name__)

META = "megarl_meta.json"


def _tmp_name(dst: Path) -> Path:
    # Deterministic so that every rank agrees on it without communicating.
    return dst.with_name(f".{dst.name}.tmp")


def _in_process_write_results() -> None:
    """megarl saves synchronously: the writer's results are put and read back in this process,
    so an in-process queue carries them. Megatron's default, made at a process's first save,
    is a queue served by a spawn-method multiprocessing Manager (for its asynchronous saves):
    a fresh interpreter, ~2.8 s of a tiny model's first save here (0.07 s after it)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(worker, path, **meta) -> Path:
    from megatron.core import dist_checkpointing

    _in_process_write_results()
    dst = Path(path)
    tmp = _tmp_name(dst)
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(worker.model.sharded_state_dict(), str(tmp))
    if worker.optimizer is not None:
        # Optimizer state is per rank (it resumes on the same TP/PP/DP layout).
        (tmp / "optim").mkdir(exist_ok=True)
        torch.save(worker.optimizer.state_dict(), tmp / "optim" / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        side = tmp / "hf"
        side.mkdir()
        for fname in SIDE_FILES:
            src = Path(worker.model_dir) / fname
            if src.is_file():
                shutil.copy2(src, side / fname)
        with open(tmp / META, "w") as f:
            json.dump({"format": "megarl-mcore-v1", "model_dir": str(worker.model_dir),
                       "tp": worker.ps.get_tensor_model_parallel_world_size(),
                       "pp": worker.ps.get_pipeline_model_parallel_world_size(),
                       # context parallelism splits activations only: the weights are those
                       # of CP=1, and a resume at another CP reads them as they are
                       "cp": worker.ps.get_context_parallel_world_size(),
                       # model chunks per stage: the tensors are saved with global layer
                       # indices whatever the chunking, so any layout loads them
                       "vpp": getattr(worker, "vpp", 1),
                       **_expert_layout(worker),
                       # the dtype and vocab padding the model was built with: conversion
                       # rebuilds it from these (it fell back to float32 and 128 without them)
                       "params_dtype": worker.params_dtype,
                       "make_vocab_size_divisible_by": worker.vocab_divisor,
                       "world": dist.get_world_size(), **meta,
                       # where the LR schedule resumes when the optimizer state cannot be used
                       **({"optimizer_steps": worker.optimizer.steps}
                          if worker.optimizer is not None else {})}, f,
                      indent=2)
        commit_dir(tmp, dst)
        logger.info("saved Megatron checkpoint to %s", dst)
    dist.barrier()
    return dst


def _expert_layout(worker) -> dict:
    """A mixture of experts' EP and ETP (experts are sharded over them in the checkpoint the
    same way as over TP: dist-checkpointing reshards them on load)."""
    if not worker.args.is_moe:
        return {}
    return {"ep": worker.ps.get_expert_model_parallel_world_size(),
            "etp": worker.ps.get_expert_tensor_parallel_world_size()}


def read_meta(path) -> dict:
    f = Path(path) / META
    if not f.is_file():
        raise FileNotFoundError(f"{path}: not a megarl Megatron checkpoint (no {META})")
    with open(f) as fh:
        return json.load(fh)


def load_checkpoint(worker, path) -> dict:
    from megatron.core import dist_checkpointing

    meta = read_meta(path)
    state = dist_checkpointing.load(worker.model.sharded_state_dict(), str(path))
    missing, unexpected = worker.model.load_state_dict(state, strict=False)
    # Megatron keeps non-parameter extra state (e.g. `_extra_state`) that may be absent.
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"{path}: checkpoint does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    if worker.optimizer is not None:
        _load_optimizer(worker, Path(path), meta)
    logger.info("loaded Megatron checkpoint %s (saved at TP=%s PP=%s VPP=%s CP=%s%s)", path,
                meta.get("tp"), meta.get("pp"), meta.get("vpp", 1), meta.get("cp", 1),
                f" EP={meta['ep']} ETP={meta['etp']}" if "ep" in meta else "")
    return meta


def _load_optimizer(worker, path: Path, meta: dict) -> None:
    """This rank's optimizer state, where it was saved on this layout by this optimizer;
    otherwise a fresh optimizer whose main params are the loaded weights."""
    optim = path / "optim" / f"rank_{dist.get_rank():05d}.pt"
    # the optimizer's per-rank state follows the layout: experts' moments live on their
    # EP ranks, so EP and ETP count too
    layout = _expert_layout(worker)
    # (a checkpoint from before EP existed was saved at EP=1, ETP=TP)
    saved = (meta.get("ep", 1), meta.get("etp", meta.get("tp"))) if layout else (None, None)
    # and so do the chunks: a rank's optimizer holds its chunks' parameters
    same = (meta.get("tp"), meta.get("pp"), meta.get("vpp", 1), meta.get("world"),
            *saved) == (
        worker.ps.get_tensor_model_parallel_world_size(),
        worker.ps.get_pipeline_model_parallel_world_size(), getattr(worker, "vpp", 1),
        dist.get_world_size(), layout.get("ep"), layout.get("etp"))
    why = None if same else "it was saved on another layout"
    if why is None and not optim.is_file():
        why = "the checkpoint has none"
    if why is None:
        try:
            state = load_optimizer_file(optim, worker._device())
            worker.optimizer.load_state_dict(state)
            return
        except ValueError as e:  # another optimizer, or distributed vs not: checked first
            why = str(e)
    logger.warning("%s: not loading the optimizer state (%s); the optimizer starts fresh",
                   path, why)
    # Megatron's optimizer steps fp32 copies of bf16 weights; they must be the loaded ones.
    worker.optimizer.reload_model_params()
    worker.optimizer.resume_schedule(meta.get("optimizer_steps", 0))


def load_optimizer_file(path: Path, device) -> dict:
    """One rank's optimizer state, as data: tensors, numbers and containers only
    (``weights_only``), never objects that unpickling would build, so a checkpoint from
    elsewhere cannot run code here. Onto `device`: state saved on a GPU loads on a CPU and the
    reverse. Raises `CheckpointError` naming the file when it holds anything else."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{path}: refused: the optimizer state holds something other than tensors, numbers "
            f"and containers ({first}); megarl saves only those, so this file was not written "
            f"by it or was altered") from None


class CheckpointError(RuntimeError):
    """A checkpoint file that megarl will not load."""


def hf_side_dir(path) -> str:
    """The tokenizer/config copy saved with a checkpoint (for conversion back to HF)."""
    return os.fspath(Path(path) / "hf")
