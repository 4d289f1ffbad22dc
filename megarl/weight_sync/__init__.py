"""Bucketed, optionally double-buffered weight sync from the Megatron trainer to rollout engines,
over stock SGLang's weight-update contract.

protocol (wire contract, config, errors) · buckets (flattened-bucket packing) · producer (one
trainer stage's sender) · transports (the engine link: SGLang's HTTP endpoints) · trainer (the
Megatron glue every trainer rank calls). The receiving side is megarl.rollout.weights and
engine. See docs/weight_sync.md.
"""
from .protocol import BucketMeta, SyncConfig, WeightSyncError

__all__ = ["BucketMeta", "SyncConfig", "WeightSyncError"]
