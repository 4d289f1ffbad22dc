"""Tiny models, and engines served over HTTP (as a rollout server runs them)."""
import pytest

from ws_helpers import EngineServer


@pytest.fixture(scope="session")
def ws_model(qwen_dir):
    return qwen_dir


@pytest.fixture(scope="session")
def ws_model_b(qwen_dir_b):
    """Same shapes, other weights: the trainer's next version."""
    return qwen_dir_b


@pytest.fixture
def engine_server(ws_model):
    es = EngineServer(ws_model)
    yield es
    es.close()
