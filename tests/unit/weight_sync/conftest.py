"""Tiny models and an engine on its own event-loop thread (as a server would run it)."""
import pytest

from megarl.utils.tiny_model import make_tiny_model
from ws_helpers import EngineThread


@pytest.fixture(scope="session")
def ws_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("ws") / "qwen2", arch="qwen2")


@pytest.fixture(scope="session")
def ws_model_b(tmp_path_factory):
    """Same shapes, other weights: the trainer's next version."""
    return make_tiny_model(tmp_path_factory.mktemp("ws") / "qwen2_b", arch="qwen2", seed=1)


@pytest.fixture
def engine_thread(ws_model):
    et = EngineThread(ws_model)
    yield et
    et.close()
