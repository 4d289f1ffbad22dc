"""Advantage estimators: rewards in, token-level advantages [N, T] out.

Owns: grouping samples by prompt uid, the outcome-reward estimators (GRPO, Dr. GRPO, RLOO,
REINFORCE++ and REINFORCE++-baseline, and verl 0.9.1's Pass@k GRPO, OPO, GPG and GDPO), GAE on a
critic's values (`gae_advantages`), spreading a sample-level advantage over its response
tokens, and the one dispatcher `compute_advantages` keyed by ``algorithm.adv_estimator``.
GDPO takes per-component rewards: the other numbers of the dict a reward function returns
(the reward pool keeps them beside the ``"score"``), picked by ``algorithm.gdpo_reward_keys``.

Conventions:
- `rewards` is [N] (one scalar score per sample) or [N, T] (token-level rewards, e.g. the score
  at the last response token minus a per-token KL penalty, see `kl.apply_kl_in_reward`).
  Group estimators use a sample's *sum* of token rewards over its response; REINFORCE++ places
  a sample-level reward on the last response token.
- `group_ids` names each sample's group (the prompt's uid): a list of hashables, or a tensor.
- `response_mask` [N, T] is 1 on the response tokens; advantages are exactly 0 elsewhere.
- GRPO's std is the unbiased sample std (Bessel, as `torch.std` and verl).
- A group whose rewards are all equal carries no signal: its advantages are exactly 0 (checked
  on the group's range, so rounding in the mean cannot leak a tiny nonzero value). A group of
  one sample is treated the same way (its baseline is its own reward), so it contributes 0 —
  verl instead passes a singleton's raw reward through (and raises for Pass@k); we do not,
  because a one-sample "group" has no baseline to compare with.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch

ADV_ESTIMATORS = ("grpo", "drgrpo", "rloo", "rloo_vectorized", "reinforce_plus_plus",
                  "reinforce_plus_plus_baseline", "gae", "grpo_passk", "opo", "gpg", "remax",
                  "gdpo")
GroupIds = Sequence[Hashable] | torch.Tensor


def group_index(group_ids: GroupIds) -> tuple[torch.Tensor, int]:
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


def _prepare(rewards: torch.Tensor, group_ids: GroupIds
             ) -> tuple[torch.Tensor, torch.Tensor, int]:
    rewards = torch.as_tensor(rewards).detach().float().reshape(-1)
    idx, n_groups = group_index(group_ids)
    if idx.numel() != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards but {idx.numel()} group ids")
    return rewards, idx.to(rewards.device), n_groups


def _constant_group(rewards: torch.Tensor, idx: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Per-sample: does the sample's group hold one reward value only (incl. singletons)?"""
    hi = rewards.new_full((n_groups,), -torch.inf).scatter_reduce(0, idx, rewards, "amax")
    lo = rewards.new_full((n_groups,), torch.inf).scatter_reduce(0, idx, rewards, "amin")
    return (hi == lo)[idx]


def grpo_advantages(rewards: torch.Tensor, group_ids: GroupIds, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO: adv_i = (r_i - mean_g) / (std_g + eps) with `norm_by_std`, else r_i - mean_g.

    `rewards` [N] float; returns [N] in float32 (no gradient flows through advantages)."""
    rewards, idx, n_groups = _prepare(rewards, group_ids)
    mean, std, _ = group_mean_std(rewards, idx, n_groups)
    adv = rewards - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return adv.masked_fill(_constant_group(rewards, idx, n_groups), 0.0)


def drgrpo_advantages(rewards: torch.Tensor, group_ids: GroupIds) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): adv_i = r_i - mean_g.

    Differs from GRPO in exactly two places, one here and one in the loss:
    1. no division by the group std (which up-weights groups whose rewards barely differ,
       i.e. questions that are too easy or too hard) — this function;
    2. no per-sequence 1/|o_i| length normalisation in the loss (which shrinks the gradient of
       long wrong answers, so they grow) — that is the loss aggregation, not the advantage:
       use ``loss_agg_mode`` ``seq-mean-token-sum`` (Dr. GRPO's sum over tokens / number of
       sequences, without its constant 1/max_len, which only rescales the learning rate) or
       ``token-mean``; ``seq-mean-token-mean`` reintroduces GRPO's length bias
       (`LENGTH_NORMALISED_AGG_MODES`).
    Identical to ``grpo_advantages(..., norm_by_std=False)``."""
    return grpo_advantages(rewards, group_ids, norm_by_std=False)


LENGTH_NORMALISED_AGG_MODES = ("seq-mean-token-mean",)


def rloo_advantages(rewards: torch.Tensor, group_ids: GroupIds) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): adv_i = r_i - mean_{j in g, j != i} r_j.

    Equals n/(n-1) * (r_i - mean_g) for a group of n; the baseline excludes the sample itself,
    so it is independent of r_i and the estimate unbiased. Singletons give 0 (no other sample
    to form a baseline; verl uses baseline 0 there). Returns [N] float32."""
    rewards, idx, n_groups = _prepare(rewards, group_ids)
    mean, _, count = group_mean_std(rewards, idx, n_groups)
    adv = (rewards - mean) * count / (count - 1).clamp(min=1)
    return adv.masked_fill(_constant_group(rewards, idx, n_groups), 0.0)


def grpo_passk_advantages(rewards: torch.Tensor, group_ids: GroupIds, norm_by_std: bool = True,
                          eps: float = 1e-6) -> torch.Tensor:
    """Pass@k GRPO (Walder & Karkhanis 2025, arXiv 2503.19595; verl's ``grpo_passk``).

    Trains for the best of the group, not the average: a group's pass@k reward is its best
    sample's reward, and only that sample changes it, by how far it beats the runner-up. So the
    unique best sample gets r_max - r_second (divided by std_g + eps with `norm_by_std`) and
    every other sample 0; a best reward two samples share gives 0 to all (either alone keeps
    the max). k is the group size (``rollout.n``); there is no key of its own. Singletons give
    0 (verl raises; config validation refuses ``rollout.n`` < 2). Returns [N] float32."""
    rewards, idx, n_groups = _prepare(rewards, group_ids)
    _, std, count = group_mean_std(rewards, idx, n_groups)
    best = rewards.new_full((n_groups,), -torch.inf).scatter_reduce(0, idx, rewards, "amax")
    is_best = rewards == best[idx]
    n_best = _group_sum(is_best.float(), idx, n_groups)[idx]
    runner_up = rewards.new_full((n_groups,), -torch.inf).scatter_reduce(
        0, idx, rewards.masked_fill(is_best, -torch.inf), "amax")
    unique_best = is_best & (n_best == 1) & (count > 1)  # there runner_up is finite, std > 0
    margin = (best - runner_up)[idx]
    if norm_by_std:
        margin = margin / (std + eps)
    return torch.where(unique_best, margin, torch.zeros_like(rewards))


def opo_advantages(rewards: torch.Tensor, group_ids: GroupIds, lengths: torch.Tensor
                   ) -> torch.Tensor:
    """OPO (Hao et al. 2025, arXiv 2505.23585; verl's ``opo``): adv_i = r_i - b_g with the
    length-weighted baseline b_g = sum_j |o_j| r_j / sum_j |o_j|.

    The variance-minimising baseline of a sequence reward weighs each sample by its squared
    score-function norm; OPO takes that to grow with the response length |o_j| (`lengths` [N]:
    response tokens, verl's ``response_mask.sum(-1)``). Constant groups and singletons give 0;
    a group without response tokens gets baseline 0 (verl: 0/0, NaN), which is moot, as its
    rows have no token to carry an advantage. Returns [N] float32."""
    rewards, idx, n_groups = _prepare(rewards, group_ids)
    w = torch.as_tensor(lengths).to(rewards).reshape(-1)
    total = _group_sum(w, idx, n_groups).clamp(min=1)  # token counts: 0 or at least 1
    baseline = _group_sum(w * rewards, idx, n_groups) / total
    adv = rewards - baseline[idx]
    count = _group_sum(torch.ones_like(rewards), idx, n_groups)[idx]
    return adv.masked_fill(_constant_group(rewards, idx, n_groups) | (count < 2), 0.0)


def gpg_advantages(rewards: torch.Tensor, group_ids: GroupIds) -> torch.Tensor:
    """GPG (Chu et al. 2025, arXiv 2504.02546; verl's ``gpg``): adv_i = alpha * (r_i - mean_g).

    No std division (as Dr. GRPO). alpha = N / #{i : r_i != 0} over the whole batch given (1
    when no reward is nonzero), verl's correction that scales the gradient up when few
    samples carry a reward; verl's ``f_norm`` divisor is always 1 there (its trainer passes
    none), so it is left out. GPG's objective also drops PPO's ratio and clip: that is
    ``actor.policy_loss.loss_mode=gpg``, set on its own. Constant groups and singletons give
    0. Returns [N] float32."""
    rewards, idx, n_groups = _prepare(rewards, group_ids)
    alpha = rewards.numel() / torch.count_nonzero(rewards).clamp(min=1)
    return alpha * drgrpo_advantages(rewards, idx)


def gdpo_advantages(components: torch.Tensor, group_ids: GroupIds,
                    response_mask: torch.Tensor, weights: Sequence[float] | None = None,
                    norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GDPO (arXiv 2601.05242; verl's ``gdpo``): each reward component is normalised within
    its group as GRPO does, the components are summed with `weights` (default 1 each), and the
    sum, spread over the response, is whitened over the batch's valid tokens.

    Normalising each component before summing keeps one with a large spread (say accuracy)
    from drowning one with a small spread (say format). `components` [K, N] holds sample i's
    K component scores (verl: the ``algorithm.gdpo_reward_keys`` entries of the reward
    function's returned dict). verl's trainer never passes ``norm_adv_by_std_in_grpo`` to
    it, so a verl run always divides by the std; the default here does the same. Returns
    [N, T] float32."""
    mask = response_mask.float()
    components = torch.as_tensor(components).detach().float()
    w = [1.0] * components.shape[0] if weights is None else list(weights)
    if not w or len(w) != components.shape[0]:
        raise ValueError(f"{len(w)} weights for {components.shape[0]} reward components")
    adv = sum(wk * grpo_advantages(c, group_ids, norm_by_std, eps)
              for wk, c in zip(w, components))
    return masked_whiten(broadcast_to_tokens(adv.to(mask.device), mask), mask, eps)


def sample_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N] scores from [N] (as is) or [N, T] token rewards (summed over the response)."""
    rewards = torch.as_tensor(rewards).detach().float()
    if rewards.dim() == 1:
        return rewards
    return (rewards * response_mask.to(rewards.dtype)).sum(-1)


def token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N, T] token rewards: masked as is, or a sample's score [N] on its last response token.

    A row without response tokens gets no reward anywhere."""
    rewards = torch.as_tensor(rewards).detach().float()
    mask = response_mask.to(rewards.device).float()
    if rewards.dim() == 2:
        return rewards * mask
    if rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"{rewards.shape[0]} rewards but mask {tuple(mask.shape)}")
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, pos, -1).amax(-1)  # -1: no response
    out = torch.zeros_like(mask)
    rows = (last >= 0).nonzero().squeeze(-1)
    out[rows, last[rows]] = rewards[rows]
    return out


def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor,
                       gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum_{k >= t, k in response} gamma^(k - t) r_k per row, 0 outside the response.

    Masked positions carry no reward and are skipped by the discount (the response's tokens
    are treated as contiguous steps even if the mask has holes)."""
    mask = response_mask.to(token_rewards.dtype)
    r = token_rewards * mask
    out = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        step = mask[:, t]
        running = torch.where(step > 0, r[:, t] + gamma * running, running)
        out[:, t] = running * step
    return out


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(v - mean) / (std + eps) over the valid tokens of the whole tensor; 0 off the mask.

    mean and unbiased std are taken over *tokens* (a sample counts once per response token).
    Constant values (incl. one valid token, or none) give exactly 0, never NaN."""
    mask = mask.to(values.dtype)
    valid = mask > 0
    n = mask.sum()
    if n == 0:
        return torch.zeros_like(values)
    v = values[valid]
    if bool(v.max() == v.min()):
        return torch.zeros_like(values)
    mean = v.sum() / n
    std = torch.sqrt(((v - mean) ** 2).sum() / (n - 1).clamp(min=1))
    return (values - mean) / (std + eps) * mask


def reinforce_plus_plus_advantages(rewards: torch.Tensor, response_mask: torch.Tensor,
                                   gamma: float = 1.0, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): token-level discounted returns, whitened over the batch.

    adv[i, t] = (G[i, t] - mean) / (std + eps), G from `discounted_returns` of the token rewards
    (a sample score [N] sits on the last response token), mean/std over every valid response
    token of every sample in the tensors given (pass the whole step's batch, not a
    mini-batch). No prompt grouping. Returns [N, T] float32."""
    mask = response_mask.float()
    g = discounted_returns(token_rewards(rewards, mask), mask, gamma)
    return masked_whiten(g, mask, eps)


def reinforce_plus_plus_baseline_advantages(rewards: torch.Tensor, group_ids: GroupIds,
                                            response_mask: torch.Tensor, eps: float = 1e-6
                                            ) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean (r_i - mean_g, as Dr. GRPO), spread over
    the response tokens, then whiten over all valid tokens of the batch (`masked_whiten`).

    No discounting (an outcome reward per sample). Returns [N, T] float32."""
    mask = response_mask.float()
    adv = drgrpo_advantages(sample_rewards(rewards, mask), group_ids)
    return masked_whiten(broadcast_to_tokens(adv, mask), mask, eps)


def broadcast_to_tokens(adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sample-level advantages [N] -> token-level [N, T], zero outside the response."""
    if adv.dim() != 1 or adv.shape[0] != response_mask.shape[0]:
        raise ValueError(f"advantages {tuple(adv.shape)} do not match mask "
                         f"{tuple(response_mask.shape)}")
    return adv.unsqueeze(-1) * response_mask.to(adv.dtype)


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor,
                   response_mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0,
                   whiten: bool = True, eps: float = 1e-6
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) -> (advantages, returns), both [N, T] float32, 0 off the mask.

    Per row, walking the response backwards over its *valid* tokens only (verl's
    `compute_gae_advantage_return`: a masked position neither discounts nor resets, the next
    valid token's value and advantage carry across it):

        delta_t = r_t + gamma * V_next - V_t           (V_next = 0 after the last valid token)
        A_t     = delta_t + gamma * lam * A_next
        R_t     = A_t + V_t                            (the critic's regression target)

    `values[i, t]` is the critic's value of the state *before* token t is generated (the
    prefix input_ids[:t]), in the same token alignment as `token_rewards` and the mask; see
    `megarl.backends.megatron.worker.MegatronWorker.compute_values`. Advantages are then
    whitened over every valid token of the batch (`masked_whiten`, as verl does; returns are
    not). Pass the whole step's batch."""
    mask = response_mask.to(torch.float32)
    r = torch.as_tensor(token_rewards).detach().float() * mask
    v = values.detach().float() * mask
    adv = torch.zeros_like(r)
    next_v = r.new_zeros(r.shape[0])
    next_a = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        step = mask[:, t] > 0
        a_t = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        next_v = torch.where(step, v[:, t], next_v)
        next_a = torch.where(step, a_t, next_a)
        adv[:, t] = torch.where(step, a_t, torch.zeros_like(a_t))
    returns = (adv + v) * mask
    if whiten:
        adv = masked_whiten(adv, mask, eps)
    return adv, returns


# The outcome estimators that give one advantage per sample from its group:
# name -> f(scores [N], group_ids, response_mask [N, T], norm_by_std, eps) -> [N].
# rloo_vectorized is verl's second implementation of RLOO; it differs from verl's ``rloo``
# only on singletons (0 there, as megarl's rloo), so it is megarl's rloo under that name.
_SAMPLE_ESTIMATORS = {
    "grpo": lambda r, g, mask, norm, eps: grpo_advantages(r, g, norm, eps),
    "drgrpo": lambda r, g, mask, norm, eps: drgrpo_advantages(r, g),
    "rloo": lambda r, g, mask, norm, eps: rloo_advantages(r, g),
    "rloo_vectorized": lambda r, g, mask, norm, eps: rloo_advantages(r, g),
    "grpo_passk": lambda r, g, mask, norm, eps: grpo_passk_advantages(r, g, norm, eps),
    "opo": lambda r, g, mask, norm, eps: opo_advantages(r, g, mask.sum(-1)),
    "gpg": lambda r, g, mask, norm, eps: gpg_advantages(r, g),
}


def remax_advantages(rewards: torch.Tensor, baselines: torch.Tensor,
                     response_mask: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al. 2023): each response token's return (the rewards from it to the end;
    an outcome reward's whole score) minus the reward of its prompt's greedy response,
    `baselines` [N] (generated and scored beside the step's samples,
    `TrajectoryRunner.prompts(remax=True)`). verl 0.9.1's ``remax`` (core_algos.py:735);
    0 off the response (megarl's masks cover the prompt too, verl's only the response)."""
    mask = response_mask.float()
    tr = token_rewards(rewards, mask)
    returns = tr.flip(-1).cumsum(-1).flip(-1)
    base = torch.as_tensor(baselines, dtype=torch.float32, device=mask.device)
    return (returns - base.unsqueeze(-1)) * mask


def compute_advantages(name: str, rewards: torch.Tensor, group_ids: GroupIds | None,
                       response_mask: torch.Tensor, *, norm_by_std: bool = True,
                       gamma: float = 1.0, eps: float = 1e-6, lam: float = 1.0,
                       values: torch.Tensor | None = None,
                       baselines: torch.Tensor | None = None,
                       components: torch.Tensor | None = None,
                       component_weights: Sequence[float] | None = None) -> torch.Tensor:
    """Token-level advantages [N, T] (float32, 0 off the response) for estimator `name`.

    `name` is ``algorithm.adv_estimator``. `norm_by_std` (``norm_adv_by_std_in_grpo``) applies
    to ``grpo`` and ``grpo_passk`` only (verl reads it for no other estimator); `gamma` to
    ``reinforce_plus_plus`` and ``gae`` only (any other estimator with gamma != 1 raises
    rather than silently ignore it); `lam` and the critic's `values` [N, T] to ``gae`` only
    (its returns come from `gae_advantages`); `group_ids` may be None for
    ``reinforce_plus_plus`` and ``gae``. Pass the whole step's batch: the batch-normalised
    estimators, the group baselines and GPG's batch-wide scale need all of it."""
    mask = response_mask.float()
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown algorithm.adv_estimator {name!r}; choose from "
                         f"{ADV_ESTIMATORS}")
    if name == "gae":
        if values is None:
            raise ValueError("adv_estimator='gae' needs the critic's values")
        return gae_advantages(token_rewards(rewards, mask), values, mask, gamma, lam,
                              eps=eps)[0]
    if gamma != 1.0 and name != "reinforce_plus_plus":
        raise ValueError(f"algorithm.gamma={gamma} has no effect with adv_estimator={name!r} "
                         "(outcome rewards, no discounting); set it to 1.0")
    if name == "reinforce_plus_plus":
        return reinforce_plus_plus_advantages(rewards, mask, gamma, eps)
    if name == "remax":
        if baselines is None:
            raise ValueError("adv_estimator='remax' needs each sample's greedy baseline reward")
        return remax_advantages(rewards, baselines, mask)
    if group_ids is None:
        raise ValueError(f"adv_estimator={name!r} needs group_ids (prompt uids)")
    if name == "gdpo":
        if components is None:
            raise ValueError("adv_estimator='gdpo' needs each sample's reward components")
        return gdpo_advantages(components, group_ids, mask, component_weights, norm_by_std, eps)
    if name == "reinforce_plus_plus_baseline":
        return reinforce_plus_plus_baseline_advantages(rewards, group_ids, mask, eps)
    adv = _SAMPLE_ESTIMATORS[name](sample_rewards(rewards, mask), group_ids, mask,
                                   norm_by_std, eps)
    return broadcast_to_tokens(adv.to(mask.device), mask)
