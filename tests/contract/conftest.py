"""The `stock_sglang` fixture: the pinned SGLang release's HTTP and CLI contract, read from its
own files (see stock_sglang.py). The wheel is fetched once into the cache; where no package
registry can be reached the contract tests are skipped, which is the only reason they skip."""
from __future__ import annotations

import pytest

from stock_sglang import RegistryUnreachable, StockSGLang


@pytest.fixture(scope="session")
def stock_sglang() -> StockSGLang:
    from megarl.backends.sglang import SGLANG_VERSION

    try:
        return StockSGLang.fetch(SGLANG_VERSION)
    except RegistryUnreachable as e:
        pytest.skip(str(e))
