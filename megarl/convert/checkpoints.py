"""Checkpoint conversion: HF safetensors <-> Megatron dist-checkpoint, and resharding.

All three run inside a torch.distributed world of plan.world_size ranks (TP×PP, more with
expert parallelism; tools/ and the CLI set it up). A Megatron checkpoint stores global tensors
with their shard layout (a routed expert under its global index), so the TP/PP/EP used to
write it need not match the one used to read it: `reshard` reads at the new layout and writes
again; converting back to HF at TP=1 EP=1 reshards on the fly. Every output is written into a
temp directory beside the destination and renamed into place when complete.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch.distributed as dist

from megarl.backends.megatron.checkpoint import hf_side_dir, read_meta
from megarl.backends.megatron.model import DTYPES, MoESettings
from megarl.backends.megatron.worker import MegatronWorker

from megarl.backends.megatron.hf import live
from megarl.backends.megatron.hf.hf_io import HFReader, save_hf
from .plan import hf_shapes, numel
from .progress import Progress

logger = logging.getLogger(__name__)

# Keys of megarl_meta.json that describe the layout a checkpoint was written at; save sets them
# (ep / etp for a mixture of experts).
_LAYOUT_KEYS = ("format", "tp", "pp", "vpp", "ep", "etp", "world")


def _rank_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _expert_layout(w: MegatronWorker) -> str:
    """A mixture of experts' layout for the log (" EP=2 ETP=1"); empty for a dense model.
    (save_checkpoint records it in megarl_meta.json.)"""
    if not w.args.is_moe:
        return ""
    return (f" EP={w.ps.get_expert_model_parallel_world_size()}"
            f" ETP={w.ps.get_expert_tensor_parallel_world_size()}")


def hf_to_mcore(hf_dir, out_dir, tp: int = 1, pp: int = 1, params_dtype: str = "float32",
                make_vocab_size_divisible_by: int = 128, progress: bool | None = None,
                ep: int = 1, etp: int | None = None, vpp: int | None = None) -> Path:
    if not (Path(hf_dir) / "config.json").is_file():
        raise FileNotFoundError(f"--hf-dir {hf_dir}: no config.json")
    # an HF critic (ForTokenClassification, verl's form) becomes a Megatron critic
    archs = json.loads((Path(hf_dir) / "config.json").read_text()).get("architectures") or []
    w = MegatronWorker(str(hf_dir), tp, pp, params_dtype=params_dtype, trainable=False,
                       load_hf=False, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                       value_model=any(a.endswith("ForTokenClassification") for a in archs),
                       moe=MoESettings(ep=ep, etp=etp), vpp=vpp)
    # Rank 0's own shard: every rank reads and slices the same number of tensors.
    n = sum(1 for _ in w.model.parameters())
    with Progress("hf2mcore load", n, _rank_bytes(w.model), progress) as bar:
        live.load_hf_into(w.model, w.args, HFReader(hf_dir).get, progress=bar.update)
    t0 = time.monotonic()
    w.save(out_dir, source=str(hf_dir), params_dtype=params_dtype,
           make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    if dist.get_rank() == 0:
        logger.info("hf2mcore: dist-checkpoint written in %.1fs", time.monotonic() - t0)
    return Path(out_dir)


def _load_for_export(ckpt_dir, tp: int, pp: int, ep: int = 1, etp: int | None = None,
                     vpp: int | None = None) -> tuple[MegatronWorker, dict, str]:
    meta = read_meta(ckpt_dir)
    side = hf_side_dir(ckpt_dir)
    w = MegatronWorker(side, tp, pp, params_dtype=meta.get("params_dtype", "float32"),
                       trainable=False, load_hf=False,
                       make_vocab_size_divisible_by=meta.get("make_vocab_size_divisible_by", 128),
                       value_model=bool(meta.get("value_model", False)),
                       moe=MoESettings(ep=ep, etp=etp), vpp=vpp)
    t0 = time.monotonic()
    w.load(ckpt_dir)
    if dist.get_rank() == 0:
        logger.info("read %s at TP=%d PP=%d%s in %.1fs", ckpt_dir, tp, pp, _expert_layout(w),
                    time.monotonic() - t0)
    return w, meta, side


def mcore_to_hf(ckpt_dir, out_dir, tp: int = 1, pp: int = 1, dtype: str | None = None,
                progress: bool | None = None, ep: int = 1, etp: int | None = None,
                vpp: int | None = None) -> Path:
    """Write an HF model directory from a Megatron checkpoint (rank 0 writes).

    With PP=1 the tensors stream (one full tensor in memory at a time); with PP>1 each stage's
    tensors are gathered to every rank first, so that path is for models that fit in memory.
    Optimizer state in the checkpoint is ignored: an HF directory holds weights only.
    A critic's checkpoint (``value_model`` in its meta) becomes `{Arch}ForTokenClassification`
    with ``num_labels=1``: the transformer plus ``score.weight``/``score.bias``, the form
    verl's critic loads with AutoModelForTokenClassification.
    """
    w, meta, side = _load_for_export(ckpt_dir, tp, pp, ep, etp, vpp)
    out_dtype = DTYPES[dtype or meta.get("params_dtype", "float32")]
    if pp == 1:
        tensors = w.export_hf(out_dtype)
    else:
        state = w.full_hf_state()
        tensors = ((k, v.to(out_dtype)) for k, v in state.items())
    if dist.get_rank() == 0:
        shapes = hf_shapes(w.args)
        total = sum(numel(s) for s in shapes.values()) * out_dtype.itemsize
        with Progress("mcore2hf export", len(shapes), total, progress) as bar:
            def counted():
                for k, v in tensors:
                    bar.update(v.numel() * v.element_size())
                    yield k, v
            save_hf(out_dir, counted(), side_files_from=side,
                    config_edit=_as_critic if meta.get("value_model") else None)
        logger.info("wrote HF model to %s", out_dir)
    else:
        for _ in tensors:  # take part in every TP (and EP) gather rank 0's writer asks for
            pass
    dist.barrier()
    return Path(out_dir)


def _as_critic(cfg: dict) -> dict:
    from megarl.backends.megatron.model import CRITIC_ARCHS, ModelArgs

    arch = ModelArgs.from_hf(cfg).arch
    return {**cfg, "architectures": [CRITIC_ARCHS[arch]], "num_labels": 1,
            "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}


def reshard(ckpt_dir, out_dir, tp: int = 1, pp: int = 1, progress: bool | None = None,
            ep: int = 1, etp: int | None = None, vpp: int | None = None) -> Path:
    """Rewrite a Megatron checkpoint for another TP/PP(/EP/ETP) layout (model weights only).

    Reads at the new layout (dist-checkpointing reshards on load) and saves again. Optimizer
    state is dropped with a warning: it is stored per rank of the old layout and cannot be
    split or merged without the optimizer's own sharding logic; training resumed from the
    resharded checkpoint starts the optimizer fresh. `progress` only matters for symmetry
    with the other converters: the load and save are single collective calls, logged as
    phases.
    """
    del progress
    w, meta, _ = _load_for_export(ckpt_dir, tp, pp, ep, etp, vpp)
    if (Path(ckpt_dir) / "optim").is_dir() and dist.get_rank() == 0:
        logger.warning("reshard: dropping the optimizer state in %s (per rank of the old "
                       "layout); a run resumed from %s starts its optimizer fresh",
                       Path(ckpt_dir) / "optim", out_dir)
    keep = {k: v for k, v in meta.items() if k not in _LAYOUT_KEYS}
    t0 = time.monotonic()
    old = {k: meta[k] for k in ("tp", "pp", "ep", "etp") if k in meta}
    if meta.get("vpp", 1) > 1:  # model chunks per stage, where there were any
        old["vpp"] = meta["vpp"]
    w.save(out_dir, **keep, resharded_from=str(Path(ckpt_dir).resolve()),
           resharded_from_layout=old)
    if dist.get_rank() == 0:
        logger.info("reshard: wrote %s at TP=%d PP=%d%s in %.1fs", out_dir, tp, pp,
                    _expert_layout(w), time.monotonic() - t0)
    return Path(out_dir)


def compare_hf_dirs(a, b) -> dict[str, float]:
    """Max abs difference per tensor between two HF checkpoints (inf if missing/misshaped)."""
    from megarl.backends.megatron.hf.hf_io import HFReader

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
