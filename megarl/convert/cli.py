"""Command lines of the checkpoint converters (tools/convert_*.py and `megarl convert`).

Each validates its inputs first (plan.py: paths, config.json, TP/PP/EP divisibility, tensor
shapes), in the launching process, so a mistake fails before any rank starts. `--dry-run`
stops there and reports the sizes (a table in the log, `--json` also prints them on stdout);
nothing is written and no torchrun is started. Otherwise the converter runs itself under
torchrun when the layout needs more than one rank (TP×PP, or with expert parallelism
PP × lcm(TP, EP×ETP): plan.world_size; see megarl.utils.launch), so the user types the same
command for any split.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from .plan import ConvertError

DTYPE_CHOICES = ["float32", "bfloat16", "float16"]
EXIT_USAGE = 2

logger = logging.getLogger(__name__)


def _parser(prog, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--dry-run", action="store_true",
                   help="validate the inputs and report tensor counts and sizes (source, "
                   "output, largest rank); write nothing, start no ranks")
    p.add_argument("--json", action="store_true",
                   help="with --dry-run: also print the report as JSON on stdout")
    p.add_argument("--progress", action="store_true", default=None,
                   help="draw a progress bar on stderr even when it is not a terminal "
                   "(default: a bar on a terminal, a log line per 10%% otherwise)")
    return p


def _layout_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--tp", type=int, default=1, help=f"tensor-parallel size {what}")
    p.add_argument("--pp", type=int, default=1, help=f"pipeline-parallel size {what}")
    p.add_argument("--vpp", type=int, default=None,
                   help=f"model chunks per pipeline stage {what} (a virtual pipeline, "
                   "megatron.virtual_pipeline_model_parallel_size; needs --pp >= 2). Only "
                   "the work's layout: a checkpoint holds global layer indices, so one saved "
                   "at any VPP reads back at any other")
    p.add_argument("--ep", type=int, default=1,
                   help=f"expert-parallel size {what} (a mixture of experts: each EP rank holds "
                   "num_experts/EP experts of every layer)")
    p.add_argument("--etp", type=int, default=None,
                   help=f"expert tensor-parallel size {what}: the ranks each expert is split "
                   "over (default: --tp)")


def _run(a: argparse.Namespace, plan_fn, convert_fn) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        plan = plan_fn()
    except ConvertError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if a.dry_run:
        logger.info("%s", plan.table())
        if a.json:
            print(json.dumps(plan.to_dict(), indent=2))
        return 0
    if a.json:
        logger.warning("--json only applies to --dry-run; ignored")
    for note in plan.notes:
        logger.info("note: %s", note)
    from megarl.utils.launch import ensure_world

    # with EP the world can exceed TP×PP: data-parallel ranks the expert groups span
    ensure_world(plan.ranks)
    from megarl.backends.megatron.parallel import rank_program

    with rank_program():
        convert_fn()
    return 0


def hf_to_megatron_main(argv=None, prog=None) -> int:
    p = _parser(prog, "Convert an HF safetensors model to a Megatron dist-checkpoint at the "
                "given TP/PP (and EP/ETP for a mixture of experts).")
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="checkpoint directory to write (atomically)")
    _layout_args(p, "of the checkpoint")
    p.add_argument("--params-dtype", default="float32", choices=DTYPE_CHOICES)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    a = p.parse_args(argv)
    from . import plan

    def convert():
        from .checkpoints import hf_to_mcore

        hf_to_mcore(a.hf_dir, a.out, a.tp, a.pp, a.params_dtype,
                    a.make_vocab_size_divisible_by, progress=a.progress, ep=a.ep, etp=a.etp,
                    vpp=a.vpp)

    return _run(a, lambda: plan.plan_hf2mcore(a.hf_dir, a.out, a.tp, a.pp, a.params_dtype,
                                              a.make_vocab_size_divisible_by, a.ep, a.etp),
                convert)


def megatron_to_hf_main(argv=None, prog=None) -> int:
    p = _parser(prog, "Convert a megarl Megatron dist-checkpoint (any TP/PP/EP) to an HF "
                "safetensors model; it is read at --tp/--pp/--ep (default 1/1/1 reshards any "
                "split). Optimizer state is not exported.")
    p.add_argument("--ckpt", required=True, help="megarl Megatron checkpoint directory")
    p.add_argument("--out", required=True, help="HF model directory to write (atomically)")
    _layout_args(p, "to read the checkpoint at")
    p.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                   help="cast the exported tensors (default: keep the checkpoint's dtype)")
    a = p.parse_args(argv)
    from . import plan

    def convert():
        from .checkpoints import mcore_to_hf

        mcore_to_hf(a.ckpt, a.out, a.tp, a.pp, a.dtype, progress=a.progress, ep=a.ep,
                    etp=a.etp, vpp=a.vpp)

    return _run(a, lambda: plan.plan_mcore2hf(a.ckpt, a.out, a.tp, a.pp, a.dtype, a.ep, a.etp),
                convert)


def reshard_main(argv=None, prog=None) -> int:
    p = _parser(prog, "Rewrite a megarl Megatron dist-checkpoint for another TP/PP/EP layout "
                "(model weights). Optimizer state is dropped with a warning: it is stored per "
                "rank of the old layout, so a run resumed from the output starts its optimizer "
                "fresh.")
    p.add_argument("--ckpt", required=True, help="megarl Megatron checkpoint directory")
    p.add_argument("--out", required=True, help="checkpoint directory to write (atomically)")
    _layout_args(p, "of the new checkpoint")
    a = p.parse_args(argv)
    from . import plan

    def convert():
        from .checkpoints import reshard

        reshard(a.ckpt, a.out, a.tp, a.pp, progress=a.progress, ep=a.ep, etp=a.etp,
                vpp=a.vpp)

    return _run(a, lambda: plan.plan_reshard(a.ckpt, a.out, a.tp, a.pp, a.ep, a.etp), convert)


# `megarl convert <name>`: (entry point, one-line help).
SUBCOMMANDS = {
    "hf2mcore": (hf_to_megatron_main, ("HF safetensors -> Megatron dist-checkpoint at "
                                       "--tp/--pp (--ep/--etp)")),
    "mcore2hf": (megatron_to_hf_main, ("Megatron dist-checkpoint -> HF safetensors "
                                       "(transformers / SGLang)")),
    "reshard": (reshard_main, ("Megatron dist-checkpoint -> the same at another "
                               "--tp/--pp/--ep (optimizer state dropped)")),
}
