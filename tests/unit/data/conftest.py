"""Fixtures of the data tests: the tiny tokenizer (helpers are in data_helpers.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir)
