"""Checkpoint conversion: HF safetensors <-> Megatron dist-checkpoint, any TP/PP on either side.

Both directions run inside a torch.distributed world of TP×PP ranks (tools/ and the CLI set
it up). A Megatron checkpoint stores global tensors with their shard layout, so the TP/PP used
to write it need not match the one used to read it: converting back at TP=1 reshards.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from megarl.backends.megatron.checkpoint import hf_side_dir, read_meta
from megarl.backends.megatron.model import DTYPES
from megarl.backends.megatron.worker import MegatronWorker

from .hf_io import save_hf

logger = logging.getLogger(__name__)


def hf_to_mcore(hf_dir, out_dir, tp: int = 1, pp: int = 1, params_dtype: str = "float32",
                make_vocab_size_divisible_by: int = 128) -> Path:
    if not (Path(hf_dir) / "config.json").is_file():
        raise FileNotFoundError(f"--hf-dir {hf_dir}: no config.json")
    w = MegatronWorker(str(hf_dir), tp, pp, params_dtype=params_dtype, trainable=False,
                       make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    w.save(out_dir, source=str(hf_dir), params_dtype=params_dtype,
           make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    return Path(out_dir)


def mcore_to_hf(ckpt_dir, out_dir, tp: int = 1, pp: int = 1, dtype: str | None = None) -> Path:
    """Write an HF model directory from a Megatron checkpoint (rank 0 writes).

    With PP=1 the tensors stream (one full tensor in memory at a time); with PP>1 each stage's
    tensors are gathered to every rank first, so that path is for models that fit in memory.
    """
    meta = read_meta(ckpt_dir)
    side = hf_side_dir(ckpt_dir)
    w = MegatronWorker(side, tp, pp, params_dtype=meta.get("params_dtype", "float32"),
                       trainable=False, load_hf=False,
                       make_vocab_size_divisible_by=meta.get("make_vocab_size_divisible_by", 128))
    w.load(ckpt_dir)
    out_dtype = DTYPES[dtype] if dtype else None
    if pp == 1:
        tensors = w.export_hf(out_dtype)
    else:
        state = w.full_hf_state()
        tensors = ((k, v if out_dtype is None else v.to(out_dtype)) for k, v in state.items())
    if dist.get_rank() == 0:
        save_hf(out_dir, tensors, side_files_from=side)
        logger.info("wrote HF model to %s", out_dir)
    else:
        for _ in tensors:  # take part in every TP gather rank 0's writer asks for
            pass
    dist.barrier()
    return Path(out_dir)


def compare_hf_dirs(a, b) -> dict[str, float]:
    """Max abs difference per tensor between two HF checkpoints (inf if missing/misshaped)."""
    from .hf_io import HFReader

    ra, rb = HFReader(a), HFReader(b)
    out = {}
    for k in sorted(set(ra.keys()) | set(rb.keys())):
        if k not in ra.where or k not in rb.where:
            out[k] = float("inf")
            continue
        x, y = ra.get(k), rb.get(k)
        out[k] = float("inf") if x.shape != y.shape else \
            (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        if x.dtype != y.dtype:
            out[k] = float("inf")
    return out
