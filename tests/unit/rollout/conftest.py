"""Tiny models and engines shared by the rollout unit tests (hidden 64, 2 layers)."""
import asyncio

import pytest

from megarl.utils.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("rollout") / "qwen2", arch="qwen2")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("rollout") / "llama", arch="llama", seed=3)


@pytest.fixture(scope="session")
def qwen_dir_b(tmp_path_factory):
    """Same shapes as qwen_dir, other weights: the "trainer's" next version."""
    return make_tiny_model(tmp_path_factory.mktemp("rollout") / "qwen2_b", arch="qwen2", seed=1)


@pytest.fixture
def engine(qwen_dir):
    from megarl.rollout.engine import EmbeddedEngine

    eng = EmbeddedEngine(qwen_dir, weight_version="v0")
    yield eng
    asyncio.run(eng.close())


