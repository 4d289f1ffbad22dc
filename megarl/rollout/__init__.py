"""Rollout: the engine protocol (protocol.py), the embedded transformers engine (engine.py,
batch.py, sampling.py, weights.py), its SGLang-API HTTP server (server.py) and the manager
that spreads samples over engines (manager.py). See docs/rollout.md."""
from megarl.rollout.protocol import (BadRequest, FinishReason, GenerateOutput, GenerateRequest,
                                     RolloutEngine, SamplingParams, continuation)

__all__ = ["BadRequest", "FinishReason", "GenerateOutput", "GenerateRequest", "RolloutEngine",
           "SamplingParams", "continuation", "EmbeddedEngine", "RolloutManager"]


def __getattr__(name):
    # The engine pulls in torch and transformers; import it only when asked for.
    if name == "EmbeddedEngine":
        from megarl.rollout.engine import EmbeddedEngine
        return EmbeddedEngine
    if name == "RolloutManager":
        from megarl.rollout.manager import RolloutManager
        return RolloutManager
    raise AttributeError(name)
