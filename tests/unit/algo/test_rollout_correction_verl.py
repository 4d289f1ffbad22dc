"""verl 0.9.1's rollout correction (``algorithm.rollout_correction``) against verl's own code.

On random ragged batches (a prompt before each response, rows of 1 token and of many,
all-masked padding rows, garbage log-probs off the mask, and a per-row mismatch from 0.02 to
3 nats per token so that every threshold binds on some rows and not on others), megarl's
`megarl.algo.rollout_correction` is compared with verl/trainer/ppo/rollout_corr_helper.py,
all of it in one child process (`tests/verl_reference.verl_run`), to 1e-5:

- the importance weights and their metrics: token and sequence level, TIS (a number, a
  number-like string) and IcePop (``"lower_upper"``), with and without batch normalisation;
- every rejection-sampling option (k1 with a pair and with a single bound, k2, k3), several
  at once (one threshold for all, one each, a repeated option): the kept mask exactly, and
  the metrics;
- the whole batch as verl's trainer does it (weights, rejections and the off-policy
  diagnostics together);
- the loss the run computes from it (`actor_batch`, then `ActorLossSettings.make_for_batch`)
  against verl's loss function given verl's weights and rejection mask, for vanilla and two
  other loss modes: loss and gradient;
- bypass mode (both loss types) against verl's ``compute_policy_loss_bypass_mode``: loss,
  gradient and the token-mean metrics.

verl's metric names are megarl's through `verl_metric_name` (a table in docs/algorithms.md).
"""
from __future__ import annotations

import pytest
import torch

from megarl.algo.actor_loss import ActorLossSettings
from megarl.algo.rollout_correction import (RS_OPTIONS, RolloutCorrection, actor_batch,
                                            correct_batch, is_weights, log_ratio,
                                            rejection_mask, verl_metric_name)
from tests.verl_reference import verl_run

TOL = dict(atol=1e-5, rtol=1e-5)
B, T = 10, 14
PADDING = (3, 7)
SCALES = (0.02, 0.1, 0.5, 1.5, 3.0)  # nats of mismatch per token, by row


def _batch(seed: int) -> dict:
    """Old (trainer) and rollout log-probs, a ragged mask, advantages, a new policy."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    for i in range(B):
        if i in PADDING:
            continue
        start = int(torch.randint(1, 4, (1,), generator=g))
        n = 1 if i == 0 else int(torch.randint(2, T - start + 1, (1,), generator=g))
        mask[i, start:start + n] = 1
    old = (torch.rand(B, T, generator=g) * 0.96 + 0.02).log()
    scale = torch.tensor([SCALES[i % len(SCALES)] for i in range(B)])[:, None]
    behav = (old + scale * torch.randn(B, T, generator=g)).clamp(max=-1e-4)
    behav = torch.where(mask > 0, behav, torch.zeros_like(behav))  # off the mask: 0, as a run
    new_p = (old.exp() + 0.25 * torch.randn(B, T, generator=g)).clamp(0.01, 0.99)
    adv = (torch.randn(B, generator=g) * 1.5)[:, None].expand(B, T).clone()
    return {"mask": mask, "old": old, "behav": behav, "logp": new_p.log(), "adv": adv}


def _rc(**keys) -> RolloutCorrection:
    return RolloutCorrection.from_config(keys)


IS_CASES = [(level, thr, norm) for level in ("token", "sequence")
            for thr in (2.0, "1.5", "0.5_5.0", "0.8_1.25") for norm in (False, True)]
RS_CASES = [
    *[(opt, "0.6_1.6") for opt in RS_OPTIONS if opt.endswith("k1")],
    ("token_k1", 1.5), ("seq_mean_k1", "1.3"),        # one bound u: [1/u, u]
    ("token_k2", 0.3), ("token_k3", 0.3), ("seq_sum_k2", 2.0), ("seq_sum_k3", 2.0),
    ("seq_mean_k2", 0.3), ("seq_mean_k3", 0.3), ("seq_max_k2", 1.0), ("seq_max_k3", 1.0),
    ("token_k1,seq_mean_k3,token_k1", "0.5_2.0,0.2"),   # one each, a repeat dropped
    ("seq_sum_k2, seq_max_k3", 1.0),                    # one for all
]
FULL_CASES = [
    dict(),                                              # diagnostics only
    dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
         rollout_rs_threshold="0.8_1.25"),
    dict(rollout_is="token", rollout_is_threshold="0.5_5.0", rollout_is_batch_normalize=True,
         rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="0.5,2.0"),
    dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True),
]
LOSS_CASES = [(mode, agg, i) for mode in ("vanilla", "gspo", "cispo")
              for agg in ("token-mean", "seq-mean-token-sum") for i in (1, 2)]
BYPASS_CASES = [
    ("ppo_clip", dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                      rollout_rs_threshold="0.6_1.6")),
    ("ppo_clip", dict()),
    ("reinforce", dict(rollout_is="sequence", rollout_is_threshold="0.5_5.0",
                       rollout_rs="seq_mean_k3", rollout_rs_threshold=0.3)),
    ("reinforce", dict(rollout_is="token", rollout_is_threshold=2.0)),
    ("reinforce", dict()),
]
CLIP = dict(clip_low=0.2, clip_high=0.28, clip_c=3.0)

_VERL = """
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos as C
from verl.trainer.ppo import rollout_corr_helper as H
from verl.workers.config import ActorConfig, PolicyLossConfig


def config(agg, mode="vanilla", rc=None):
    c = inputs["clip"]
    cfg = ActorConfig(
        strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
        clip_ratio=c["clip_low"], clip_ratio_low=c["clip_low"], clip_ratio_high=c["clip_high"],
        clip_ratio_c=c["clip_c"], loss_agg_mode=agg,
        policy_loss=PolicyLossConfig(loss_mode=mode, rollout_correction=rc or
                                     RolloutCorrectionConfig()))
    return cfg


def info(mask):
    return {"dp_size": 1, "batch_num_tokens": int(mask.sum()),
            "global_batch_size": int((mask.sum(-1) > 0).sum()), "loss_scale_factor": None}


for key, c in inputs["is"].items():
    b = c["b"]
    outputs[key] = H.compute_rollout_correction_weights(
        log_ratio=b["old"] - b["behav"], response_mask=b["mask"], rollout_is=c["level"],
        rollout_is_threshold=c["thr"], rollout_is_batch_normalize=c["norm"])
for key, c in inputs["rs"].items():
    b = c["b"]
    outputs[key] = H.compute_rollout_rejection_mask(
        log_ratio=b["old"] - b["behav"], response_mask=b["mask"], rollout_rs=c["rs"],
        rollout_rs_threshold=c["thr"])
for key, c in inputs["full"].items():
    b = c["b"]
    proto, mask, metrics = H.compute_rollout_correction_and_rejection_mask(
        old_log_prob=b["old"], rollout_log_prob=b["behav"], response_mask=b["mask"],
        **c["keys"])
    w = None if proto is None else proto.batch["rollout_is_weights"]
    outputs[key] = (w, mask, metrics)
for key, c in inputs["loss"].items():
    b = c["b"]
    proto, mask, _ = H.compute_rollout_correction_and_rejection_mask(
        old_log_prob=b["old"], rollout_log_prob=b["behav"], response_mask=b["mask"],
        **c["keys"])
    cfg = config(c["agg"], c["mode"])
    cfg.global_batch_info.update(info(mask))
    logp = b["logp"].clone().requires_grad_(True)
    loss, metrics = C.get_policy_loss_fn(c["mode"])(
        old_log_prob=b["old"], log_prob=logp, advantages=b["adv"], response_mask=mask.bool(),
        loss_agg_mode=c["agg"], config=cfg,
        rollout_is_weights=None if proto is None else proto.batch["rollout_is_weights"])
    (grad,) = torch.autograd.grad(loss, logp)
    outputs[key] = (loss.detach(), grad)
for key, c in inputs["bypass"].items():
    b = c["b"]
    # the dataclass's own default rollout_is is "sequence"; a run's (its YAML's) is null
    rc = RolloutCorrectionConfig(**{"rollout_is": None, "bypass_mode": True,
                                    "loss_type": c["loss_type"], **c["keys"]})
    cfg = config("token-mean", "bypass_mode", rc)
    cfg.global_batch_info.update(info(b["mask"]))
    logp = b["logp"].clone().requires_grad_(True)
    loss, metrics = C.compute_policy_loss_bypass_mode(
        old_log_prob=b["behav"], log_prob=logp, advantages=b["adv"],
        response_mask=b["mask"].bool(), loss_agg_mode="token-mean", config=cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    outputs[key] = (loss.detach(), grad, metrics)
"""


def _loss_keys(i: int) -> dict:
    return FULL_CASES[i]


@pytest.fixture(scope="module")
def verl():
    """Every verl call of this module, in one child process."""
    inputs = {"clip": CLIP,
              "is": {("is", *c): {"b": _batch(10 + i), "level": c[0], "thr": c[1],
                                  "norm": c[2]} for i, c in enumerate(IS_CASES)},
              "rs": {("rs", *c): {"b": _batch(40 + i), "rs": c[0], "thr": c[1]}
                     for i, c in enumerate(RS_CASES)},
              "full": {("full", i): {"b": _batch(70 + i), "keys": keys}
                       for i, keys in enumerate(FULL_CASES)},
              "loss": {("loss", *c): {"b": _batch(80 + j), "keys": _loss_keys(c[2]),
                                      "mode": c[0], "agg": c[1]}
                       for j, c in enumerate(LOSS_CASES)},
              "bypass": {("bypass", i): {"b": _batch(100 + i), "loss_type": lt, "keys": keys}
                         for i, (lt, keys) in enumerate(BYPASS_CASES)}}
    return verl_run(_VERL, inputs)


def _same_metrics(mine: dict, theirs: dict, prefix: str = "rollout_corr/") -> None:
    """megarl's metrics are verl's, name for name (through `verl_metric_name`)."""
    named = {verl_metric_name(k): v for k, v in mine.items()}
    theirs = {k if k.startswith(prefix) else prefix + k: v for k, v in theirs.items()}
    assert sorted(named) == sorted(theirs)
    for name, value in theirs.items():
        torch.testing.assert_close(torch.tensor(float(named[name]), dtype=torch.float64),
                                   torch.tensor(float(value), dtype=torch.float64), **TOL,
                                   msg=name)


@pytest.mark.parametrize("level, thr, norm", IS_CASES)
def test_importance_weights_and_metrics(verl, level, thr, norm):
    i = IS_CASES.index((level, thr, norm))
    b = _batch(10 + i)
    rc = _rc(rollout_is=level, rollout_is_threshold=thr, rollout_is_batch_normalize=norm)
    w, metrics = is_weights(log_ratio(b["old"], b["behav"], b["mask"]), b["mask"], level,
                            rc.is_upper, rc.is_lower, norm)
    ref_w, ref_metrics = verl[("is", level, thr, norm)]
    torch.testing.assert_close(w, ref_w, **TOL)
    _same_metrics(metrics, ref_metrics)
    # the thresholds bind: weights cut (TIS) or zeroed (IcePop) on some valid tokens only
    if rc.is_lower is None:
        assert 0 < metrics["rollout_corr/is/ratio_fraction_high"] < 1
    else:
        assert 0 < metrics["rollout_corr/is/oob_ratio"] < 1


@pytest.mark.parametrize("rs, thr", RS_CASES)
def test_rejection_masks_and_metrics(verl, rs, thr):
    b = _batch(40 + RS_CASES.index((rs, thr)))
    rc = _rc(rollout_rs=rs, rollout_rs_threshold=thr)
    kept, metrics = rejection_mask(log_ratio(b["old"], b["behav"], b["mask"]), b["mask"], rc.rs)
    ref_kept, ref_metrics = verl[("rs", rs, thr)]
    assert torch.equal(kept, ref_kept)
    _same_metrics(metrics, ref_metrics)
    rejected = float(((kept == 0) & (b["mask"] > 0)).sum())
    assert 0 < rejected < float(b["mask"].sum())  # some tokens go, some stay
    if all(o.strip().startswith("seq") for o in rs.split(",")):  # whole responses go
        valid = b["mask"].sum(-1) > 0
        left = kept.sum(-1)
        assert torch.all((left[valid] == 0) | (left[valid] == b["mask"].sum(-1)[valid]))


@pytest.mark.parametrize("i", range(len(FULL_CASES)))
def test_the_whole_batch_as_verls_trainer(verl, i):
    b = _batch(70 + i)
    w, kept, metrics = correct_batch(b["old"], b["behav"], b["mask"], _rc(**FULL_CASES[i]))
    ref_w, ref_kept, ref_metrics = verl[("full", i)]
    assert (w is None) == (ref_w is None)
    if w is not None:
        torch.testing.assert_close(w, ref_w, **TOL)
    assert torch.equal(kept, ref_kept)
    _same_metrics(metrics, ref_metrics)
    assert "rollout_corr/offpolicy/chi2_seq" in metrics


def _settings(mode: str, agg: str, rc: RolloutCorrection) -> ActorLossSettings:
    return ActorLossSettings(CLIP["clip_low"], CLIP["clip_high"], CLIP["clip_c"], agg, 0.0,
                             False, 0.0, "low_var_kl", 2.0, "token", None, loss_mode=mode,
                             rollout_correction=rc)


def _run_loss(settings: ActorLossSettings, batch: dict, rows=slice(None)):
    """The actor's LossFn for the whole (corrected) batch, on rows `rows`."""
    fn = settings.make_for_batch(batch["response_mask"])
    logp = batch["logp"][rows].clone().requires_grad_(True)
    mb = {k: batch[k][rows] for k in ("response_mask", "old_logprobs", "rollout_logprobs",
                                       "advantages", "rollout_is_weights") if k in batch}
    loss, metrics = fn(logp, None, mb)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


def _step_batch(b: dict) -> dict:
    return {"response_mask": b["mask"], "old_logprobs": b["old"], "rollout_logprobs": b["behav"],
            "advantages": b["adv"], "logp": b["logp"]}


@pytest.mark.parametrize("mode, agg, i", LOSS_CASES)
def test_the_runs_loss_is_verls_loss_on_verls_weights(verl, mode, agg, i):
    """actor_batch over the step's batch, then the settings' loss of the mini-batch (here the
    whole batch, and its micro-batch shares): verl's loss fn given verl's rollout_is_weights
    and its rejection mask (global batch counts of the kept tokens)."""
    b = _batch(80 + LOSS_CASES.index((mode, agg, i)))
    rc = _rc(**FULL_CASES[i])
    batch, _ = actor_batch(_step_batch(b), rc)
    assert "rollout_is_weights" in batch and not torch.equal(batch["response_mask"], b["mask"])
    settings = _settings(mode, agg, rc)
    loss, grad, metrics = _run_loss(settings, batch)
    ref_loss, ref_grad = verl[("loss", mode, agg, i)]
    torch.testing.assert_close(loss, ref_loss.float(), **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    assert "actor/tis_weight_mean" in metrics
    parts = [_run_loss(settings, batch, s) for s in (slice(0, 4), slice(4, 7), slice(7, B))]
    torch.testing.assert_close(sum(p[0] for p in parts), loss, **TOL)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), grad, **TOL)


@pytest.mark.parametrize("i", range(len(BYPASS_CASES)))
def test_bypass_mode_is_verls(verl, i):
    """Bypass mode: the rollout log-probs as the old policy, the loss_type's loss with the
    weights and rejections of pi_theta against pi_rollout; loss, gradient, and the metrics
    megarl reports as token means (verl's values on the whole batch)."""
    loss_type, keys = BYPASS_CASES[i]
    b = _batch(100 + i)
    rc = _rc(bypass_mode=True, loss_type=loss_type, **keys)
    batch, corr = actor_batch(_step_batch(b), rc)
    assert corr == {} and batch["response_mask"] is b["mask"]
    batch = {**batch, "old_logprobs": torch.full_like(b["old"], float("nan"))}  # never read
    settings = _settings("vanilla", "token-mean", rc)
    loss, grad, metrics = _run_loss(settings, batch)
    ref_loss, ref_grad, ref_metrics = verl[("bypass", i)]
    torch.testing.assert_close(loss, ref_loss.float(), **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    mine = {k: v for k, v in metrics.items() if k.startswith("rollout_corr/")}
    assert mine and set(map(verl_metric_name, mine)) <= set(ref_metrics)
    for name, value in mine.items():
        torch.testing.assert_close(value.double(), torch.tensor(
            float(ref_metrics[verl_metric_name(name)]), dtype=torch.float64), **TOL, msg=name)
    if not keys.get("rollout_rs"):  # with rejections verl's ppo_kl is over the kept tokens
        torch.testing.assert_close(metrics["actor/ppo_kl"].double(), torch.tensor(
            float(ref_metrics["actor/ppo_kl"]), dtype=torch.float64), **TOL)
    parts = [_run_loss(settings, batch, s) for s in (slice(0, 4), slice(4, 7), slice(7, B))]
    torch.testing.assert_close(sum(p[0] for p in parts), loss, **TOL)
    for name, value in mine.items():
        torch.testing.assert_close(sum(p[2][name] for p in parts), value, **TOL, msg=name)


# --- without verl: the alias and the settings ---------------------------------------------
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["vanilla", "geo_mean"])
def test_a_plain_rollout_is_is_megarls_own_weight(level, mode):
    """rollout_is: L with threshold C (weights from the batch) gives the loss megarl's own
    tis_level: L, tis_imp_ratio_cap: C gives inside the loss: the same weight."""
    b = _batch(5)
    rc = _rc(rollout_is=level, rollout_is_threshold=1.7)
    assert rc.plain_tis == (level, 1.7)
    batch, _ = actor_batch(_step_batch(b), rc)
    verl_way = _run_loss(_settings(mode, "token-mean", rc), batch)
    own = ActorLossSettings(CLIP["clip_low"], CLIP["clip_high"], CLIP["clip_c"], "token-mean",
                            0.0, False, 0.0, "low_var_kl", 1.7, level, None, loss_mode=mode)
    megarl_way = _run_loss(own, _step_batch(b) | {"response_mask": b["mask"]})
    torch.testing.assert_close(verl_way[0], megarl_way[0], **TOL)
    torch.testing.assert_close(verl_way[1], megarl_way[1], **TOL)


def test_the_loss_refuses_a_batch_without_its_weights_and_bypass_with_another_mode():
    b = _batch(6)
    rc = _rc(rollout_is="token")
    with pytest.raises(KeyError, match="rollout_is_weights"):
        _run_loss(_settings("vanilla", "token-mean", rc), _step_batch(b))
    with pytest.raises(ValueError, match="bypass_mode's loss is its loss_type"):
        _settings("gspo", "token-mean", _rc(bypass_mode=True)).make_for_batch(b["mask"])


@pytest.mark.parametrize("keys, key", [
    (dict(rollout_is="tok"), "rollout_is"),
    (dict(rollout_is_threshold="0.5_x"), "rollout_is_threshold"),
    (dict(rollout_is_threshold="5_0.5"), "rollout_is_threshold"),
    (dict(rollout_is_threshold=True), "rollout_is_threshold"),
    (dict(rollout_is_threshold=-1), "rollout_is_threshold"),
    (dict(rollout_is_batch_normalize=True), "rollout_is_batch_normalize"),
    (dict(rollout_rs="token_k4", rollout_rs_threshold=1.0), "rollout_rs"),
    (dict(rollout_rs=" , "), "rollout_rs"),
    (dict(rollout_rs="token_k1"), "rollout_rs_threshold"),
    (dict(rollout_rs_threshold=2.0), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.1_0.2"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="2_1"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k1,token_k2", rollout_rs_threshold="1,2,3"),
     "rollout_rs_threshold"),
    (dict(loss_type="reinforce"), "loss_type"),
    (dict(loss_type="ppo"), "loss_type"),
    (dict(bypass_mode=True, rollout_is="token", rollout_is_batch_normalize=True),
     "rollout_is_batch_normalize"),
])
def test_settings_errors_name_the_key(keys, key):
    with pytest.raises(ValueError, match=rf"^algorithm\.rollout_correction\.{key}: "):
        _rc(**keys)
