"""Advantage estimators: sample-level scores in, sample-level advantages out.

Owns: grouping samples by prompt uid, GRPO's group-relative advantage, and spreading a
sample-level advantage over its response tokens. Leaves out (for now): Dr. GRPO, RLOO,
REINFORCE++ and GAE; they reuse `group_index` and `broadcast_to_tokens`.

Conventions:
- `rewards` is [N] (one scalar score per sample, e.g. the sum of its token-level rewards).
- `group_ids` names each sample's group (the prompt's uid): a list of hashables, or a tensor.
- GRPO's std is the unbiased sample std (Bessel, as `torch.std` and verl).
- A group whose rewards are all equal carries no signal: its advantages are exactly 0 (the
  `eps` in the denominator keeps 0/0 away). A group of one sample is treated the same way (its
  mean is its own reward), so it contributes 0 — verl instead passes a singleton's raw reward
  through; we do not, because a one-sample "group" has no baseline to compare with.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch


def group_index(group_ids: Sequence[Hashable] | torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map group ids to dense indices 0..G-1 in order of first appearance -> (index [N], G)."""
    if torch.is_tensor(group_ids):
        uniq, inv = torch.unique(group_ids, return_inverse=True)
        return inv.reshape(-1).long(), int(uniq.numel())
    first: dict = {}
    idx = [first.setdefault(g, len(first)) for g in group_ids]
    return torch.tensor(idx, dtype=torch.long), len(first)


def _group_sum(values: torch.Tensor, idx: torch.Tensor, n_groups: int) -> torch.Tensor:
    return values.new_zeros(n_groups).index_add_(0, idx, values)


def group_mean_std(rewards: torch.Tensor, idx: torch.Tensor, n_groups: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, unbiased group std, group size); std is 0 for singletons."""
    count = _group_sum(torch.ones_like(rewards), idx, n_groups)
    mean = _group_sum(rewards, idx, n_groups) / count
    sq = _group_sum((rewards - mean[idx]) ** 2, idx, n_groups)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return mean[idx], std[idx], count[idx]


def grpo_advantages(rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor,
                    norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: adv_i = (r_i - mean_g) / (std_g + eps) with `norm_by_std`, else r_i - mean_g.

    `rewards` [N] float; returns [N] in float32 (no gradient flows through advantages)."""
    rewards = torch.as_tensor(rewards).detach().float().reshape(-1)
    idx, n_groups = group_index(group_ids)
    if idx.numel() != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards but {idx.numel()} group ids")
    idx = idx.to(rewards.device)
    mean, std, _ = group_mean_std(rewards, idx, n_groups)
    adv = rewards - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return adv


def broadcast_to_tokens(adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sample-level advantages [N] -> token-level [N, T], zero outside the response."""
    if adv.dim() != 1 or adv.shape[0] != response_mask.shape[0]:
        raise ValueError(f"advantages {tuple(adv.shape)} do not match mask "
                         f"{tuple(response_mask.shape)}")
    return adv.unsqueeze(-1) * response_mask.to(adv.dtype)
