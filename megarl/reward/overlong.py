"""DAPO's overlong reward shaping: a penalty that grows over the last tokens of the budget.

verl's keys (its DAPO reward manager, verl/workers/reward_manager/dapo.py of 0.9.1):
``reward.reward_kwargs.overlong_buffer_cfg.{enable,len,penalty_factor,log}`` and
``reward.reward_kwargs.max_resp_len``. With L the response's length in tokens (its stop token
included), B the buffer length and F the factor:

    penalty = min(0, -(L - (max_resp_len - B)) / B * F)

0 up to ``max_resp_len - B`` tokens, then falling linearly to ``-F`` at ``max_resp_len``: a
response that runs into the cap is told so gradually, instead of a truncated answer being
scored as if it had ended. The reward that trains is the score plus the penalty; the score
alone stays on the sample (verl's ``acc``), for `algorithm.filter_groups.metric`. verl applies
it only under ``reward.reward_manager.name=dapo``; megarl whenever ``enable`` is set, in
training and validation alike (verl's validation uses the same manager).
"""
from __future__ import annotations

import dataclasses

from megarl.utils.errors import ConfigError

KEY = "reward.reward_kwargs.overlong_buffer_cfg"


@dataclasses.dataclass(frozen=True)
class OverlongPenalty:
    max_resp_len: int
    buffer_len: int
    factor: float = 1.0

    def __call__(self, n_tokens: int) -> float:
        exceed = n_tokens - (self.max_resp_len - self.buffer_len)
        return min(-exceed / self.buffer_len * self.factor, 0.0)

    @classmethod
    def from_config(cls, reward_cfg, max_response_length: int) -> "OverlongPenalty | None":
        """None when off; ``max_resp_len`` null means ``data.max_response_length``."""
        kw = reward_cfg.reward_kwargs
        buf = kw.overlong_buffer_cfg
        if not buf.enable:
            return None
        cap = int(kw.max_resp_len if kw.max_resp_len is not None else max_response_length)
        if not int(buf.len) > 0:
            raise ConfigError(f"{KEY}.len: {buf.len}; the penalty needs a buffer of at least "
                              "one token when enabled")
        if cap < int(buf.len):
            raise ConfigError(f"{KEY}.len: {buf.len} is longer than the response budget "
                              f"(reward.reward_kwargs.max_resp_len, else data.max_response_"
                              f"length: {cap})")
        return cls(cap, int(buf.len), float(buf.penalty_factor))
