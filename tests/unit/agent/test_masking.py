"""Tool answers in a multi-turn sample carry no loss: whatever sits at their positions
(advantages, old, behaviour and reference log-probs, the trainer's own log-probs and
entropy, values) changes neither the loss nor any gradient, and every normaliser counts
only the model's own tokens."""
import pytest
import torch

from megarl.algo.actor_loss import make_actor_loss
from megarl.algo.advantages import compute_advantages, gae_advantages, token_rewards
from megarl.algo.aggregate import AGG_MODES, global_denom, stats_mode
from megarl.algo.kl import apply_kl_in_reward
from megarl.algo.value_loss import value_loss
from megarl.controller.batch import Sample, build_batch


def _samples():
    # prompt 3 tokens; responses: model, tool answer (mask 0), model again; one plain
    def s(uid, mask, reward, n=None):
        n = n or len(mask)
        return Sample(uid=uid, prompt_ids=[1, 2, 3], response_ids=list(range(10, 10 + n)),
                      rollout_logprobs=[-0.5] * n, weight_version=0, token_versions=[0] * n,
                      finish="stop", reward=reward, loss_mask=mask)
    return [s("a", [1, 1, 0, 0, 0, 1, 1], 1.0), s("a", [1, 0, 0, 1, 1, 1], 0.0),
            s("b", [1, 1, 1, 0, 0, 0, 0, 0, 1], 0.5), s("b", None, 0.2, n=5)]


def _perturb(t, holes, gen):
    return torch.where(holes, t + torch.randn(t.shape, generator=gen) * 3, t)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_appended_positions_change_no_loss_and_no_gradient(mode):
    samples = _samples()
    b = build_batch(samples, 0)
    mask = b["response_mask"]
    holes = (b["attention_mask"] > 0) & (mask == 0)
    holes[:, :3] = False  # prompt positions are outside the response either way
    assert holes.sum() == 10
    gen = torch.Generator().manual_seed(0)
    adv = compute_advantages("grpo", b["rewards"], [s.uid for s in samples], mask)
    assert torch.all(adv[holes] == 0), "advantages are 0 on the tool answers"
    lp = torch.randn(mask.shape, generator=gen) * 0.3 - 1.0
    ent = torch.rand(mask.shape, generator=gen)
    base = {"response_mask": mask, "advantages": adv + torch.randn(mask.shape, generator=gen),
            "old_logprobs": lp + 0.05 * torch.randn(mask.shape, generator=gen),
            "rollout_logprobs": lp + 0.1 * torch.randn(mask.shape, generator=gen),
            "ref_logprobs": lp + 0.2 * torch.randn(mask.shape, generator=gen)}
    denom = global_denom(mask, mode, loss_scale_factor=16.0)
    stats = global_denom(mask, stats_mode(mode), loss_scale_factor=16.0)
    fn = make_actor_loss(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode,
                         entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                         denom=denom, stats_denom=stats)

    def run(mb, logprobs, entropy):
        x = logprobs.clone().requires_grad_(True)
        e = entropy.clone().requires_grad_(True)
        loss, metrics = fn(x, e, mb)
        loss.backward()
        return loss.detach(), x.grad, e.grad, metrics

    ref = run(base, lp, ent)
    moved = {k: (_perturb(v, holes, gen) if k != "response_mask" else v) for k, v in base.items()}
    got = run(moved, _perturb(lp, holes, gen), _perturb(ent, holes, gen))
    assert torch.equal(ref[0], got[0])
    assert torch.equal(ref[1], got[1]) and torch.equal(ref[2], got[2])
    assert torch.all(ref[1][holes] == 0) and torch.all(ref[2][holes] == 0)
    assert set(ref[3]) == set(got[3])
    for k in ref[3]:
        assert torch.equal(ref[3][k], got[3][k]), k
    if mode == "token-mean":
        own = sum(sum(s.loss_mask or [1] * len(s.response_ids)) for s in samples)
        assert float(denom) == own == 17


def test_rewards_values_and_kl_skip_the_tool_answers():
    samples = _samples()
    b = build_batch(samples, 0)
    mask = b["response_mask"]
    holes = (b["attention_mask"] > 0) & (mask == 0)
    holes[:, :3] = False
    gen = torch.Generator().manual_seed(1)
    # the outcome reward sits on the last token the model wrote, never on a tool answer
    tr = token_rewards(b["rewards"], mask)
    for i, s in enumerate(samples):
        last = 3 + max(j for j, m in enumerate(s.loss_mask or [1] * len(s.response_ids)) if m)
        assert tr[i, last] == s.reward and tr[i].count_nonzero() <= 1
    lp = torch.randn(mask.shape, generator=gen)
    ref = torch.randn(mask.shape, generator=gen)
    with_kl, m1 = apply_kl_in_reward(b["rewards"], lp, ref, mask, "k1", 0.1)
    with_kl2, m2 = apply_kl_in_reward(b["rewards"], _perturb(lp, holes, gen),
                                      _perturb(ref, holes, gen), mask, "k1", 0.1)
    assert torch.equal(with_kl, with_kl2) and m1 == m2
    values = torch.randn(mask.shape, generator=gen)
    adv, ret = gae_advantages(with_kl, values, mask, gamma=0.99, lam=0.95)
    adv2, ret2 = gae_advantages(with_kl, _perturb(values, holes, gen), mask, gamma=0.99, lam=0.95)
    assert torch.allclose(adv, adv2, atol=0, rtol=0) and torch.equal(ret, ret2)
    assert torch.all(adv[holes] == 0) and torch.all(ret[holes] == 0)
    vp = (values + 0.1).requires_grad_(True)
    loss, _ = value_loss(vp, values, ret, mask, 0.5, "token-mean")
    loss.backward()
    assert torch.all(vp.grad[holes] == 0)
