"""SGLang backend: an HTTP client (one method per endpoint), the rollout-protocol adapter over
it, and a launcher for `python -m sglang.launch_server`. SGLang itself is a GPU extra
(`pip install -e .[gpu]`); nothing here imports it except tensor-update serialization.

`SGLANG_VERSION` is the stock release megarl's wire contract is checked against (the contract
tests read that release's own files) and the one the `gpu` extra installs."""
SGLANG_VERSION = "0.5.23"

from megarl.backends.sglang.client import SGLangClient, SGLangError
from megarl.backends.sglang.engine import SGLangEngine
from megarl.backends.sglang.launcher import ServerArgs, build_command, launch_server

__all__ = ["SGLangClient", "SGLangError", "SGLangEngine", "ServerArgs", "build_command",
           "launch_server"]
