"""The actor LossFn (PPO + entropy + KL) on worker-shaped micro-batches, and its config adapter."""
import math

import pytest
import torch
from omegaconf import OmegaConf

from megarl.algo.actor_loss import make_actor_loss, make_actor_loss_from_config
from megarl.algo.aggregate import global_denom
from megarl.config.schema import ActorConfig

KW = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
          loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0,
          kl_loss_type="low_var_kl", tis_imp_ratio_cap=2.0, denom=None)


def _mb():
    """One sequence of 4 tokens, the last two are the response; prompt positions hold junk."""
    old = torch.tensor([[0.0, -7.0, math.log(0.5), math.log(0.25)]])
    return {
        "response_mask": torch.tensor([[0, 0, 1, 1]]),
        "advantages": torch.tensor([2.0]),
        "old_logprobs": old,
        "ref_logprobs": torch.tensor([[5.0, 5.0, math.log(0.25), math.log(0.5)]]),
    }, old.clone()


def test_pg_entropy_and_kl_terms():
    mb, logp = _mb()
    entropy = torch.tensor([[9.0, 9.0, 1.0, 3.0]])
    # r = 1 everywhere -> pg = -A = -2 per token, token-mean -2
    # entropy mean over response (1 + 3) / 2 = 2, times 0.01 subtracted -> -0.02
    # k3 with d = [+ln2, -ln2]: [0.5 - 1 + ln2, 2 - 1 - ln2] -> mean exactly 0.25, times 0.1
    # total -2 - 0.02 + 0.025 = -1.995
    fn = make_actor_loss(**{**KW, "entropy_coeff": 0.01, "use_kl_loss": True,
                            "kl_loss_coef": 0.1})
    loss, m = fn(logp, entropy, mb)
    torch.testing.assert_close(loss, torch.tensor(-1.995))
    torch.testing.assert_close(m["actor/pg_loss"], torch.tensor(-2.0))
    torch.testing.assert_close(m["actor/entropy"], torch.tensor(2.0))
    torch.testing.assert_close(m["actor/kl_loss"], torch.tensor(0.25))
    assert set(m) == {"actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                      "actor/ppo_kl", "actor/ratio_mean", "actor/entropy", "actor/kl_loss"}


def test_token_level_advantages_equal_sample_level():
    mb, logp = _mb()
    fn = make_actor_loss(**KW)
    a, _ = fn(logp + 0.1, None, mb)
    mb["advantages"] = torch.tensor([[-50.0, 50.0, 2.0, 2.0]])  # junk outside the response
    b, _ = fn(logp + 0.1, None, mb)
    torch.testing.assert_close(a, b)


def test_rollout_logprobs_give_tis_metrics():
    mb, logp = _mb()
    # behaviour log-probs: proximal/behaviour = [3 -> capped 2, 1]; pg = -2 * w -> (-4 - 2) / 2
    mb["rollout_logprobs"] = mb["old_logprobs"] - torch.tensor([[0.0, 0.0, math.log(3), 0.0]])
    loss, m = make_actor_loss(**KW)(logp, None, mb)
    torch.testing.assert_close(loss, torch.tensor(-3.0))
    torch.testing.assert_close(m["actor/tis_weight_mean"], torch.tensor(1.5))
    torch.testing.assert_close(m["actor/tis_truncated_frac"], torch.tensor(0.5))
    torch.testing.assert_close(m["actor/logp_mismatch"], torch.tensor(math.log(3) / 2))


def test_missing_inputs_raise():
    mb, logp = _mb()
    with pytest.raises(ValueError, match="with_entropy"):
        make_actor_loss(**{**KW, "entropy_coeff": 0.01})(logp, None, mb)
    del mb["ref_logprobs"]
    with pytest.raises(KeyError, match="ref_logprobs"):
        make_actor_loss(**{**KW, "use_kl_loss": True})(logp, None, mb)
    with pytest.raises(ValueError):
        make_actor_loss(**{**KW, "loss_agg_mode": "sum"})


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batches_sum_to_batch(mode):
    g = torch.Generator().manual_seed(1)
    B, S = 6, 7
    old = -torch.rand(B, S, generator=g) * 2
    mask = torch.zeros(B, S)
    for i, start in enumerate([2, 3, 4, 2, 5, 7]):  # row 5: no response at all
        mask[i, start:] = 1
    batch = {"response_mask": mask, "advantages": torch.randn(B, generator=g),
             "old_logprobs": old, "rollout_logprobs": old + 0.5 * torch.randn(B, S, generator=g),
             "ref_logprobs": old + 0.3 * torch.randn(B, S, generator=g)}
    logp = (old + 0.3 * torch.randn(B, S, generator=g)).requires_grad_(True)
    ent = torch.rand(B, S, generator=g)
    kw = {**KW, "loss_agg_mode": mode, "entropy_coeff": 0.01, "use_kl_loss": True,
          "kl_loss_coef": 0.05, "clip_ratio_high": 0.28}
    whole, m_whole = make_actor_loss(**kw)(logp, ent, batch)
    (g_whole,) = torch.autograd.grad(whole, logp)
    fn = make_actor_loss(**{**kw, "denom": global_denom(mask, mode)})
    parts = [fn(logp[s], ent[s], {k: v[s] for k, v in batch.items()})
             for s in (slice(0, 2), slice(2, 4), slice(4, 6))]
    total = sum(p[0] for p in parts)
    torch.testing.assert_close(total, whole)
    (g_parts,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(g_parts, g_whole)
    for k, v in m_whole.items():
        torch.testing.assert_close(sum(p[1][k] for p in parts), v, msg=k)


def test_from_config_null_clip_bounds_fall_back():
    cfg = OmegaConf.structured(ActorConfig)
    cfg.clip_ratio = 0.3
    mb, old = _mb()
    mb["advantages"] = torch.tensor([1.0])
    logp = old + math.log(1.5)  # r = 1.5 on both response tokens
    loss, _ = make_actor_loss_from_config(cfg)(logp, None, mb)
    torch.testing.assert_close(loss, torch.tensor(-1.3))  # clipped at 1 + 0.3
    cfg.clip_ratio_high = 0.5
    loss, _ = make_actor_loss_from_config(cfg, denom=4.0)(logp, None, mb)
    torch.testing.assert_close(loss, torch.tensor(-1.5 * 2 / 4))  # unclipped, a 2/4 share


def test_max_metrics_only_on_request_and_tis_level():
    from megarl.algo.actor_loss import MAX_METRICS
    mb, logp = _mb()
    # behaviour: ratios 3 and 1 per token -> sequence weight 3, capped to 2 on both tokens
    mb["rollout_logprobs"] = mb["old_logprobs"] - torch.tensor([[0.0, 0.0, math.log(3), 0.0]])
    _, m = make_actor_loss(**KW)(logp, None, mb)
    assert not set(MAX_METRICS) & set(m)
    loss, m = make_actor_loss(**{**KW, "tis_level": "sequence"}, with_max_metrics=True)(
        logp, None, mb)
    torch.testing.assert_close(loss, torch.tensor(-4.0))  # -A * w = -2 * 2 per token
    torch.testing.assert_close(m["actor/tis_weight_max"], torch.tensor(3.0))
    torch.testing.assert_close(m["actor/ratio_max"], torch.tensor(1.0))
    torch.testing.assert_close(m["actor/tis_truncated_frac"], torch.tensor(1.0))
    with pytest.raises(ValueError):
        make_actor_loss(**{**KW, "tis_level": "batch"})


def test_from_config_reads_tis_level_when_present():
    plain = OmegaConf.to_container(OmegaConf.structured(ActorConfig))
    mb, logp = _mb()
    mb["rollout_logprobs"] = mb["old_logprobs"] - torch.tensor([[0.0, 0.0, math.log(3), 0.0]])
    token, _ = make_actor_loss_from_config(OmegaConf.create(plain))(logp, None, mb)
    seq, _ = make_actor_loss_from_config(OmegaConf.create({**plain, "tis_level": "sequence"}))(
        logp, None, mb)
    torch.testing.assert_close(token, torch.tensor(-3.0))
    torch.testing.assert_close(seq, torch.tensor(-4.0))
