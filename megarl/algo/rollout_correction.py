"""verl 0.9.1's rollout correction (``algorithm.rollout_correction``), as megarl's own code.

The rollout engine's log-probs (pi_rollout) and the trainer's recomputed ones (pi_old, the
LOGP state) differ: other kernels, precision, and, with generation ahead or partial rollout,
older weights. verl corrects that gap with three tools, each a pure function here, compared
with verl's ``trainer/ppo/rollout_corr_helper.py`` in
tests/unit/algo/test_rollout_correction_verl.py:

- `is_weights`: importance weights w = pi_old / pi_rollout per token (``rollout_is: token``)
  or per sequence (``sequence``: the product over the response, on each of its tokens); a
  single threshold truncates them at it (TIS), a ``"lower_upper"`` pair zeroes the weights
  outside [lower, upper] (IcePop); ``rollout_is_batch_normalize`` divides them by their mean
  over the batch (per token, or per sequence at the sequence level).
- `rejection_mask`: rejection sampling (``rollout_rs``): per token or per sequence, a
  divergence of the log-ratio against a bound, and the rejected tokens or sequences leave
  the loss. Options (verl's names) are ``<level>_<statistic>``; `RS_OPTIONS` lists them.
- `offpolicy_metrics`: diagnostics of the mismatch (KL, perplexities, chi-squared).

`correct_batch` runs all three over one batch as verl's trainer does in decoupled mode, once
per step on the whole step's batch (all prompts' samples) before it is cut into mini-batches;
`actor_batch` gives the actor's view of that batch (weights under ``rollout_is_weights``, the
rejections in its ``response_mask``). In bypass mode (``bypass_mode: true``) the rollout
log-probs are the old policy and the correction is computed in the loss against the policy
being trained (`megarl.algo.bypass_loss`).

Settings come from the config once, as `RolloutCorrection.from_config`; its errors start with
the key at fault. Numbers follow verl's (its safety clamp of log-ratios at +-20, its 1e-8 in
masked means); where verl reduces over all rows of the batch (sequence means and spreads,
perplexities), so does this, padding rows included.

Metrics are logged under ``rollout_corr/is/...``, ``rollout_corr/rs/...`` (per option:
``rollout_corr/rs/<option>/...``) and ``rollout_corr/offpolicy/...``; `verl_metric_name`
gives verl's flat name of each (docs/algorithms.md has the table).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SECTION = "algorithm.rollout_correction"
SAFETY_BOUND = 20.0  # verl clamps log-ratios here before exp (rollout_corr_helper.py:70)
IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")

# rollout_rs options: where the statistic is taken, and which divergence of log r.
# verl has no seq_max_k1 (a maximum of -log r bounds one side only).
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _k1(lr: torch.Tensor) -> torch.Tensor:
    return -lr


def _k2(lr: torch.Tensor) -> torch.Tensor:
    return 0.5 * lr.square()


def _k3(lr: torch.Tensor) -> torch.Tensor:
    return torch.exp(lr) - 1.0 - lr  # verl's form (not expm1): the same rounding near 0


RS_DIVERGENCES = {"k1": _k1, "k2": _k2, "k3": _k3}
"""The statistic of log r (r = pi_old / pi_rollout) each option bounds. k1 = -log r is bounded
on both sides, by the logs of a ``lower_upper`` pair; k2, k3 (>= 0) from above."""

# verl's flat metric names: rollout_corr/<prefix><rest with '/' as '_'>
_VERL_PREFIX = {"is": "rollout_is_", "rs": "rollout_rs_", "offpolicy": ""}


def verl_metric_name(name: str) -> str:
    """verl 0.9.1's name of megarl's metric `name` (``rollout_corr/is/seq_mean`` ->
    ``rollout_corr/rollout_is_seq_mean``, ``rollout_corr/rs/token_k1/mean`` ->
    ``rollout_corr/rollout_rs_token_k1_mean``, ``rollout_corr/offpolicy/kl`` ->
    ``rollout_corr/kl``)."""
    group, _, rest = name.removeprefix("rollout_corr/").partition("/")
    return "rollout_corr/" + _VERL_PREFIX[group] + rest.replace("/", "_")


# ------------------------------------------------------------------ settings
@dataclass(frozen=True)
class RSCheck:
    """One rejection-sampling option and its bounds (k1: ratio bounds, both set; k2, k3: an
    upper bound on the divergence, `lower` None)."""

    option: str
    upper: float
    lower: float | None = None

    @property
    def level(self) -> str:
        return "token" if self.option.startswith("token_") else "sequence"

    @property
    def reduce(self) -> str:
        return self.option.rsplit("_", 1)[0]  # token | seq_sum | seq_mean | seq_max

    @property
    def divergence(self) -> str:
        return self.option.rsplit("_", 1)[1]  # k1 | k2 | k3


@dataclass(frozen=True)
class RolloutCorrection:
    """``algorithm.rollout_correction``, parsed (verl's keys and their meaning; defaults: the
    values in verl's trainer YAML, i.e. nothing on)."""

    rollout_is: str | None = None        # None | token | sequence
    is_upper: float = 2.0                # rollout_is_threshold's upper bound
    is_lower: float | None = None        # its lower bound: IcePop; None: TIS
    batch_normalize: bool = False        # rollout_is_batch_normalize
    rs: tuple[RSCheck, ...] = ()         # rollout_rs with rollout_rs_threshold
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    @classmethod
    def from_config(cls, section) -> "RolloutCorrection":
        """Parse the config section (any mapping with verl's keys; absent keys take verl's
        defaults). Raises ValueError whose message starts with the key at fault."""
        get = (lambda k, d: section.get(k, d)) if hasattr(section, "get") else \
            (lambda k, d: getattr(section, k, d))
        level = get("rollout_is", None)
        if level is not None and level not in IS_LEVELS:
            raise ValueError(f"{SECTION}.rollout_is: {level!r} is not one of null, token, "
                             "sequence")
        upper, lower = parse_is_threshold(get("rollout_is_threshold", 2.0))
        normalize = bool(get("rollout_is_batch_normalize", False))
        rs = parse_rs(get("rollout_rs", None), get("rollout_rs_threshold", None))
        bypass = bool(get("bypass_mode", False))
        loss_type = get("loss_type", "ppo_clip")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"{SECTION}.loss_type: {loss_type!r} is not one of "
                             f"{', '.join(LOSS_TYPES)}")
        if normalize and level is None:
            raise ValueError(f"{SECTION}.rollout_is_batch_normalize: normalises the importance "
                             f"weights, and {SECTION}.rollout_is is null (no weights)")
        if normalize and bypass:
            raise ValueError(
                f"{SECTION}.rollout_is_batch_normalize: not with {SECTION}.bypass_mode=true. "
                "There the weights are pi_theta/pi_rollout of the policy being trained, known "
                "one micro-batch at a time; verl normalises each micro-batch's weights by "
                "their own mean (all-reduced over ranks), a normaliser that moves with the "
                "micro-batch split, which megarl does not reproduce")
        if loss_type != "ppo_clip" and not bypass:
            raise ValueError(f"{SECTION}.loss_type: {loss_type} is bypass mode's loss and "
                             f"{SECTION}.bypass_mode is false (decoupled mode's loss is "
                             "actor_rollout_ref.actor.policy_loss.loss_mode)")
        return cls(level, upper, lower, normalize, rs, bypass, loss_type)

    @property
    def plain_tis(self) -> tuple[str, float] | None:
        """(level, cap) when the weight is a plain truncated one (a single threshold, no
        batch normalisation): exactly megarl's ``actor.tis_level``/``tis_imp_ratio_cap``
        weight. None otherwise (no weight, IcePop, normalised)."""
        if self.rollout_is is None or self.is_lower is not None or self.batch_normalize:
            return None
        return self.rollout_is, self.is_upper

    @property
    def weights_from_batch(self) -> bool:
        """The loss takes its importance weights from the batch (decoupled mode with
        ``rollout_is`` set), not from megarl's own ``tis_imp_ratio_cap``."""
        return self.rollout_is is not None and not self.bypass_mode


def _number(value: Any, key: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: {value!r} is not a number") from None


def parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """``rollout_is_threshold`` -> (upper, lower): a number or a number-like string is TIS's
    upper bound (lower None); ``"lower_upper"`` is IcePop's pair. Both > 0, lower <= upper."""
    key = f"{SECTION}.rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{key}: {spec!r} is neither a number nor a \"lower_upper\" string")
    lower = None
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ValueError(f"{key}: empty")
        if "_" in text:
            lo, hi = text.split("_", 1)
            lower, upper = _number(lo, key), _number(hi, key)
        else:
            upper = _number(text, key)
    else:
        upper = float(spec)
    if not upper > 0 or (lower is not None and not lower > 0):
        raise ValueError(f"{key}: bounds must be > 0, got {spec!r}")
    if lower is not None and lower > upper:
        raise ValueError(f"{key}: the lower bound is above the upper one in {spec!r}")
    return upper, lower


def parse_rs(options: Any, spec: Any) -> tuple[RSCheck, ...]:
    """``rollout_rs`` (comma-separated options, duplicates dropped) with
    ``rollout_rs_threshold`` (one entry for all options or one per option, comma-separated;
    k1: ``"lower_upper"`` ratio bounds, a single number u meaning [1/u, u]; k2, k3: a single
    upper bound) -> the checks, in the order given. No options: ()."""
    key, tkey = f"{SECTION}.rollout_rs", f"{SECTION}.rollout_rs_threshold"
    if options is None:
        if spec is not None:
            raise ValueError(f"{tkey}: set, and {key} is null (no rejection sampling)")
        return ()
    if not isinstance(options, str):
        raise ValueError(f"{key}: {options!r} is not a comma-separated string of options")
    names: list[str] = []
    for name in (o.strip() for o in options.split(",")):
        if name and name not in RS_OPTIONS:
            raise ValueError(f"{key}: unknown option {name!r}; choose from "
                             f"{', '.join(RS_OPTIONS)}")
        if name and name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"{key}: {options!r} names no option")
    if spec is None:
        raise ValueError(f"{tkey}: required with {key}={options}")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{tkey}: {spec!r} is neither a number nor a string of thresholds")
    parts = [str(spec)] if not isinstance(spec, str) else \
        [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) not in (1, len(names)):
        raise ValueError(f"{tkey}: {len(parts)} thresholds for {len(names)} options of {key}; "
                         "give one for all or one per option")
    parts = parts * len(names) if len(parts) == 1 else parts
    checks = []
    for name, part in zip(names, parts):
        if name.endswith("k1"):
            if "_" in part:
                lo, hi = part.split("_", 1)
                lower, upper = _number(lo, tkey), _number(hi, tkey)
            else:
                upper = _number(part, tkey)
                lower = 1.0 / upper if upper > 0 else upper
            if not (lower > 0 and upper > 0) or lower > upper:
                raise ValueError(f"{tkey}: {name} needs 0 < lower <= upper, got {part!r}")
            checks.append(RSCheck(name, upper, lower))
        else:
            if "_" in part:
                raise ValueError(f"{tkey}: {name} takes one upper bound, got {part!r}")
            upper = _number(part, tkey)
            if not upper > 0:
                raise ValueError(f"{tkey}: {name} needs a bound > 0, got {part!r}")
            checks.append(RSCheck(name, upper))
    return tuple(checks)


# ------------------------------------------------------------------ tensor helpers
def _mean(x: torch.Tensor, m: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Masked mean with verl's 1e-8 in the denominator (a row without tokens gives 0)."""
    s = torch.where(m > 0, x, 0.0) * m
    if dim is None:
        return s.sum() / (m.sum() + 1e-8)
    return s.sum(dim) / (m.sum(dim) + 1e-8)


def _masked_extreme(x: torch.Tensor, m: torch.Tensor, largest: bool) -> torch.Tensor:
    fill = float("-inf") if largest else float("inf")
    y = x.masked_fill(m <= 0, fill)
    return y.max() if largest else y.min()


def _std_of_clamped(x: torch.Tensor, m: torch.Tensor, low: float, high: float) -> float:
    """The spread verl reports: of x clamped to [low, high], over the valid tokens (0 when
    there is at most one)."""
    if float(m.sum()) <= 1:
        return 0.0
    c = x.clamp(min=low, max=high)
    var = _mean(c.square(), m) - _mean(c, m).square()
    return float(var.clamp(min=0.0).sqrt())


def _row_summary(values: torch.Tensor) -> dict[str, float]:
    """Mean, spread (unbiased; 0 for one row), max and min of per-row values."""
    return {"seq_mean": float(values.mean()),
            "seq_std": float(values.std()) if values.numel() > 1 else 0.0,
            "seq_max": float(values.max()), "seq_min": float(values.min())}


def log_ratio(old_logp: torch.Tensor, behav_logp: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """log(pi_old / pi_rollout) per token, detached, float32, 0 off the mask (whatever the
    log-probs hold there)."""
    return torch.where(mask > 0, old_logp.detach().float() - behav_logp.detach().float(), 0.0)


# ------------------------------------------------------------------ importance weights
def raw_is_weights(lr: torch.Tensor, mask: torch.Tensor, level: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw weights [b, T], 0 off the mask; the log-ratio they come from: [b, T] per token,
    [b, 1] the row sums per sequence). Log-ratios clamped to +-20 before exp, as verl."""
    m = mask.float()
    if level == "token":
        log_w = lr
    elif level == "sequence":
        log_w = (lr * m).sum(-1, keepdim=True)
    else:
        raise ValueError(f"unknown rollout_is level {level!r}; choose from {IS_LEVELS}")
    raw = torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(lr) * m
    return raw, log_w


def bound_weights(raw: torch.Tensor, upper: float, lower: float | None) -> torch.Tensor:
    """TIS (lower None): min(w, upper). IcePop: w inside [lower, upper], 0 outside."""
    if lower is None:
        return raw.clamp(max=upper)
    return torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))


def is_weights(lr: torch.Tensor, mask: torch.Tensor, level: str, upper: float,
               lower: float | None = None, batch_normalize: bool = False
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """(weights [b, T] detached, 0 off the mask; metrics under ``rollout_corr/is/``).

    `lr` is `log_ratio`'s output over the whole batch the weights are normalised over.
    Metrics, as verl's ``compute_is_metrics`` (before normalisation): mean (per valid token),
    max, min (sequence level: of the unclamped sequence ratio), ratio_fraction_high/low (raw
    weights above upper / below lower, lower = 1/upper for TIS; per token, or per row at the
    sequence level), std and eff_sample_size (of the weights clamped to [0, upper]), the
    per-row means' seq_mean/std/max/min, seq_max_deviation (from 1), seq_fraction_high/low
    (raw per-row means past the bounds); IcePop adds oob_ratio (tokens zeroed),
    normalisation batch_norm_factor (the mean divided by)."""
    m = mask.float()
    raw, log_w = raw_is_weights(lr, m, level)
    w = bound_weights(raw, upper, lower)
    lo = 1.0 / upper if lower is None else lower
    out: dict[str, float] = {"mean": float(_mean(w, m))}
    if level == "sequence":
        out["max"] = float(torch.exp(log_w.max().clamp(max=SAFETY_BOUND)))
        out["min"] = float(torch.exp(log_w.min()))
        out["ratio_fraction_high"] = float((log_w > math.log(upper)).float().mean())
        out["ratio_fraction_low"] = float((log_w < math.log(lo)).float().mean())
    else:
        out["ratio_fraction_high"] = float(_mean((raw > upper).float(), m))
        out["ratio_fraction_low"] = float(_mean((raw < lo).float(), m))
        out["max"] = float(_masked_extreme(w, m, largest=True))
        out["min"] = float(_masked_extreme(w, m, largest=False))
    out["std"] = _std_of_clamped(w, m, 0.0, upper)
    clamped = w.clamp(min=0.0, max=upper)
    normed = clamped / (_mean(clamped, m) + 1e-8)
    out["eff_sample_size"] = float(1.0 / _mean(normed.square(), m))
    row_w = _mean(w, m, dim=-1)
    out.update(_row_summary(row_w))
    out["seq_max_deviation"] = float((row_w - 1.0).abs().max())
    row_raw = _mean(raw, m, dim=-1)
    out["seq_fraction_high"] = float((row_raw > upper).float().mean())
    out["seq_fraction_low"] = float((row_raw < lo).float().mean())
    if lower is not None:
        out["oob_ratio"] = float(_mean(((raw < lower) | (raw > upper)).float(), m))
    if batch_normalize:
        if level == "token":
            mean = _mean(w, m)
        else:  # one weight per sequence: the mean over the sequences with a valid token
            rows = (m.sum(-1) > 0).float()
            mean = (row_w * rows).sum() / rows.sum().clamp(min=1e-8)
        if float(mean) > 1e-8:
            w = w / mean
            out["batch_norm_factor"] = float(mean)
        else:
            out["batch_norm_factor"] = 1.0
    return w.detach(), {f"rollout_corr/is/{k}": v for k, v in out.items()}


# ------------------------------------------------------------------ rejection sampling
def _row_max(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    top = x.masked_fill(m <= 0, float("-inf")).max(-1).values
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)  # no tokens: 0


RS_REDUCTIONS = {"seq_sum": lambda x, m: (torch.where(m > 0, x, 0.0) * m).sum(-1),
                 "seq_mean": lambda x, m: _mean(x, m, dim=-1),
                 "seq_max": _row_max}
"""How a sequence option turns its tokens' divergences into the row's statistic."""


def rs_statistic(lr: torch.Tensor, mask: torch.Tensor, check: RSCheck
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-token statistic [b, T], per-row statistic [b] or None for a token option);
    a sequence option's per-token statistic is its row's, on every token."""
    m = mask.float()
    tok = RS_DIVERGENCES[check.divergence](lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    if check.reduce == "token":
        return tok, None
    row = RS_REDUCTIONS[check.reduce](tok, m)
    return row.unsqueeze(-1).expand_as(tok), row


def _bounds(check: RSCheck) -> tuple[float, float | None]:
    """The statistic's (upper, lower) bound: k1's are the logs of the ratio bounds (of
    -log r, as verl compares them), k2/k3 have an upper bound only."""
    if check.divergence == "k1":
        return math.log(check.upper), math.log(check.lower)
    return check.upper, None


def rs_keep(stat: torch.Tensor, check: RSCheck) -> torch.Tensor:
    """Which tokens `check` keeps (bool [b, T]), given `rs_statistic`'s per-token statistic."""
    hi, lo = _bounds(check)
    keep = stat <= hi
    return keep & (stat >= lo) if lo is not None else keep


def _rs_option_metrics(tok: torch.Tensor, row: torch.Tensor | None, keep: torch.Tensor,
                       m: torch.Tensor, check: RSCheck) -> dict[str, float]:
    """verl's ``compute_rs_metrics`` for one option, and its masked fractions."""
    hi, lo = _bounds(check)
    valid = m.sum(-1) > 0
    row = _mean(tok, m, dim=-1) if row is None else row
    rows = row[valid]
    by_row = check.level == "sequence" and rows.numel() > 0
    out = {"mean": float(_mean(tok, m))}
    if by_row:
        out.update(max=float(rows.max()), min=float(rows.min()),
                   fraction_high=float((rows > hi).float().mean()),
                   fraction_low=float((rows < lo).float().mean()) if lo is not None else 0.0)
    else:
        out.update(max=float(_masked_extreme(tok, m, largest=True)),
                   min=float(_masked_extreme(tok, m, largest=False)),
                   fraction_high=float(_mean((tok > hi).float(), m)),
                   fraction_low=float(_mean((tok < lo).float(), m)) if lo is not None else 0.0)
    out["std"] = _std_of_clamped(tok, m, lo if lo is not None else 0.0, hi)
    if rows.numel() > 0:
        out.update(_row_summary(rows))
        out["seq_max_deviation"] = float(rows.abs().max())
        out["seq_fraction_high"] = float((rows > hi).float().mean())
        if lo is not None:
            out["seq_fraction_low"] = float((rows < lo).float().mean())
    else:
        out.update({k: 0.0 for k in ("seq_mean", "seq_std", "seq_max", "seq_min",
                                     "seq_max_deviation", "seq_fraction_high",
                                     "seq_fraction_low")})
    out["masked_fraction"] = float(_mean(1.0 - keep.float(), m))
    dropped_row = ((~keep) & (m > 0)).any(-1)
    out["seq_masked_fraction"] = float(dropped_row[valid].float().mean()) if valid.any() \
        else 0.0
    return {f"rollout_corr/rs/{check.option}/{k}": v for k, v in out.items()}


def rejection_mask(lr: torch.Tensor, mask: torch.Tensor, checks: tuple[RSCheck, ...],
                   with_metrics: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """(the mask with every token or sequence some check rejects set to 0, in `mask`'s
    dtype; metrics under ``rollout_corr/rs/``). A token stays only if every check keeps it.

    Per option (verl's ``compute_rs_metrics``): mean (per valid token of the statistic),
    max, min, fraction_high/low (per row for sequence options, per token for token ones;
    the lower side for k1 only), std (of the statistic clamped to its bounds), the valid
    rows' seq_mean/std/max/min/max_deviation/fraction_high(/fraction_low for k1),
    masked_fraction (tokens rejected), seq_masked_fraction (valid rows with a rejected
    token); over all options: masked_fraction and seq_masked_fraction (over all rows)."""
    m = mask.float()
    keep_all = torch.ones_like(m, dtype=torch.bool)
    out: dict[str, float] = {}
    for check in checks:
        tok, row = rs_statistic(lr, m, check)
        keep = rs_keep(tok, check)
        keep_all &= keep
        if with_metrics:
            out.update(_rs_option_metrics(tok, row, keep, m, check))
    if with_metrics:
        out["rollout_corr/rs/masked_fraction"] = float(_mean(1.0 - keep_all.float(), m))
        out["rollout_corr/rs/seq_masked_fraction"] = float(
            ((~keep_all) & (m > 0)).any(-1).float().mean())
    return (mask * keep_all.to(mask.dtype)).to(mask.dtype), out


# ------------------------------------------------------------------ diagnostics
def offpolicy_metrics(old_logp: torch.Tensor, behav_logp: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, float]:
    """The mismatch between the trainer's and the engine's log-probs (verl's
    ``compute_offpolicy_metrics``), under ``rollout_corr/offpolicy/``: kl (mean of
    behav - old per valid token), k3_kl, training_ppl / rollout_ppl (each row's exp of its
    mean negative log-prob, averaged over rows) and their logs, log_ppl_diff (per row,
    rollout minus training mean log-prob: mean, abs mean, max, min), ppl_ratio, chi2_token
    (E[r^2] - 1 per token), chi2_seq (per row, r the sequence's product)."""
    m = mask.float()
    old = torch.where(m > 0, old_logp.detach().float(), 0.0)
    behav = torch.where(m > 0, behav_logp.detach().float(), 0.0)
    lr = old - behav
    train_row, rollout_row = _mean(old, m, dim=-1), _mean(behav, m, dim=-1)
    diff = rollout_row - train_row
    seq_lr = (lr * m).sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out = {"training_ppl": torch.exp(-train_row).mean(),
           "training_log_ppl": (-train_row).mean(),
           "kl": _mean(behav - old, m),
           "k3_kl": _mean(torch.exp(lr) - lr - 1.0, m),
           "rollout_ppl": torch.exp(-rollout_row).mean(),
           "rollout_log_ppl": (-rollout_row).mean(),
           "log_ppl_diff": diff.mean(), "log_ppl_abs_diff": diff.abs().mean(),
           "log_ppl_diff_max": diff.max(), "log_ppl_diff_min": diff.min(),
           "ppl_ratio": torch.exp(diff).mean(),
           "chi2_token": _mean(torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), m)
           - 1.0,
           "chi2_seq": torch.exp(2.0 * seq_lr).mean() - 1.0}
    return {f"rollout_corr/offpolicy/{k}": float(v) for k, v in out.items()}


# ------------------------------------------------------------------ one batch, as verl's trainer
def correct_batch(old_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                  rc: RolloutCorrection
                  ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Decoupled mode over one batch (verl's ``compute_rollout_correction_and_rejection_mask``):
    (importance weights [b, T] or None without ``rollout_is``; the mask with the rejections;
    every metric). The weights are taken (and normalised) over `mask` as given, before any
    rejection, as verl does. A batch without a valid token is returned unchanged, with no
    metrics (verl refuses it)."""
    if not bool((mask > 0).any()):
        return None, mask, {}
    lr = log_ratio(old_logp, behav_logp, mask)
    metrics: dict[str, float] = {}
    weights = None
    if rc.rollout_is is not None:
        weights, m = is_weights(lr, mask, rc.rollout_is, rc.is_upper, rc.is_lower,
                                rc.batch_normalize)
        metrics.update(m)
    kept = mask
    if rc.rs:
        kept, m = rejection_mask(lr, mask, rc.rs)
        metrics.update(m)
    metrics.update(offpolicy_metrics(old_logp, behav_logp, mask))
    return weights, kept, metrics


def actor_batch(batch: dict, rc: RolloutCorrection) -> tuple[dict, dict[str, float]]:
    """The actor's view of a step's batch (``old_logprobs``, ``rollout_logprobs``,
    ``response_mask`` [B, S]) and the correction's metrics. Decoupled mode: `correct_batch`
    over the whole batch (the weights normalised over it), its weights added as
    ``rollout_is_weights`` and its rejections taken out of ``response_mask``, so that they
    leave the actor's loss and its denominators; everything else (advantages, the critic)
    keeps the batch's own mask. Bypass mode: the batch as it is (the loss corrects)."""
    if rc.bypass_mode:
        return batch, {}
    weights, kept, metrics = correct_batch(batch["old_logprobs"], batch["rollout_logprobs"],
                                           batch["response_mask"], rc)
    out = {**batch, "response_mask": kept}
    if weights is not None:
        out["rollout_is_weights"] = weights
    return out, metrics


__all__ = ["IS_LEVELS", "LOSS_TYPES", "RS_DIVERGENCES", "RS_OPTIONS", "RS_REDUCTIONS", "RSCheck",
           "RolloutCorrection", "SECTION", "actor_batch", "bound_weights", "correct_batch",
           "is_weights", "log_ratio", "offpolicy_metrics", "parse_is_threshold", "parse_rs",
           "raw_is_weights", "rejection_mask", "rs_keep", "rs_statistic", "verl_metric_name"]
