"""The agent loop on the stock `sglang.launch_server`: token in, token out, as on the
embedded engine (tests/unit/agent/test_agent_loop.py, whose checks this reuses). Turns go
to the server as `input_ids` with stop ids; every sample must be the ids the server returned
plus the ids the loop appended, mask 1 exactly on the server's, log-probs and versions as
the server reported them. Nothing is decoded."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "agent"))

from agent_checks import Recording, check_tokens, make_agent, make_prompts, sampling  # noqa: E402

from megarl.backends.sglang import SGLangEngine  # noqa: E402
from megarl.controller.trajectory import PlainRollout, TrajectoryRunner  # noqa: E402
from megarl.data.loader import PromptLoader  # noqa: E402
from megarl.rollout.protocol import SamplingParams  # noqa: E402


def test_multi_turn_on_stock_sglang_is_generated_ids_plus_appended_ids(stock_server, qwen_dir):
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    agent = make_agent(tok, tok.eos_token_id)
    try:
        async def go():
            manager = Recording([SGLangEngine(stock_server.url)])
            runner = TrajectoryRunner(manager, tok, None, agent=agent)
            policy = PlainRollout(runner, PromptLoader(make_prompts(4), 4, shuffle=False))
            out = await policy.run_step(0, SamplingParams(**{**sampling().__dict__, "n": 2}), 0)
            await manager.close()
            return out, manager.log
        out, log = asyncio.run(go())
    finally:
        agent.close()
    multi = 0
    for j, s in enumerate(out.samples):
        served = [(q, o) for q, o in log if q.rid.split("+")[0] == f"s0-{s.uid}-{j % 2}"]
        check_tokens(s, served, tok, tok.eos_token_id)
        multi += s.agent["num_turns"] > 1
    assert multi >= 4, [s.agent["num_turns"] for s in out.samples]
