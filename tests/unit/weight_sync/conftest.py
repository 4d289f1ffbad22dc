"""Tiny models and an engine on its own event-loop thread (as a server would run it)."""
import pytest

from ws_helpers import EngineThread


@pytest.fixture(scope="session")
def ws_model(qwen_dir):
    return qwen_dir


@pytest.fixture(scope="session")
def ws_model_b(qwen_dir_b):
    """Same shapes, other weights: the trainer's next version."""
    return qwen_dir_b


@pytest.fixture
def engine_thread(ws_model):
    et = EngineThread(ws_model)
    yield et
    et.close()
