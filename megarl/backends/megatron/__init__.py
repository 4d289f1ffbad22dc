"""Megatron-core backend: model from HF config, TP/PP, log-probs, train step, checkpoints."""
import warnings

# Megatron announces at import that the GPU-only extras are absent; on the CPU that is expected.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")

from . import _lazy_jit

# before any module of this package imports megatron.core: its fused kernels compile when
# first called, not at import (1.8 s less start-up per process; see _lazy_jit.py)
_lazy_jit.install()
