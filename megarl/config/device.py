"""Which device a run uses, and the precision that follows from it.

This module owns two decisions made once, while the config loads, so that no consumer (the
placement, torchrun, the preflight, the backends) ever sees ``auto`` or a null dtype:

- ``trainer.device: auto`` (the default) becomes ``cuda`` when torch sees a GPU in this
  process and ``cpu`` otherwise, said in one log line. Explicit ``cpu`` / ``cuda`` are kept.
- A Megatron model's ``params_dtype`` left null (the default, in the actor, reference and
  critic sections) becomes ``bfloat16`` on cuda, as verl's defaults are, and ``float32`` on
  cpu (CPU kernels are slow in bf16 and the CPU tests compare float32 values). The rollout's
  ``dtype: auto`` already means the actor's dtype, so the engines follow. A value the user
  gave always wins.

``check_node_devices`` is the machine half: a cuda run asking for more devices per node than
this node has is refused before any work (``preflight`` calls it; a dry run, which plans a
cluster's run on any machine, does not).

The GPU count is a parameter of every function here (``cuda_devices``; None asks torch), so
tests exercise the cuda branch on a CPU machine without touching torch.
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Optional

from megarl.config.errors import ConfigError
from megarl.config.schema import MEGATRON_SECTIONS

logger = logging.getLogger(__name__)

DTYPE_BY_DEVICE = {"cuda": "bfloat16", "cpu": "float32"}
_said: set[str] = set()  # the lines `announce` has logged in this process


def cuda_device_count() -> int:
    """CUDA devices torch sees in this process (CUDA_VISIBLE_DEVICES applied).

    torch counts through NVML where it can, without initialising CUDA here: the driver and
    `megarl config` stay free to fork workers that use the GPUs."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" or not _gpu_driver_present():
        # torch could see none; importing it (~1.5 s) would only slow `megarl config` down
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def _gpu_driver_present() -> bool:
    """A GPU driver's device node exists (NVIDIA's, or ROCm's that torch.cuda also uses)."""
    return os.path.exists("/dev/nvidiactl") or bool(glob.glob("/dev/nvidia[0-9]*")) or \
        os.path.exists("/dev/kfd")


def resolve_device(cfg, cuda_devices: Optional[int] = None) -> Optional[str]:
    """Replace ``trainer.device: auto`` and null ``params_dtype`` in ``cfg`` (in place).

    Returns the line that says what ``auto`` became (None if the device was given), for
    ``announce`` once the config is known to be valid: a refused config's one line of
    error stays the only line it prints."""
    t, line = cfg.trainer, None
    if t.device == "auto":
        n = cuda_device_count() if cuda_devices is None else cuda_devices
        t.device = "cuda" if n > 0 else "cpu"
        line = f"trainer.device=auto: {t.device} ({n} GPU{'' if n == 1 else 's'} visible)"
    dtype = DTYPE_BY_DEVICE.get(t.device)
    if dtype is None:
        return line  # not a device: validate_config names the key and the choices
    for section in MEGATRON_SECTIONS:
        node = _select(cfg, section)
        if node is not None and node.params_dtype is None:
            node.params_dtype = dtype
    return line


def announce(line: Optional[str]) -> None:
    """Log what ``auto`` resolved to, once per process (`megarl plan` loads a config for every
    layout it weighs)."""
    if line is not None and line not in _said:
        _said.add(line)
        logger.info(line)


def check_node_devices(cfg, cuda_devices: Optional[int] = None) -> None:
    """Refuse a cuda run that asks for more devices per node than this node has.

    Checked where this process runs on one of the run's nodes: under torchrun (every rank
    does), and on one node (the driver is the node). A multi-node Ray driver may run on a
    head without GPUs; there Ray's placement groups wait for the devices and
    ``trainer.placement_timeout_s`` names them."""
    t = cfg.trainer
    if t.device != "cuda" or (t.launcher != "torchrun" and t.nnodes > 1):
        return
    n = cuda_device_count() if cuda_devices is None else cuda_devices
    if t.n_gpus_per_node > n:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        mask = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        fix = (f"set trainer.n_gpus_per_node={n}" if n else
               "set trainer.device=cpu (or auto)")
        raise ConfigError(
            f"trainer.n_gpus_per_node: {t.n_gpus_per_node} asked, but this node has {n} visible "
            f"CUDA device{'' if n == 1 else 's'}{mask} with trainer.device=cuda; {fix}, or run "
            f"on a node with more")


def _select(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node.get(part) if node is not None else None
    return node
