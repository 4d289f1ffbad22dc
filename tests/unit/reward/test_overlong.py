"""DAPO's overlong penalty (verl's reward.reward_kwargs.overlong_buffer_cfg): its values, and
the reward pool adding it to a generated response's score by its length in tokens."""
import asyncio

import pytest

from megarl.config import load_config
from megarl.config.errors import ConfigError
from megarl.config.validate import validate_config
from megarl.controller.batch import Sample
from megarl.reward.overlong import OverlongPenalty
from megarl.reward.pool import RewardPool

KEY = "reward.reward_kwargs.overlong_buffer_cfg"


def test_zero_until_the_buffer_then_linear_to_minus_the_factor():
    # verl's DAPO manager: min(-(L - (max_resp_len - len)) / len * factor, 0)
    p = OverlongPenalty(max_resp_len=10, buffer_len=4, factor=2.0)
    assert [p(n) for n in (1, 6, 7, 8, 10)] == [0.0, 0.0, -0.5, -1.0, -2.0]


def _cfg(*overrides):
    return load_config(None, ["data.max_response_length=10", *overrides])


def test_from_config_reads_verls_keys_and_defaults_the_budget_to_max_response_length():
    assert OverlongPenalty.from_config(_cfg().reward, 10) is None  # off by default
    on = [f"{KEY}.enable=true", f"{KEY}.len=4", f"{KEY}.penalty_factor=0.5"]
    assert OverlongPenalty.from_config(_cfg(*on).reward, 10) == OverlongPenalty(10, 4, 0.5)
    cfg = _cfg(*on, "reward.reward_kwargs.max_resp_len=8")
    assert OverlongPenalty.from_config(cfg.reward, 10) == OverlongPenalty(8, 4, 0.5)


@pytest.mark.parametrize("overrides, message", [
    ([f"{KEY}.enable=true"], rf"{KEY}\.len: 0; the penalty needs a buffer"),
    ([f"{KEY}.enable=true", f"{KEY}.len=11"], rf"{KEY}\.len: 11 is longer than the response "
                                              r"budget .*: 10\)"),
])
def test_bad_settings_are_refused_by_key_before_the_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(_cfg(*overrides))


def test_the_pool_adds_it_to_the_score_and_keeps_the_score():
    def sample(n_tokens):
        return Sample(uid="u", prompt_ids=[1], response_ids=[2] * n_tokens,
                      rollout_logprobs=[0.0] * n_tokens, weight_version=0,
                      token_versions=[0] * n_tokens, finish="length", data_source="x",
                      response_text="abc", reward=-99.0)

    async def go(pool, samples):
        return await asyncio.gather(*[pool.submit(s) for s in samples])

    short, long_ = sample(3), sample(8)
    with RewardPool("megarl.reward.testing:length_score", 1, 30.0,
                    overlong=OverlongPenalty(10, 4)) as pool:
        assert asyncio.run(go(pool, [short, long_])) == [3.0, 2.5]  # length_score: 3 chars
    assert (short.score, short.reward, long_.score, long_.reward) == (3.0, 3.0, 3.0, 2.5)
