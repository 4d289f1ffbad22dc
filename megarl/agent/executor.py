"""Tool calls run in worker processes, each with a deadline; a hung tool is killed.

`ToolPool` is the reward pool's machinery (`megarl.reward.pool.RewardPool`: spawned workers,
one call per worker at a time, a timed-out worker killed and replaced, a dead one replaced)
serving tool calls instead of reward calls. Every way a call can fail — bad arguments, the
tool raising, a timeout, the worker dying — comes back as an error text for the model: the
rollout goes on.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

from megarl.reward.pool import RewardPool

from .tools import check_arguments, load_tools, result_text


def load_tool_caller(specs_json: str) -> Callable[[str, dict, dict], str]:
    """(name, arguments, per-sample kwargs) -> the tool's answer text; in a worker."""
    tools = load_tools(specs_json)

    def call(name: str, arguments: dict, context: dict) -> str:
        if name not in tools:
            raise LookupError(f"no tool named {name!r}; tools are {sorted(tools)}")
        fn, schema = tools[name]
        check_arguments(schema, arguments)
        return result_text(fn(**arguments, **(context or {})))
    return call


class ToolPool(RewardPool):
    """`num_workers` processes calling the tools of `specs` (`megarl.agent.tools.tool_specs`)."""

    KIND = "tool"
    CALLER = "megarl.agent.executor:load_tool_caller"

    def _check_spec(self, spec) -> None:
        load_tools(spec)  # a bad import path fails here, named, before any worker starts

    def __init__(self, specs: list[dict], num_workers: int, timeout_s: float):
        self.specs = specs
        super().__init__(json.dumps(specs), num_workers, timeout_s)

    async def call(self, name: str, arguments: dict, context: dict | None = None
                   ) -> tuple[bool, str, float]:
        """(ok, answer or error text, seconds); never raises for a failing tool."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        t0 = time.monotonic()

        def done(value, error):
            def resolve():
                if not fut.done():
                    fut.set_result((error is None, value if error is None else error))
            try:
                loop.call_soon_threadsafe(resolve)
            except RuntimeError:  # the loop closed while the tool ran; nobody waits
                pass
        self._enqueue((name, arguments, dict(context or {})), done)
        ok, text = await fut
        return ok, str(text), time.monotonic() - t0
