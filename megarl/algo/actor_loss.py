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

pg_loss is ``loss_mode``'s policy loss (`megarl.algo.policy_losses`: verl's modes by verl's
names; vanilla, the default, is `losses.ppo_policy_loss`'s PPO clip), composed with the
truncated importance weight the same way in every mode. `ActorLossSettings.make_for_batch`
builds the loss of one mini-batch from its whole response mask (every denominator below).

verl's ``algorithm.rollout_correction`` (`rollout_correction`, a `RolloutCorrection`): in
decoupled mode with ``rollout_is`` set, the importance weight is the batch's
``rollout_is_weights`` (computed over the step's batch by
`megarl.algo.rollout_correction.actor_batch`, whose rejections are already out of
``response_mask``) instead of megarl's own; with ``bypass_mode`` the policy loss is
`megarl.algo.bypass_loss.bypass_policy_loss` (the rollout log-probs as the old policy), which
also reports ``rollout_corr/...`` token means (shares, normalised by ``token_denom``).

Each term is aggregated with ``loss_agg_mode`` and the batch-level ``denom``
(`megarl.algo.aggregate.global_denom` of the whole mini-batch's response mask; None = this
micro-batch's own mean; sapo's and geo_mean's pg_loss per sequence, with ``seq_denom``, the
batch's sequence count), the diagnostics with ``stats_denom`` (`global_denom` of the mask
under `stats_mode(loss_agg_mode)`; None = ``denom``, which only the count modes allow), so
the returned loss and metrics are this micro-batch's *shares* and the worker's sum over
micro-batches is the mini-batch value. ``actor/entropy`` and ``actor/kl_loss`` are the terms
added to the loss, so they are aggregated like it (a sum under token-sum, the mean over
sequences of token sums / C under seq-mean-token-sum-norm, as verl's ``agg_loss``). Metrics
(all shares):
``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` (dual clip; the other
modes' own meanings, docs/algorithms.md; verl's set of these three for each mode),
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

from .aggregate import AGG_MODES, CONSTANT_DENOM_MODES, aggregate, global_denom, stats_mode
from .kl import KL_KINDS, kl_penalty
from .bypass_loss import bypass_policy_loss
from .losses import TIS_LEVELS, aggregate_entropy
from .policy_losses import PolicyLossParams, check_params, generator_for, mode_entry, policy_loss
from .rollout_correction import RolloutCorrection

_MODE = PolicyLossParams()  # the loss modes' hyper-parameters with verl's defaults

_STAT_NAMES = {"pg_loss": "actor/pg_loss", "clip_frac": "actor/pg_clipfrac",
               "dual_clip_frac": "actor/pg_clipfrac_lower", "ppo_kl": "actor/ppo_kl",
               # the other loss modes' pg_clipfrac_lower (their own meaning; policy_losses)
               "clip_frac_lower": "actor/pg_clipfrac_lower",
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
                    stats_denom: float | None = None, loss_mode: str = "vanilla",
                    tau_pos: float = _MODE.tau_pos, tau_neg: float = _MODE.tau_neg,
                    clip_cov_ratio: float = _MODE.clip_cov_ratio,
                    clip_cov_lb: float = _MODE.clip_cov_lb,
                    clip_cov_ub: float = _MODE.clip_cov_ub,
                    kl_cov_ratio: float = _MODE.kl_cov_ratio,
                    ppo_kl_coef: float = _MODE.ppo_kl_coef, dro_beta: float | None = None,
                    seq_denom: float | None = None,
                    rollout_correction: RolloutCorrection | None = None,
                    token_denom: float | None = None) -> ActorLossFn:
    """Build the actor loss (see the module docstring). `clip_ratio_c=None` disables dual
    clip; `tis_imp_ratio_cap=None` leaves the importance weight untruncated; `tis_level`
    ("token" | "sequence") is the granularity of that weight. `loss_mode` is verl's policy
    loss (`policy_losses.POLICY_LOSS_MODES`; vanilla: the PPO clip above), which reads the
    hyper-parameters after it (verl's keys and defaults); `seq_denom` is the batch's sequence
    count, which the modes that aggregate per sequence (sapo, geo_mean) divide by.
    `rollout_correction`: verl's settings (see the module docstring); `token_denom` the
    batch's valid tokens, for bypass mode's token means."""
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose from {AGG_MODES}")
    if denom is not None and stats_denom is None and loss_agg_mode in CONSTANT_DENOM_MODES:
        raise ValueError(f"loss_agg_mode {loss_agg_mode!r} with a batch denom needs stats_denom "
                         f"(global_denom(mask, stats_mode({loss_agg_mode!r})))")
    if use_kl_loss and kl_loss_type not in KL_KINDS:
        raise ValueError(f"unknown kl_loss_type {kl_loss_type!r}; choose from {KL_KINDS}")
    if tis_level not in TIS_LEVELS:
        raise ValueError(f"unknown tis_level {tis_level!r}; choose from {TIS_LEVELS}")
    params = PolicyLossParams(clip_ratio_low, clip_ratio_high, clip_ratio_c, tau_pos, tau_neg,
                              clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio,
                              ppo_kl_coef, dro_beta)
    check_params(loss_mode, params)  # an unknown mode or a bad value fails here, not mid-step
    random_draw = mode_entry(loss_mode).random
    names = {**_STAT_NAMES, **(_MAX_NAMES if with_max_metrics else {})}
    rc = rollout_correction
    bypass = rc is not None and rc.bypass_mode
    if bypass and loss_mode != "vanilla":
        raise ValueError(f"bypass_mode's loss is its loss_type ({rc.loss_type}); loss_mode "
                         f"{loss_mode!r} would be ignored (verl replaces it), set vanilla")
    given_weights = rc is not None and rc.weights_from_batch

    def pg_loss(logprobs, mask, mb):
        behav = mb.get("rollout_logprobs")
        if bypass:
            if behav is None:
                raise KeyError("bypass_mode needs mb['rollout_logprobs']: the rollout "
                               "engine's log-probs are its old policy")
            return bypass_policy_loss(
                logprobs, behav, mb["advantages"], mask, rc, params, agg=loss_agg_mode,
                denom=denom, stats_denom=stats_denom, token_denom=token_denom)
        weights = None
        if given_weights:
            weights = mb.get("rollout_is_weights")
            if weights is None:
                raise KeyError("algorithm.rollout_correction.rollout_is needs "
                               "mb['rollout_is_weights'] (rollout_correction.actor_batch)")
            weights = weights.to(logprobs.device)
        return policy_loss(
            loss_mode, logprobs, mb["old_logprobs"], mb["advantages"], mask, params,
            behav_logp=behav, tis_cap=tis_imp_ratio_cap, level=tis_level, agg=loss_agg_mode,
            denom=denom, stats_denom=stats_denom, seq_denom=seq_denom,
            generator=generator_for(mb.get("input_ids")) if random_draw else None,
            is_weights=weights)

    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, mb: dict):
        mask = mb["response_mask"].to(logprobs.device).float()
        loss, stats = pg_loss(logprobs, mask, mb)
        metrics = {name: stats[key] for key, name in names.items() if key in stats}
        metrics.update({k: v for k, v in stats.items() if k.startswith("rollout_corr/")})
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
    amounts to since it pads responses to it; no ``policy_loss`` section: vanilla with
    verl's defaults; no ``algorithm.rollout_correction`` section: megarl's own weight only)."""

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
    # verl's policy loss (actor.policy_loss.loss_mode) and the hyper-parameters of its modes
    loss_mode: str = "vanilla"
    tau_pos: float = _MODE.tau_pos
    tau_neg: float = _MODE.tau_neg
    clip_cov_ratio: float = _MODE.clip_cov_ratio
    clip_cov_lb: float = _MODE.clip_cov_lb
    clip_cov_ub: float = _MODE.clip_cov_ub
    kl_cov_ratio: float = _MODE.kl_cov_ratio
    ppo_kl_coef: float = _MODE.ppo_kl_coef
    dro_beta: float | None = None
    # verl's algorithm.rollout_correction (bypass mode, weights from the batch)
    rollout_correction: RolloutCorrection | None = None

    @classmethod
    def from_config(cls, actor_cfg, max_response_length: int | None = None,
                    rollout_correction=None):
        """`rollout_correction`: the ``algorithm.rollout_correction`` section, if any."""
        def pick(v):
            return float(actor_cfg.clip_ratio if v is None else v)

        scale = getattr(actor_cfg, "loss_scale_factor", None) or max_response_length
        pl = getattr(actor_cfg, "policy_loss", None)
        modes = {} if pl is None else dict(
            loss_mode=pl.loss_mode, clip_cov_ratio=float(pl.clip_cov_ratio),
            clip_cov_lb=float(pl.clip_cov_lb), clip_cov_ub=float(pl.clip_cov_ub),
            kl_cov_ratio=float(pl.kl_cov_ratio), ppo_kl_coef=float(pl.ppo_kl_coef),
            dro_beta=None if pl.dro_beta is None else float(pl.dro_beta))
        return cls(pick(actor_cfg.clip_ratio_low), pick(actor_cfg.clip_ratio_high),
                   actor_cfg.clip_ratio_c, actor_cfg.loss_agg_mode, actor_cfg.entropy_coeff,
                   actor_cfg.use_kl_loss, actor_cfg.kl_loss_coef, actor_cfg.kl_loss_type,
                   actor_cfg.tis_imp_ratio_cap, getattr(actor_cfg, "tis_level", "token"),
                   None if scale is None else float(scale),
                   tau_pos=float(getattr(actor_cfg, "tau_pos", _MODE.tau_pos)),
                   tau_neg=float(getattr(actor_cfg, "tau_neg", _MODE.tau_neg)),
                   rollout_correction=None if rollout_correction is None
                   else RolloutCorrection.from_config(rollout_correction), **modes)

    def make(self, denom: float | None = None, with_max_metrics: bool = False,
             stats_denom: float | None = None, seq_denom: float | None = None,
             token_denom: float | None = None) -> ActorLossFn:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.pop("loss_scale_factor")  # the caller's denominators already hold it
        return make_actor_loss(**fields, denom=denom, with_max_metrics=with_max_metrics,
                               stats_denom=stats_denom, seq_denom=seq_denom,
                               token_denom=token_denom)

    def make_for_batch(self, batch_mask: torch.Tensor, dp_size: int = 1,
                       with_max_metrics: bool = False) -> ActorLossFn:
        """The loss of one mini-batch, whose response mask over every data-parallel shard is
        `batch_mask`: each of its micro-batches returns its share, each of `dp_size` replicas
        (whose gradients are averaged) normalises by the batch's counts / `dp_size`."""
        mode = self.loss_agg_mode
        return self.make(
            denom=global_denom(batch_mask, mode, self.loss_scale_factor, dp_size=dp_size),
            with_max_metrics=with_max_metrics,
            stats_denom=global_denom(batch_mask, stats_mode(mode), dp_size=dp_size),
            seq_denom=global_denom(batch_mask, "seq-mean-token-mean", dp_size=dp_size),
            token_denom=global_denom(batch_mask, "token-mean", dp_size=dp_size))


def make_actor_loss_from_config(actor_cfg, denom: float | None = None,
                                with_max_metrics: bool = False,
                                stats_denom: float | None = None,
                                seq_denom: float | None = None) -> ActorLossFn:
    """`make_actor_loss` from the ``actor_rollout_ref.actor`` config section."""
    return ActorLossSettings.from_config(actor_cfg).make(denom, with_max_metrics, stats_denom,
                                                         seq_denom)
