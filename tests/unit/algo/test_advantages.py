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
