"""Every CPU accommodation Megatron-core needs, in one place. Targets megatron-core 0.16.x.

Megatron-core assumes CUDA in a few spots that matter for us (verified on 0.16.1, torch 2.13
CPU, gloo):
- `torch.cuda.current_device()` is used as a device argument when allocating buffers;
- `torch.cuda.synchronize()` is called around pipeline communication;
- `pipeline_parallel/schedules.py` counts tokens in `torch.zeros(..., device="cuda")`;
- `LanguageModule.setup_embeddings_and_output_layer` moves the tied embedding to `.cuda()`
  before syncing it across the first and last pipeline stages.
`apply()` redirects those to the CPU. It is a no-op when CUDA is available, so GPU runs use
Megatron exactly as shipped. The core attention (the local spec's allocates on `cuda`) is
replaced through the layer spec instead, see `attention.py`.
"""
from __future__ import annotations

import functools
import logging
import types

import torch

logger = logging.getLogger(__name__)

TARGET_MEGATRON_CORE = "0.16"
_applied = False


class _CpuTorchShim(types.ModuleType):
    """Stands in for the `torch` name inside one Megatron module: allocations that ask for
    "cuda" land on the CPU; everything else is torch itself."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in ("zeros", "ones", "empty", "tensor", "full"):
            def on_cpu(*args, _fn=attr, **kwargs):
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return _fn(*args, **kwargs)
            return on_cpu
        return attr


def _tensor_cuda_is_identity(fn):
    """Run `fn` with `Tensor.cuda()` returning the tensor itself (CPU-only process)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = saved
    return wrapper


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply() -> None:
    """Install the CPU accommodations (idempotent; no-op with CUDA)."""
    global _applied
    if _applied or cuda_available():
        return
    import megatron.core
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules

    version = getattr(megatron.core, "__version__", "unknown")
    if not version.startswith(TARGET_MEGATRON_CORE):
        logger.warning("CPU patches target megatron-core %s.x, found %s",
                       TARGET_MEGATRON_CORE, version)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    schedules.torch = _CpuTorchShim()
    LanguageModule.setup_embeddings_and_output_layer = _tensor_cuda_is_identity(
        LanguageModule.setup_embeddings_and_output_layer)
    _applied = True
    logger.debug("megatron-core CPU patches applied (megatron-core %s)", version)
