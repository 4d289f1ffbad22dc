"""Bucketed, optionally double-buffered weight sync from the Megatron trainer to rollout engines.

protocol (wire format, config, errors) · buckets (pack/scatter) · producer (trainer stage) ·
consumer (engine side) · transports (HTTP / in-process engine links) · trainer (the Megatron
glue that every trainer rank calls). See docs/weight_sync.md.
"""
from .protocol import BucketMeta, SyncConfig, WeightSyncError

__all__ = ["BucketMeta", "SyncConfig", "WeightSyncError"]
