"""Shared fixtures: tiny HF models made locally (launch helpers live in integration/launch_helpers.py)."""
from __future__ import annotations

from pathlib import Path

import pytest


def _make(tmp_path_factory, arch: str) -> Path:
    from megarl.utils.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp(f"tiny-{arch}") / "model"
    # vocab 300 is not a multiple of 128×TP, so Megatron's vocab padding is always exercised.
    return make_tiny_model(out, arch, vocab_size=300, hidden_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, intermediate_size=128,
                           rope_theta=5000.0 if arch == "qwen2" else 10000.0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """Qwen2-shaped: QKV bias, tied embeddings, GQA."""
    return _make(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """Llama-shaped: no bias, untied embeddings, GQA."""
    return _make(tmp_path_factory, "llama")
