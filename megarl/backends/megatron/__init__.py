"""Megatron-core backend: model from HF config, TP/PP, log-probs, train step, checkpoints."""
import warnings

# Megatron announces at import that the GPU-only extras are absent; on the CPU that is expected.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")
