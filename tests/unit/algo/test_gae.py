"""GAE against hand-computed values and an independent compress-then-scan loop, on ragged
masks (prompt prefixes, holes inside the response, all-masked rows)."""
import pytest
import torch

from megarl.algo.advantages import compute_advantages, gae_advantages, token_rewards

# Row 0: prompt at t=0, response t=1..3, score 1 on the last token.
# Row 1: a hole at t=2 (its reward 7 and value 9 must be ignored), score 2.
# Row 2: no response at all.   Row 3: one response token, score -1.
MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 1], [0, 0, 0, 0], [0, 0, 0, 1]])
REW = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 7.0, 2.0], [0.0] * 4,
                    [0.0, 0.0, 0.0, -1.0]])
VAL = torch.tensor([[5.0, 0.5, 0.2, 0.4], [0.1, 0.3, 9.0, 0.5], [1.0] * 4,
                    [0.0, 0.0, 0.0, 0.25]])


def test_gae_by_hand():
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72), delta_t = r_t + 0.9 V_next - V_t
    # row 0: t3 delta 1 - 0.4 = 0.6 -> A 0.6; t2 delta 0.36 - 0.2 = 0.16 -> A 0.16 + 0.72*0.6
    #        = 0.592; t1 delta 0.18 - 0.5 = -0.32 -> A -0.32 + 0.72*0.592 = 0.10624
    # row 1: t3 delta 2 - 0.5 = 1.5; t2 skipped (V_next 0.5, A_next 1.5 carried);
    #        t1 delta 0.45 - 0.3 = 0.15 -> A 0.15 + 1.08 = 1.23;
    #        t0 delta 0.27 - 0.1 = 0.17 -> A 0.17 + 0.72*1.23 = 1.0556
    # row 3: t3 delta -1 - 0.25 = -1.25
    adv, ret = gae_advantages(REW, VAL, MASK, gamma=0.9, lam=0.8, whiten=False)
    want = torch.tensor([[0.0, 0.10624, 0.592, 0.6], [1.0556, 1.23, 0.0, 1.5], [0.0] * 4,
                         [0.0, 0.0, 0.0, -1.25]])
    torch.testing.assert_close(adv, want)
    # returns = A + V on the mask, 0 elsewhere
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.60624, 0.792, 1.0],
                                                  [1.1556, 1.53, 0.0, 2.0], [0.0] * 4,
                                                  [0.0, 0.0, 0.0, -1.0]]))


def test_gamma_lam_one_is_monte_carlo_minus_value():
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t, R_t = that sum
    adv, ret = gae_advantages(REW, VAL, MASK, gamma=1.0, lam=1.0, whiten=False)
    torch.testing.assert_close(adv[0], torch.tensor([0.0, 0.5, 0.8, 0.6]))
    torch.testing.assert_close(ret[1], torch.tensor([2.0, 2.0, 0.0, 2.0]))


def _reference(rew, val, mask, gamma, lam):
    """Compress each row to its valid tokens, run textbook GAE, scatter back."""
    adv, ret = torch.zeros_like(rew), torch.zeros_like(rew)
    for i in range(rew.shape[0]):
        idx = [t for t in range(rew.shape[1]) if mask[i, t]]
        a_next, v_next = 0.0, 0.0
        for t in reversed(idx):
            a = float(rew[i, t]) + gamma * v_next - float(val[i, t]) + gamma * lam * a_next
            adv[i, t], ret[i, t] = a, a + float(val[i, t])
            a_next, v_next = a, float(val[i, t])
    return adv, ret


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_independent_loop_and_whitens(seed):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(6, 9, generator=g) > 0.35).long()
    mask[2] = 0
    rew, val = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g)
    want_adv, want_ret = _reference(rew, val, mask, 0.95, 0.7)
    adv, ret = gae_advantages(rew, val, mask, 0.95, 0.7, whiten=False)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)
    # whitened over every valid token of the batch: (A - mean) / (unbiased std + 1e-6)
    valid = [float(want_adv[i, t]) for i in range(6) for t in range(9) if mask[i, t]]
    mean = sum(valid) / len(valid)
    std = (sum((x - mean) ** 2 for x in valid) / (len(valid) - 1)) ** 0.5
    white, ret2 = gae_advantages(rew, val, mask, 0.95, 0.7)
    torch.testing.assert_close(white, (want_adv - mean) / (std + 1e-6) * mask)
    torch.testing.assert_close(ret2, want_ret)  # returns are never whitened


def test_dispatcher_places_scores_on_last_token_and_needs_values():
    scores = torch.tensor([1.0, 2.0, 0.0, -1.0])
    adv = compute_advantages("gae", scores, None, MASK, gamma=0.9, lam=0.8, values=VAL)
    want, _ = gae_advantages(token_rewards(scores, MASK), VAL, MASK, 0.9, 0.8)
    torch.testing.assert_close(adv, want)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", scores, None, MASK)


def test_gae_on_kl_in_reward_token_rewards():
    from megarl.algo.kl import apply_kl_in_reward

    # k1 penalty 0.1 * (logp - ref) = [0.05, -0.05] -> token rewards [-0.05, 1 + 0.05]
    # gamma = lam = 1, V = [0.2, 0.4]: A1 = 1.05 - 0.4 = 0.65, A0 = -0.05 + 0.4 - 0.2 + 0.65
    mask = torch.ones(1, 2)
    tok, _ = apply_kl_in_reward(torch.tensor([1.0]), torch.tensor([[0.5, -0.5]]),
                                torch.zeros(1, 2), mask, kind="k1", coef=0.1)
    adv, ret = gae_advantages(tok, torch.tensor([[0.2, 0.4]]), mask, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.65]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.05]]))
