"""The staleness limit: which samples are too many weight versions behind to train on.

Pure: per-token versions in, a keep mask and counts out. Whether the dropped samples are then
discarded or sent back for regeneration is the caller's choice (the buffer owns sample
staleness; this only decides). A sample's staleness is measured on its *oldest* response token
(trainer_version - min token version): a partial rollout resumed under newer weights is as
stale as the first token it kept.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch

from .advantages import group_index


def sample_staleness(token_versions: torch.Tensor, response_mask: torch.Tensor,
                     trainer_version: int) -> torch.Tensor:
    """[N] versions behind the trainer of each sample's oldest response token (long).

    A row without response tokens has staleness 0."""
    valid = response_mask > 0
    big = torch.iinfo(torch.long).max
    oldest = torch.where(valid, token_versions.long(), big).amin(-1)
    return torch.where(valid.any(-1), trainer_version - oldest, 0)


def staleness_mask(token_versions: torch.Tensor, response_mask: torch.Tensor,
                   trainer_version: int, max_staleness: int | None,
                   group_ids: Sequence[Hashable] | torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """keep [N] bool: staleness <= `max_staleness` (None: keep all), and counts.

    With `group_ids`, a group is kept whole or dropped whole (any member too stale drops the
    group), so group-relative advantages keep their group size. Metrics:
    ``rollout/stale_dropped`` (samples dropped), ``rollout/stale_dropped_frac``,
    ``rollout/stale_kept``."""
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
    behind = sample_staleness(token_versions, response_mask, trainer_version)
    keep = torch.ones_like(behind, dtype=torch.bool)
    if max_staleness is not None:
        keep = behind <= max_staleness
    if group_ids is not None:
        idx, n_groups = group_index(group_ids)
        idx = idx.to(keep.device)
        if idx.numel() != keep.numel():
            raise ValueError(f"{keep.numel()} samples but {idx.numel()} group ids")
        bad = torch.zeros(n_groups, dtype=torch.long, device=keep.device)
        bad.index_add_(0, idx, (~keep).long())
        keep = bad[idx] == 0
    n = keep.numel()
    dropped = int((~keep).sum())
    return keep, {"rollout/stale_dropped": float(dropped),
                  "rollout/stale_dropped_frac": dropped / n if n else 0.0,
                  "rollout/stale_kept": float(n - dropped)}
