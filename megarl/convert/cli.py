"""Command lines of the checkpoint converters (tools/convert_*.py and `megarl convert`).

Each runs itself under torchrun with TP×PP ranks when that is more than one (see
megarl.utils.launch), so the user types the same command for any split.
"""
from __future__ import annotations

import argparse
import logging

DTYPE_CHOICES = ["float32", "bfloat16", "float16"]


def _setup(args_tp: int, args_pp: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from megarl.utils.launch import ensure_world

    ensure_world(args_tp * args_pp)


def hf_to_megatron_main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description="Convert an HF safetensors model to a "
                                "Megatron dist-checkpoint at the given TP/PP.")
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="checkpoint directory to write (atomically)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--params-dtype", default="float32", choices=DTYPE_CHOICES)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    a = p.parse_args(argv)
    _setup(a.tp, a.pp)
    from megarl.backends.megatron.parallel import destroy_distributed
    from megarl.convert.checkpoints import hf_to_mcore

    hf_to_mcore(a.hf_dir, a.out, a.tp, a.pp, a.params_dtype, a.make_vocab_size_divisible_by)
    destroy_distributed()
    return 0


def megatron_to_hf_main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description="Convert a megarl Megatron "
                                "dist-checkpoint (any TP/PP) to an HF safetensors model; it is "
                                "read at --tp/--pp (default 1/1 reshards any split).")
    p.add_argument("--ckpt", required=True, help="megarl Megatron checkpoint directory")
    p.add_argument("--out", required=True, help="HF model directory to write (atomically)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                   help="cast the exported tensors (default: keep the checkpoint's dtype)")
    a = p.parse_args(argv)
    _setup(a.tp, a.pp)
    from megarl.backends.megatron.parallel import destroy_distributed
    from megarl.convert.checkpoints import mcore_to_hf

    mcore_to_hf(a.ckpt, a.out, a.tp, a.pp, a.dtype)
    destroy_distributed()
    return 0
