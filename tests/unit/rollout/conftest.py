"""The engine fixture of the rollout unit tests (the tiny models are in tests/conftest.py)."""
import asyncio

import pytest


@pytest.fixture
def engine(qwen_dir):
    from megarl.rollout.engine import EmbeddedEngine

    eng = EmbeddedEngine(qwen_dir, weight_version="0")
    yield eng
    asyncio.run(eng.close())


