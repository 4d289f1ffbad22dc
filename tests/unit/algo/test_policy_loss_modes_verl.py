"""verl 0.9.1's policy loss modes (``actor.policy_loss.loss_mode``) against verl's own code.

Every mode of `POLICY_LOSS_MODES` (vanilla included), under every loss_agg_mode, on random
ragged batches (rows of 1, 2 and more valid tokens after a prompt, all-masked padding rows,
advantages of both signs, per row or per token, probabilities that move far enough to clip),
through the path a run takes (`ActorLossSettings.make_for_batch`, the actor's LossFn), is
compared with verl's registered function (verl/trainer/ppo/core_algos.py) called in one child
process (`tests/verl_reference.verl_run`) with a verl ActorConfig: the whole-batch loss, its
gradient wrt logp (verl's by autograd in the child) and verl's metrics, to 1e-5. verl's
``global_batch_info`` carries the whole batch's counts (dp_size 1, batch_num_tokens,
global_batch_size, loss_scale_factor), as its ``ppo_loss`` sets them.

Where megarl differs on purpose (policy_losses' docstring), the comparison says how:
geo_mean is compared with verl on the batch without its padding rows (verl's torch.mean
counts them); metrics under the seq-mean modes are per-sequence means in megarl, so they are
compared with the mean over sequences of verl's metric on each sequence alone (and clip_cov's
drawn tokens, which depend on the whole call, are read off verl's gradient).
"""
from __future__ import annotations

import math

import pytest
import torch

from megarl.algo.actor_loss import ActorLossSettings, make_actor_loss
from megarl.algo.aggregate import AGG_MODES, aggregate
from megarl.algo.losses import behaviour_weight, ppo_policy_loss
from megarl.algo.policy_losses import (POLICY_LOSS_MODES, PolicyLossParams, generator_for,
                                       policy_loss, token_losses)
from megarl.config import ConfigError, load_config
from megarl.config.schema import CHOICES
from tests.verl_reference import verl_run

MODES = tuple(POLICY_LOSS_MODES)
SEQ_MODES = tuple(m for m in AGG_MODES if m.startswith("seq-"))
LEVELS = (None, "token", "sequence")  # no rollout log-probs; the weight per token / sequence
C = 7  # loss_scale_factor of seq-mean-token-sum-norm
CAP = 2.0
PARAMS = PolicyLossParams(clip_low=0.2, clip_high=0.28, clip_c=3.0, tau_pos=1.5, tau_neg=2.5,
                          clip_cov_ratio=0.15, clip_cov_lb=0.02, clip_cov_ub=3.0,
                          kl_cov_ratio=0.1, ppo_kl_coef=0.3, dro_beta=0.5)
MICRO = (slice(0, 3), slice(3, 6), slice(6, 8))
PER_CALL = ("clip_cov", "kl_cov")  # choose their tokens within each call
TOL = dict(atol=1e-5, rtol=1e-5)


def _batch(seed: int, B: int = 8, T: int = 12) -> dict:
    """Rows 2 and 6 are padding; row 0 has one valid token, row 4 two; prompts before."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    for i in range(B):
        if i in (2, 6):
            continue
        start = int(torch.randint(0, 4, (1,), generator=g))
        n = {0: 1, 4: 2}.get(i) or int(torch.randint(3, T - start + 1, (1,), generator=g))
        mask[i, start:start + n] = 1
    old_p = torch.rand(B, T, generator=g) * 0.96 + 0.02
    new_p = (old_p + 0.3 * torch.randn(B, T, generator=g)).clamp(0.01, 0.99)
    adv = (torch.randn(B, generator=g) * 1.5)[:, None].expand(B, T).clone()
    if seed % 2:  # token-level advantages too
        adv = adv + 0.4 * torch.randn(B, T, generator=g)
    old = old_p.log()
    return {"mask": mask, "old": old, "logp": new_p.log(), "adv": adv,
            "behav": old + 0.6 * torch.randn(B, T, generator=g),
            "ids": torch.randint(0, 50_000, (B, T), generator=g)}


def _seed(mode, agg, level) -> int:
    return MODES.index(mode) * 100 + AGG_MODES.index(agg) * 10 + LEVELS.index(level)


def _settings(mode: str, agg: str, level: str | None = "token") -> ActorLossSettings:
    p = PARAMS
    return ActorLossSettings(
        p.clip_low, p.clip_high, p.clip_c, agg, 0.0, False, 0.0, "low_var_kl", CAP,
        level or "token", float(C), loss_mode=mode, tau_pos=p.tau_pos, tau_neg=p.tau_neg,
        clip_cov_ratio=p.clip_cov_ratio, clip_cov_lb=p.clip_cov_lb, clip_cov_ub=p.clip_cov_ub,
        kl_cov_ratio=p.kl_cov_ratio, ppo_kl_coef=p.ppo_kl_coef, dro_beta=p.dro_beta)


def _valid_rows(mask: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(mask.sum(-1) > 0).squeeze(-1)


def _megarl(mode, agg, level, b, rows=slice(None), dp_size=1):
    """The run's path: the settings' loss for the whole batch, on rows `rows`."""
    fn = _settings(mode, agg, level).make_for_batch(b["mask"], dp_size, with_max_metrics=True)
    logp = b["logp"][rows].clone().requires_grad_(True)
    mb = {"response_mask": b["mask"][rows], "old_logprobs": b["old"][rows],
          "advantages": b["adv"][rows], "input_ids": b["ids"][rows]}
    if level is not None:
        mb["rollout_logprobs"] = b["behav"][rows]
    loss, metrics = fn(logp, None, mb)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


def _call(mode, agg, level, b, rows, info) -> dict:
    """One verl call: its inputs, the IS weights verl would be handed (megarl's w), and the
    seed of torch's generator for clip_cov's draw (the one megarl's LossFn draws with)."""
    mask = b["mask"][rows]
    w = None
    if level is not None:
        w = behaviour_weight(b["old"][rows], b["behav"][rows], CAP, mask, level)[0]
    return {"mode": mode, "agg": agg, "old": b["old"][rows], "logp": b["logp"][rows],
            "adv": b["adv"][rows], "mask": mask.bool(), "w": w, "info": info,
            "seed": generator_for(b["ids"][rows]).initial_seed()}


def _info(mask: torch.Tensor) -> dict:
    return {"dp_size": 1, "batch_num_tokens": int(mask.sum()),
            "global_batch_size": int((mask.sum(-1) > 0).sum()), "loss_scale_factor": C}


CASES = [(m, a, lv) for m in MODES for a in AGG_MODES for lv in LEVELS]
METRIC_CASES = [(m, a) for m in MODES for a in AGG_MODES]

_VERL = """
from verl.trainer.ppo import core_algos as C
from verl.workers.config import ActorConfig, PolicyLossConfig

p = inputs["params"]
for key, call in inputs["calls"].items():
    cfg = ActorConfig(
        strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
        clip_ratio=p["clip_low"], clip_ratio_low=p["clip_low"], clip_ratio_high=p["clip_high"],
        clip_ratio_c=p["clip_c"], tau_pos=p["tau_pos"], tau_neg=p["tau_neg"],
        loss_agg_mode=call["agg"], loss_scale_factor=inputs["C"],
        policy_loss=PolicyLossConfig(
            loss_mode=call["mode"], clip_cov_ratio=p["clip_cov_ratio"],
            clip_cov_lb=p["clip_cov_lb"], clip_cov_ub=p["clip_cov_ub"],
            kl_cov_ratio=p["kl_cov_ratio"], ppo_kl_coef=p["ppo_kl_coef"],
            dro_beta=p["dro_beta"]))
    cfg.global_batch_info.update(call["info"])
    logp = call["logp"].clone().requires_grad_(True)
    torch.manual_seed(call["seed"])
    loss, metrics = C.get_policy_loss_fn(call["mode"])(
        old_log_prob=call["old"], log_prob=logp, advantages=call["adv"],
        response_mask=call["mask"], loss_agg_mode=call["agg"], config=cfg,
        rollout_is_weights=call["w"])
    (grad,) = torch.autograd.grad(loss, logp)
    outputs[key] = {"loss": loss.detach(), "grad": grad, "metrics": metrics}
"""


@pytest.fixture(scope="module")
def verl():
    """Every verl call of this module, in one child process."""
    calls = {}
    for mode, agg, level in CASES:
        b = _batch(_seed(mode, agg, level))
        # geo_mean: verl's torch.mean also counts padding rows; compare on the sequences
        rows = _valid_rows(b["mask"]) if mode == "geo_mean" else slice(None)
        calls[("whole", mode, agg, level)] = _call(mode, agg, level, b, rows,
                                                   _info(b["mask"][rows]))
        if mode in PER_CALL:  # each micro-batch, normalised by the whole batch's counts
            for i, s in enumerate(MICRO):
                calls[("micro", mode, agg, level, i)] = _call(mode, agg, level, b, s,
                                                              _info(b["mask"]))
        if level is None and agg in SEQ_MODES:  # each sequence alone: its token means
            for r in _valid_rows(b["mask"]).tolist():
                calls[("row", mode, agg, r)] = _call(mode, agg, None, b, slice(r, r + 1), {})
    params = {k: getattr(PARAMS, k) for k in PARAMS.__dataclass_fields__}
    return verl_run(_VERL, {"calls": calls, "params": params, "C": C})


@pytest.mark.parametrize("mode, agg, level", CASES)
def test_whole_batch_loss_and_gradient_match_verl(verl, mode, agg, level):
    b = _batch(_seed(mode, agg, level))
    loss, grad, _ = _megarl(mode, agg, level, b)
    ref = verl[("whole", mode, agg, level)]
    torch.testing.assert_close(loss, ref["loss"].float(), **TOL)
    if mode == "geo_mean":
        rows = _valid_rows(b["mask"])
        torch.testing.assert_close(grad[rows], ref["grad"], **TOL)
        assert not grad[b["mask"].sum(-1) == 0].any()  # padding rows count nowhere
    else:
        torch.testing.assert_close(grad, ref["grad"], **TOL)
    assert grad.abs().sum() > 0


def _clip_cov_drawn(b: dict, verl_grad: torch.Tensor) -> torch.Tensor:
    """The tokens verl's clip_cov drew, read off its gradient: valid, not stopped by the
    PPO clip, and still without gradient."""
    ratio = (b["logp"] - b["old"]).exp()
    clipped = -b["adv"] * ratio.clamp(1 - PARAMS.clip_low, 1 + PARAMS.clip_high) > \
        -b["adv"] * ratio
    return (b["mask"] > 0) & ~clipped & (verl_grad == 0)


@pytest.mark.parametrize("mode, agg", METRIC_CASES)
def test_metrics_match_verl(verl, mode, agg):
    """verl's metric names and values: the whole batch's token means under token-mean and
    token-sum; under the seq-mean modes megarl's per-sequence means, i.e. the mean over the
    sequences of verl's metric on each sequence alone."""
    b = _batch(_seed(mode, agg, None))
    _, _, metrics = _megarl(mode, agg, None, b)
    ref = verl[("whole", mode, agg, None)]
    assert set(ref["metrics"]) <= set(metrics), (sorted(ref["metrics"]), sorted(metrics))
    rows = _valid_rows(b["mask"]).tolist()
    for name, value in ref["metrics"].items():
        if agg not in SEQ_MODES:
            expected = torch.tensor(float(value))
        elif mode == "clip_cov" and name == "actor/pg_clipfrac":
            drawn = _clip_cov_drawn(b, ref["grad"]).float()
            expected = aggregate(drawn, b["mask"], "seq-mean-token-mean")
        else:
            expected = torch.tensor(sum(float(verl[("row", mode, agg, r)]["metrics"][name])
                                        for r in rows) / len(rows))
        torch.testing.assert_close(metrics[name], expected, **TOL, msg=name)
    if mode == "clip_cov":  # the read-off is right: its token mean is verl's own fraction
        drawn = _clip_cov_drawn(b, ref["grad"]).float()
        assert drawn.sum() > 0
        if agg not in SEQ_MODES:
            torch.testing.assert_close(aggregate(drawn, b["mask"]),
                                       torch.tensor(ref["metrics"]["actor/pg_clipfrac"]), **TOL)


@pytest.mark.parametrize("mode, agg, level", CASES)
def test_micro_batch_shares(verl, mode, agg, level):
    """Shares over micro-batches (padding rows in their own micro-batch and with others) sum
    to the whole batch's loss, gradient and metrics; clip_cov and kl_cov choose their tokens
    in each call, like verl, so each share is verl's call on that micro-batch instead."""
    b = _batch(_seed(mode, agg, level))
    whole, whole_grad, whole_m = _megarl(mode, agg, level, b)
    parts = [_megarl(mode, agg, level, b, s) for s in MICRO]
    grad = torch.cat([p[1] for p in parts])
    if mode in PER_CALL:
        for i, (share, g, _) in enumerate(parts):
            ref = verl[("micro", mode, agg, level, i)]
            torch.testing.assert_close(share, ref["loss"].float(), **TOL)
            torch.testing.assert_close(g, ref["grad"], **TOL)
        return
    torch.testing.assert_close(sum(p[0] for p in parts), whole, **TOL)
    torch.testing.assert_close(grad, whole_grad, **TOL)
    for name, value in whole_m.items():
        reduce = max if name.endswith("_max") else sum
        torch.testing.assert_close(reduce(p[2][name] for p in parts), value, **TOL, msg=name)


@pytest.mark.parametrize("mode", ["sapo", "geo_mean", "gspo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_data_parallel_shards_average_to_the_batch(mode, agg):
    """Two replicas, each normalising by the whole batch's counts / 2: their average is the
    whole batch's loss (sapo and geo_mean divide by its sequence count whatever agg)."""
    b = _batch(7)
    whole = _megarl(mode, agg, "token", b)[0]
    shards = [_megarl(mode, agg, "token", b, s, dp_size=2)[0] for s in (slice(0, 5),
                                                                      slice(5, 8))]
    torch.testing.assert_close((shards[0] + shards[1]) / 2, whole, **TOL)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "vanilla"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_behaviour_weight_multiplies_the_token_loss_detached(mode, level):
    """With rollout log-probs each token's loss is times w = min(pi_prox / pi_behav, cap),
    computed without a gradient (geo_mean: each sequence's geometric mean of its tokens' w)."""
    b = _batch(11)
    b["behav"] = b["old"] - 1.5 * torch.rand(b["old"].shape, generator=torch.Generator()
                                              .manual_seed(3))  # many weights past the cap
    mask = b["mask"]
    logp = b["logp"].clone().requires_grad_(True)
    behav = b["behav"].clone().requires_grad_(True)
    old = b["old"].clone().requires_grad_(True)
    w = behaviour_weight(b["old"], b["behav"], CAP, mask, level)[0]
    assert (w == CAP).any() and (w < CAP).any()
    entry = POLICY_LOSS_MODES[mode]
    if entry.sequence_weight:
        n = mask.sum(-1, keepdim=True).clamp(min=1)
        w = torch.exp((w.log() * mask).sum(-1, keepdim=True) / n).expand_as(w)
    agg = entry.agg or "token-sum"
    matrix, _ = token_losses(mode, logp, old, b["adv"], mask, PARAMS,
                             generator=torch.Generator().manual_seed(5))
    expected = aggregate(matrix * w, mask, agg)
    loss, stats = policy_loss(mode, logp, old, b["adv"], mask, PARAMS, behav_logp=behav,
                              tis_cap=CAP, level=level, agg="token-sum",
                              generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(loss, expected, **TOL)
    g_loss, g_behav, g_old = torch.autograd.grad(loss, (logp, behav, old), allow_unused=True)
    (g_expected,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(g_loss, g_expected, **TOL)
    assert g_behav is None and g_old is None  # w (and the proximal policy) carry no gradient
    assert {"tis_weight_mean", "tis_truncated_frac", "logp_mismatch", "tis_weight_max"} <= \
        set(stats)


def test_vanilla_is_ppo_policy_loss_bit_for_bit():
    b = _batch(13)
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-mean",
              entropy_coeff=0.0, tis_imp_ratio_cap=CAP, denom=4.0)
    mb = {"response_mask": b["mask"], "old_logprobs": b["old"], "advantages": b["adv"],
          "rollout_logprobs": b["behav"]}
    loss, _ = make_actor_loss(**kw)(b["logp"], None, mb)
    ref, _ = ppo_policy_loss(b["logp"], b["old"], b["adv"], b["mask"], 0.2, 0.28, 3.0,
                             behav_logp=b["behav"], tis_cap=CAP, agg="seq-mean-token-mean",
                             denom=4.0)
    assert torch.equal(loss, ref)


# --- the config key reaches the loss -------------------------------------------------------
A = "actor_rollout_ref.actor"


def test_choices_are_the_registry():
    assert CHOICES[f"{A}.policy_loss.loss_mode"] == MODES


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ConfigError, match=rf"^{A}\.policy_loss\.loss_mode: 'gspoo' is not one "
                                          r"of vanilla, gspo, .*did you mean `gspo`"):
        load_config(None, [f"{A}.policy_loss.loss_mode=gspoo"])
    with pytest.raises(ValueError, match="unknown policy loss_mode 'gspoo'; choose from "
                                         "vanilla, gspo, sapo"):
        make_actor_loss(clip_ratio_low=0.2, clip_ratio_high=0.2, loss_mode="gspoo")


def test_dro_needs_its_beta_and_clip_cov_ordered_bounds():
    with pytest.raises(ConfigError, match=rf"^{A}\.policy_loss\.dro_beta: required"):
        load_config(None, [f"{A}.policy_loss.loss_mode=dro"])
    load_config(None, [f"{A}.policy_loss.loss_mode=dro", f"{A}.policy_loss.dro_beta=0.1"])
    with pytest.raises(ConfigError, match=rf"^{A}\.policy_loss\.clip_cov_lb: 5.0 must be less"):
        load_config(None, [f"{A}.policy_loss.loss_mode=clip_cov", f"{A}.policy_loss.clip_cov_lb=5"])
    with pytest.raises(ValueError, match="dro needs dro_beta > 0"):
        make_actor_loss(clip_ratio_low=0.2, clip_ratio_high=0.2, loss_mode="dro")


@pytest.mark.parametrize("mode", [m for m in MODES if m != "vanilla"])
def test_a_mode_set_in_the_config_is_the_runs_loss(mode):
    """The run's path: config -> megatron_spec's ActorLossSettings -> make_for_batch -> the
    LossFn, equal to `policy_loss(mode)` with the config's values (none of them defaults),
    and not the vanilla loss."""
    from megarl.cluster.spec import megatron_spec

    cfg = load_config(None, [
        f"{A}.policy_loss.loss_mode={mode}", f"{A}.clip_ratio_low=0.15",
        f"{A}.clip_ratio_high=0.3", f"{A}.clip_ratio_c=2.5", f"{A}.tau_pos=1.7",
        f"{A}.tau_neg=2.2", f"{A}.policy_loss.clip_cov_ratio=0.2",
        f"{A}.policy_loss.clip_cov_lb=0.01", f"{A}.policy_loss.clip_cov_ub=4.0",
        f"{A}.policy_loss.kl_cov_ratio=0.2", f"{A}.policy_loss.ppo_kl_coef=0.4",
        f"{A}.policy_loss.dro_beta=0.7", f"{A}.loss_agg_mode=seq-mean-token-mean"])
    settings = megatron_spec(cfg, "actor").actor_loss
    assert settings.loss_mode == mode
    b = _batch(17)
    mb = {"response_mask": b["mask"], "old_logprobs": b["old"], "advantages": b["adv"],
          "input_ids": b["ids"]}
    loss, metrics = settings.make_for_batch(b["mask"])(b["logp"], None, mb)
    params = PolicyLossParams(0.15, 0.3, 2.5, 1.7, 2.2, 0.2, 0.01, 4.0, 0.2, 0.4, 0.7)
    ref, _ = policy_loss(mode, b["logp"], b["old"], b["adv"], b["mask"], params,
                         agg="seq-mean-token-mean", generator=generator_for(b["ids"]))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(metrics["actor/pg_loss"], ref)
    vanilla, _ = policy_loss("vanilla", b["logp"], b["old"], b["adv"], b["mask"], params,
                             agg="seq-mean-token-mean")
    assert not math.isclose(float(loss), float(vanilla), rel_tol=1e-4)
