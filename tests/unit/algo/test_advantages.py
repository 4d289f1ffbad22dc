"""GRPO advantages and token broadcasting against hand-computed values."""
import math

import pytest
import torch

from megarl.algo.advantages import broadcast_to_tokens, group_index, grpo_advantages

# group "a": rewards [1, 0, 0] -> mean 1/3, deviations [2/3, -1/3, -1/3],
#            unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3, std = 0.57735
# group "b": rewards [2, 4]    -> mean 3, deviations [-1, 1], unbiased var 2, std = 1.41421
REWARDS = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0])
GROUPS = ["a", "b", "a", "b", "a"]
S3 = math.sqrt(1 / 3)


def test_grpo_with_std_norm():
    adv = grpo_advantages(REWARDS, GROUPS, norm_by_std=True, eps=0.0)
    want = torch.tensor([(2 / 3) / S3, -1 / math.sqrt(2), (-1 / 3) / S3, 1 / math.sqrt(2),
                         (-1 / 3) / S3])  # [1.1547, -0.7071, -0.5774, 0.7071, -0.5774]
    torch.testing.assert_close(adv, want)


def test_grpo_without_std_norm():
    adv = grpo_advantages(REWARDS, GROUPS, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1.0, -1 / 3, 1.0, -1 / 3]))


def test_eps_in_denominator():
    # group [2, 4]: std sqrt(2); eps = 0.5 -> adv = +-1 / (1.41421 + 0.5) = +-0.52241
    adv = grpo_advantages(torch.tensor([2.0, 4.0]), [7, 7], eps=0.5)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0]) / (math.sqrt(2) + 0.5))


def test_identical_and_singleton_groups_give_zero():
    rewards = torch.tensor([5.0, 5.0, 5.0, 3.0, 1.0, 0.0])
    groups = ["same", "same", "same", "solo", "pair", "pair"]
    for norm in (True, False):
        adv = grpo_advantages(rewards, groups, norm_by_std=norm)
        assert torch.isfinite(adv).all()
        torch.testing.assert_close(adv[:4], torch.zeros(4))
    # the pair [1, 0]: mean 0.5, std sqrt(0.5) -> +-0.5 / 0.70711 = +-0.70711
    adv = grpo_advantages(rewards, groups, eps=0.0)
    torch.testing.assert_close(adv[4:], torch.tensor([1.0, -1.0]) / math.sqrt(2))


def test_tensor_group_ids_match_list():
    ids = torch.tensor([10, 3, 10, 3, 10])
    torch.testing.assert_close(grpo_advantages(REWARDS, ids), grpo_advantages(REWARDS, GROUPS))


def test_group_index_order_of_first_appearance():
    idx, n = group_index(["x", "y", "x", "z"])
    assert idx.tolist() == [0, 1, 0, 2] and n == 3


def test_length_mismatch_raises():
    with pytest.raises(ValueError):
        grpo_advantages(torch.tensor([1.0, 2.0]), ["a"])


def test_broadcast_to_tokens():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0, 3.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0, 2.0, 2.0, 0], [-1.0] * 4, [0.0] * 4]))
    with pytest.raises(ValueError):
        broadcast_to_tokens(torch.tensor([1.0]), mask)


# --- Dr. GRPO, RLOO, REINFORCE++ (+ baseline) and the dispatcher -------------------------------
from megarl.algo.advantages import (ADV_ESTIMATORS, compute_advantages,  # noqa: E402
                                    discounted_returns, drgrpo_advantages, gdpo_advantages,
                                    gpg_advantages,
                                    grpo_passk_advantages, masked_whiten, opo_advantages,
                                    reinforce_plus_plus_advantages,
                                    reinforce_plus_plus_baseline_advantages, rloo_advantages,
                                    token_rewards)


def test_drgrpo_is_mean_centred_only():
    torch.testing.assert_close(drgrpo_advantages(REWARDS, GROUPS),
                               torch.tensor([2 / 3, -1.0, -1 / 3, 1.0, -1 / 3]))


def test_rloo_leave_one_out():
    # "a" [1, 0, 0]: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (twice)
    # "b" [2, 4]:    2 - 4 = -2; 4 - 2 = 2
    torch.testing.assert_close(rloo_advantages(REWARDS, GROUPS),
                               torch.tensor([1.0, -2.0, -0.5, 2.0, -0.5]))


def test_rloo_and_drgrpo_constant_and_singleton_groups_are_exactly_zero():
    # 0.1 * 3 / 3 need not round back to 0.1; the constant-group check makes it exactly 0
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 1.0, 0.0])
    groups = ["same", "same", "same", "solo", "pair", "pair"]
    for fn in (rloo_advantages, drgrpo_advantages, grpo_advantages):
        adv = fn(rewards, groups)
        assert torch.count_nonzero(adv[:4]) == 0 and torch.isfinite(adv).all()


def test_token_rewards_on_last_response_token():
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]])
    out = token_rewards(torch.tensor([2.0, 3.0, 5.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0, 0, 2.0, 0], [0, 0, 0, 3.0], [0.0] * 4]))
    dense = torch.full((3, 4), 1.0)
    torch.testing.assert_close(token_rewards(dense, mask), mask.float())


def test_discounted_returns():
    # row 0: rewards [x, 0.2, -0.1, 1] on tokens 1..3, gamma 1 -> [0, 1.1, 0.9, 1]
    # row 1: reward 2 on the last token of mask [1, 0, 1, 0], gamma 0.5: the hole is skipped
    #        -> [1, 0, 2, 0]
    r = torch.tensor([[9.0, 0.2, -0.1, 1.0], [0.0, 0.0, 2.0, 0.0]])
    m = torch.tensor([[0, 1, 1, 1], [1, 0, 1, 0]])
    torch.testing.assert_close(discounted_returns(r, m, 1.0)[0], torch.tensor([0, 1.1, 0.9, 1]))
    torch.testing.assert_close(discounted_returns(r, m, 0.5)[1], torch.tensor([1.0, 0, 2, 0]))


def test_reinforce_plus_plus_hand_computed():
    # gamma 0.5. row 0: reward 1 on token 3 -> returns [., 0.25, 0.5, 1]; row 1: reward 0.
    # valid returns [0.25, 0.5, 1, 0, 0]: mean 0.35, squared deviations sum 0.7,
    # unbiased var 0.7 / 4 = 0.175 -> std 0.418330; row 2 all masked
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    adv = reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0, 7.0]), mask, gamma=0.5, eps=0)
    s = math.sqrt(0.175)
    want = torch.tensor([[0, -0.1 / s, 0.15 / s, 0.65 / s], [-0.35 / s, -0.35 / s, 0, 0],
                         [0.0] * 4])
    torch.testing.assert_close(adv, want)


def test_reinforce_plus_plus_baseline_hand_computed():
    # group means: "a" [1, 0] -> [0.5, -0.5]; "b" [3, 3] constant -> [0, 0]
    # tokens: row 0 two (0.5, 0.5), row 1 one (-0.5), row 2 one (0), row 3 none
    # mean 0.125, deviations [.375, .375, -.625, -.125], squares sum 0.6875, var 0.6875 / 3
    mask = torch.tensor([[1, 1, 0], [0, 1, 0], [0, 0, 1], [0, 0, 0]])
    adv = reinforce_plus_plus_baseline_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]),
                                                  ["a", "a", "b", "b"], mask, eps=0)
    s = math.sqrt(0.6875 / 3)
    want = torch.tensor([[0.375, 0.375, 0], [0, -0.625, 0], [0, 0, -0.125], [0, 0, 0]]) / s
    torch.testing.assert_close(adv, want)


def test_masked_whiten_degenerate_inputs_give_zero():
    v = torch.full((2, 3), 0.1)
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert torch.count_nonzero(masked_whiten(v, m)) == 0            # constant
    assert torch.count_nonzero(masked_whiten(v, torch.zeros(2, 3))) == 0  # nothing valid
    one = torch.zeros(2, 3)
    one[0, 0] = 1
    assert torch.count_nonzero(masked_whiten(torch.randn(2, 3), one)) == 0  # one token


def test_dispatcher_matches_estimators():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0]])
    bt = broadcast_to_tokens
    cases = {
        "grpo": bt(grpo_advantages(REWARDS, GROUPS), mask),
        "drgrpo": bt(drgrpo_advantages(REWARDS, GROUPS), mask),
        "rloo": bt(rloo_advantages(REWARDS, GROUPS), mask),
        "reinforce_plus_plus": reinforce_plus_plus_advantages(REWARDS, mask),
        "reinforce_plus_plus_baseline":
            reinforce_plus_plus_baseline_advantages(REWARDS, GROUPS, mask),
        # verl's further outcome estimators (checked against verl in
        # test_adv_estimators_verl.py)
        "rloo_vectorized": bt(rloo_advantages(REWARDS, GROUPS), mask),
        "grpo_passk": bt(grpo_passk_advantages(REWARDS, GROUPS), mask),
        "opo": bt(opo_advantages(REWARDS, GROUPS, mask.sum(-1)), mask),
        "gpg": bt(gpg_advantages(REWARDS, GROUPS), mask),
    }
    for name, want in cases.items():
        torch.testing.assert_close(compute_advantages(name, REWARDS, GROUPS, mask), want,
                                   msg=name)
    torch.testing.assert_close(
        compute_advantages("grpo", REWARDS, GROUPS, mask, norm_by_std=False), cases["drgrpo"])
    # remax: the greedy baseline's reward subtracted (test_adv_estimators_verl.py)
    base = torch.linspace(-1, 1, len(REWARDS))
    torch.testing.assert_close(
        compute_advantages("remax", REWARDS, GROUPS, mask, baselines=base),
        bt(REWARDS - base, mask))
    # gdpo: each component's GRPO advantage, weighted, whitened (test_adv_estimators_verl.py)
    comps = torch.stack([REWARDS, REWARDS.flip(0)])
    torch.testing.assert_close(
        compute_advantages("gdpo", REWARDS, GROUPS, mask, components=comps,
                           component_weights=[1.0, 0.5]),
        gdpo_advantages(comps, GROUPS, mask, [1.0, 0.5]))
    assert set(cases) | {"gae", "remax", "gdpo"} == set(ADV_ESTIMATORS)


def test_dispatcher_sums_token_rewards_for_group_estimators():
    mask = torch.tensor([[1, 1], [1, 0], [0, 1]])
    tok = torch.tensor([[0.5, 0.5], [0.0, 9.0], [9.0, 2.0]])  # masked 9s do not count
    want = broadcast_to_tokens(rloo_advantages(torch.tensor([1.0, 0.0, 2.0]), [0, 0, 0]), mask)
    torch.testing.assert_close(compute_advantages("rloo", tok, [0, 0, 0], mask), want)


def test_dispatcher_errors():
    mask = torch.ones(2, 2)
    r = torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match="critic's values"):
        compute_advantages("gae", r, [0, 0], mask)
    with pytest.raises(ValueError, match="choose from"):
        compute_advantages("ppo", r, [0, 0], mask)
    with pytest.raises(ValueError, match="gamma"):
        compute_advantages("grpo", r, [0, 0], mask, gamma=0.99)
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("rloo", r, None, mask)
    compute_advantages("reinforce_plus_plus", r, None, mask, gamma=0.99)  # no groups needed


@pytest.mark.parametrize("name", [n for n in ADV_ESTIMATORS if n != "gae"])
def test_all_masked_and_zero_variance_no_nan(name):
    r = torch.tensor([1.0, 1.0, 1.0, 1.0])
    groups = ["a", "a", "b", "b"]
    # remax: a baseline equal to the reward is its "no spread"
    kw = {"baselines": r} if name == "remax" else {}
    if name == "gdpo":  # its components, each without spread
        kw = {"components": torch.stack([r, 2 * r])}
    for mask in (torch.zeros(4, 3), torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])):
        adv = compute_advantages(name, r, groups, mask, **kw)
        assert adv.shape == (4, 3) and torch.count_nonzero(adv) == 0, name
    # a mixed batch with an all-masked row: finite, zero on that row and off the mask
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    adv = compute_advantages(name, torch.tensor([1.0, 0.0, 5.0, 2.0]), groups, mask, **kw)
    assert torch.isfinite(adv).all() and torch.count_nonzero(adv * (1 - mask)) == 0
