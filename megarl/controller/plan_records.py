"""The records the dry run's plan (`megarl.controller.dryrun`) and its memory estimate
(`megarl.controller.memory`) share: a pipeline stage's weight buckets, and a group's memory
items. Plain data, importing neither module, so the estimate needs nothing from the planner
and the planner imports the estimate one way only."""
from __future__ import annotations

from dataclasses import dataclass

from megarl.weight_sync.protocol import BucketMeta


@dataclass(frozen=True)
class StageBuckets:
    stage: int
    layers: range
    buckets: tuple[BucketMeta, ...]

    @property
    def num_tensors(self) -> int:
        return sum(len(b.specs) for b in self.buckets)

    @property
    def largest(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    @property
    def total(self) -> int:
        return sum(b.nbytes for b in self.buckets)


@dataclass(frozen=True)
class MemoryItem:
    label: str
    nbytes: int


@dataclass(frozen=True)
class GroupMemory:
    group: str
    items: tuple[MemoryItem, ...]

    @property
    def total(self) -> int:
        return sum(i.nbytes for i in self.items)
