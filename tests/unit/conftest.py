"""Shared by the rollout-policy and agent-loop tests: a real embedded engine and a streaming
reward pool."""
import asyncio

import pytest

from megarl.reward.pool import RewardPool
from megarl.rollout.engine import EmbeddedEngine


@pytest.fixture(scope="module")
def scorer():
    pool = RewardPool("megarl.reward.testing:length_score", 2, 30.0)
    yield pool
    pool.close()


@pytest.fixture
def engine(qwen_dir):
    eng = EmbeddedEngine(qwen_dir, weight_version="0", seed=3)
    yield eng
    asyncio.run(eng.close())
