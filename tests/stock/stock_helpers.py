"""Helpers of the stock SGLang tests (a module with its own name, not conftest.py, so that
test modules can import it whichever conftest pytest loaded first)."""
from __future__ import annotations


def stock_args(model, python: str, **kw):
    """ServerArgs of a stock server on this CPU for `model` (fp32: equal to transformers)."""
    from megarl.backends.sglang.launcher import ServerArgs, find_free_port

    kw.setdefault("context_length", 512)
    kw.setdefault("max_running_requests", 8)
    return ServerArgs(str(model), port=find_free_port(), device="cpu", python=python,
                      dtype="float32", weight_version="0", random_seed=0, **kw)


def launched(model, python: str, tmp_path_factory, name: str):
    """A stock server on `model` started now (a context manager), its log under a temp dir."""
    from megarl.backends.sglang.launcher import launch_server

    log = tmp_path_factory.mktemp(name) / "server.log"
    return launch_server(stock_args(model, python), timeout_s=300, log_path=log)
