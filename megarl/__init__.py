"""megarl: asynchronous RL post-training of LLMs (Megatron-core trains, SGLang generates)."""

__version__ = "0.1.0"
