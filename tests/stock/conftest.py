"""Tests against the stock `sglang.launch_server` (the pinned release) running on this CPU.

Every test in this folder is marked `stock_sglang`. The server runs from its own environment
(tools/setup_sglang_env.sh; .ci/run builds it before the suite): when that environment is
absent the `stock_python` fixture (tests/conftest.py) builds it once, and where it cannot be
built the tests skip naming why. A server costs ~20 s to start (mostly imports), so the
protocol tests share one per model for the whole session and leave it as they found it
(unpaused, version restored or asserted from a known base).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the launch helpers of the multi-process tests (torchrun'd rank programs)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from stock_helpers import launched  # noqa: E402


# tryfirst: xdist's own hook turns the xdist_group marks into groups, so they must be there
# before it runs
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.stock_sglang)
            # one xdist worker runs every test of the session server (`--dist loadgroup`), so
            # it is started once, not once per worker; a module with a server of its own is a
            # group of its own, free to run beside them on the other worker
            uses_session = "stock_server" in getattr(item, "fixturenames", ())
            group = "stock_server" if uses_session else f"stock:{Path(str(item.fspath)).stem}"
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def stock_server(stock_python, qwen_dir, tmp_path_factory):
    """One stock server on `qwen_dir` (the default tiny Qwen2) for the session."""
    with launched(qwen_dir, stock_python, tmp_path_factory, "stock") as server:
        yield server
