"""The actor's loss function for `MegatronWorker.train_step`: PPO + entropy + KL-to-ref.

`make_actor_loss(...)` returns ``loss_fn(logprobs, entropy, mb) -> (loss, metrics)``, the
`megarl.backends.megatron.worker.LossFn` contract: `logprobs`/`entropy` are [b, S] aligned with
`mb["input_ids"]` (position t holds log p(input_ids[t] | input_ids[:t]); position 0 is 0), and
the micro-batch dict carries, all [b, S] in the same alignment:

- ``response_mask``     1 on response tokens (the only ones that count);
- ``advantages``        [b, S], or [b] (spread over the response);
- ``old_logprobs``      proximal policy, recomputed by the trainer (LOGP state);
- ``rollout_logprobs``  optional: behaviour policy, the rollout engine's own log-probs; when
                        present the loss is decoupled PPO with a truncated importance weight;
- ``ref_logprobs``      optional: reference policy, needed when ``use_kl_loss``.

    loss = pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss

each term aggregated with ``loss_agg_mode`` and the batch-level ``denom``
(`megarl.algo.aggregate.global_denom` of the whole mini-batch's response mask; None = this
micro-batch's own mean), the diagnostics with ``stats_denom`` (`global_denom` of the mask
under `stats_mode(loss_agg_mode)`; None = ``denom``, which only the count modes allow), so
the returned loss and metrics are this micro-batch's *shares* and the worker's sum over
micro-batches is the mini-batch value. ``actor/entropy`` and ``actor/kl_loss`` are the terms
added to the loss, so they are aggregated like it (a sum under token-sum, the mean over
sequences of token sums / C under seq-mean-token-sum-norm, as verl's ``agg_loss``). Metrics
(all shares):
``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` (dual clip),
``actor/ppo_kl``, ``actor/ratio_mean``, ``actor/entropy`` (when entropy is given),
``actor/kl_loss`` (with ``use_kl_loss``), and with rollout log-probs ``actor/tis_weight_mean``,
``actor/tis_truncated_frac``, ``actor/logp_mismatch`` (mean abs(old - behaviour log-prob): the
rollout-vs-trainer mismatch). Maxima (``actor/ratio_max``, ``actor/tis_weight_max``, the raw
untruncated weight; names in `MAX_METRICS`) are returned only with `with_max_metrics=True`:
they must be reduced over micro-batches with max, not summed, so a caller that sums every
metric must leave them off.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from .aggregate import AGG_MODES, CONSTANT_DENOM_MODES, aggregate
from .kl import KL_KINDS, kl_penalty
from .losses import TIS_LEVELS, aggregate_entropy, ppo_policy_loss

_STAT_NAMES = {"pg_loss": "actor/pg_loss", "clip_frac": "actor/pg_clipfrac",
               "dual_clip_frac": "actor/pg_clipfrac_lower", "ppo_kl": "actor/ppo_kl",
               "ratio_mean": "actor/ratio_mean", "tis_weight_mean": "actor/tis_weight_mean",
               "tis_truncated_frac": "actor/tis_truncated_frac",
               "logp_mismatch": "actor/logp_mismatch"}
_MAX_NAMES = {"ratio_max": "actor/ratio_max", "tis_weight_max": "actor/tis_weight_max"}
MAX_METRICS = tuple(_MAX_NAMES.values())
"""Metric names to reduce with max over micro-batches (and ranks); every other one is summed."""

ActorLossFn = Callable[[torch.Tensor, torch.Tensor | None, dict],
                       tuple[torch.Tensor, dict[str, torch.Tensor]]]


def make_actor_loss(*, clip_ratio_low: float, clip_ratio_high: float,
                    clip_ratio_c: float | None = 3.0, loss_agg_mode: str = "token-mean",
                    entropy_coeff: float = 0.0, use_kl_loss: bool = False,
                    kl_loss_coef: float = 0.001, kl_loss_type: str = "low_var_kl",
                    tis_imp_ratio_cap: float | None = 2.0, tis_level: str = "token",
                    denom: float | None = None, with_max_metrics: bool = False,
                    stats_denom: float | None = None) -> ActorLossFn:
    """Build the actor loss (see the module docstring). `clip_ratio_c=None` disables dual
    clip; `tis_imp_ratio_cap=None` leaves the importance weight untruncated; `tis_level`
    ("token" | "sequence") is the granularity of that weight."""
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose from {AGG_MODES}")
    if denom is not None and stats_denom is None and loss_agg_mode in CONSTANT_DENOM_MODES:
        raise ValueError(f"loss_agg_mode {loss_agg_mode!r} with a batch denom needs stats_denom "
                         f"(global_denom(mask, stats_mode({loss_agg_mode!r})))")
    if use_kl_loss and kl_loss_type not in KL_KINDS:
        raise ValueError(f"unknown kl_loss_type {kl_loss_type!r}; choose from {KL_KINDS}")
    if tis_level not in TIS_LEVELS:
        raise ValueError(f"unknown tis_level {tis_level!r}; choose from {TIS_LEVELS}")
    names = {**_STAT_NAMES, **(_MAX_NAMES if with_max_metrics else {})}

    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, mb: dict):
        mask = mb["response_mask"].to(logprobs.device).float()
        behav = mb.get("rollout_logprobs")
        loss, stats = ppo_policy_loss(
            logprobs, mb["old_logprobs"], mb["advantages"], mask, clip_ratio_low,
            clip_ratio_high, clip_ratio_c, behav_logp=behav, tis_cap=tis_imp_ratio_cap,
            agg=loss_agg_mode, denom=denom, level=tis_level, stats_denom=stats_denom)
        metrics = {name: stats[key] for key, name in names.items() if key in stats}
        if entropy is not None:
            ent = aggregate_entropy(entropy, mask, loss_agg_mode, denom)
            metrics["actor/entropy"] = ent.detach()
            if entropy_coeff:
                loss = loss - entropy_coeff * ent
        elif entropy_coeff:
            raise ValueError("entropy_coeff != 0 needs entropy: call train_step with "
                             "with_entropy=True")
        if use_kl_loss:
            ref = mb.get("ref_logprobs")
            if ref is None:
                raise KeyError("use_kl_loss needs mb['ref_logprobs'] (the REF_LOGP state's "
                               "output)")
            kl = kl_penalty(logprobs.float(), ref.detach().float(), kl_loss_type)
            kl_loss = aggregate(kl, mask, loss_agg_mode, denom)
            metrics["actor/kl_loss"] = kl_loss.detach()
            loss = loss + kl_loss_coef * kl_loss
        return loss, metrics

    return loss_fn


@dataclass(frozen=True)
class ActorLossSettings:
    """`make_actor_loss`'s settings, resolved from the ``actor_rollout_ref.actor`` section once
    (null clip_ratio_low/high: clip_ratio; no ``tis_level``: "token"; null
    ``loss_scale_factor``: the response budget, which is what verl's mask.shape[-1] fallback
    amounts to since it pads responses to it)."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None
    loss_agg_mode: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    tis_imp_ratio_cap: float | None
    tis_level: str
    loss_scale_factor: float | None  # seq-mean-token-sum-norm's constant

    @classmethod
    def from_config(cls, actor_cfg, max_response_length: int | None = None):
        def pick(v):
            return float(actor_cfg.clip_ratio if v is None else v)

        scale = getattr(actor_cfg, "loss_scale_factor", None) or max_response_length
        return cls(pick(actor_cfg.clip_ratio_low), pick(actor_cfg.clip_ratio_high),
                   actor_cfg.clip_ratio_c, actor_cfg.loss_agg_mode, actor_cfg.entropy_coeff,
                   actor_cfg.use_kl_loss, actor_cfg.kl_loss_coef, actor_cfg.kl_loss_type,
                   actor_cfg.tis_imp_ratio_cap, getattr(actor_cfg, "tis_level", "token"),
                   None if scale is None else float(scale))

    def make(self, denom: float | None = None, with_max_metrics: bool = False,
             stats_denom: float | None = None) -> ActorLossFn:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.pop("loss_scale_factor")  # the caller's denominators already hold it
        return make_actor_loss(**fields, denom=denom, with_max_metrics=with_max_metrics,
                               stats_denom=stats_denom)


def make_actor_loss_from_config(actor_cfg, denom: float | None = None,
                                with_max_metrics: bool = False,
                                stats_denom: float | None = None) -> ActorLossFn:
    """`make_actor_loss` from the ``actor_rollout_ref.actor`` config section."""
    return ActorLossSettings.from_config(actor_cfg).make(denom, with_max_metrics, stats_denom)
