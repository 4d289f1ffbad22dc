"""Shared by the agent-loop tests on the embedded engine (tests/unit/agent) and on stock
SGLang (tests/stock): a recording manager, the test's parser (every turn ended by a stop id
calls the calculator), and the token-in-token-out check of a sample against what the engine
served. Nothing here decodes."""
import pytest
from omegaconf import OmegaConf

from megarl.agent.loop import AgentLoop
from megarl.agent.parsers import ToolCall
from megarl.agent.tools import tool_specs
from megarl.config.schema import MultiTurnConfig
from megarl.data.dataset import Prompt
from megarl.rollout.manager import RolloutManager
from megarl.rollout.protocol import SamplingParams

BUDGET = 48
HEAD, TAIL = "<r>", "</r>\n"


class Recording(RolloutManager):
    """The real manager, keeping every (request, output) it served."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log = []

    async def generate(self, request):
        out = await super().generate(request)
        self.log.append((request, out))
        return out


def every_turn_calls(text):
    # a turn the model ended with a stop id asks 1 + (its length in chars) * 3
    return [ToolCall("calculator", {"expression": f"1 + {len(text)} * 3"})], []


def make_prompts(count):
    return [Prompt(index=i, uid=f"p{i}", prompt_ids=[5 + i % 50, 7, 11 + i % 13],
                   raw_prompt="", data_source="t", ground_truth=str(i),
                   extra_info={"tools_kwargs": {}}) for i in range(count)]


def sampling(seed=1):
    return SamplingParams(max_new_tokens=BUDGET, temperature=1.0,
                          stop_token_ids=list(range(0, 300, 10)), sampling_seed=seed)


def make_agent(tokenizer, eos_id, min_turn_tokens=0):
    cfg = OmegaConf.merge(OmegaConf.structured(MultiTurnConfig), {
        "enable": True, "tools": ["calculator"], "max_assistant_turns": 4,
        "tool_response_template": HEAD + "{content}" + TAIL, "max_tool_response_length": 6})
    loop = AgentLoop(cfg, tokenizer, [eos_id], tool_specs(cfg.tools),
                     min_turn_tokens=min_turn_tokens)
    loop.parser = every_turn_calls
    return loop


def runs(xs, value):
    """[start, end) of the maximal runs of `value` in xs."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j < len(xs) and xs[j] == xs[i]:
            j += 1
        if xs[i] == value:
            out.append((i, j))
        i = j
    return out


def check_tokens(sample, served, tok, eos):
    """The sample equals the engine's outputs plus the loop's appended ids; see module doc."""
    P, resp, mask = len(sample.prompt_ids), sample.response_ids, sample.loss_mask
    assert len(mask) == len(resp) == len(sample.rollout_logprobs) == len(sample.token_versions)
    covered = [0] * len(resp)
    for req, out in served:
        start = len(req.input_ids) - P
        assert req.input_ids == sample.prompt_ids + resp[:start]
        end = start + len(out.output_ids)
        assert resp[start:end] == out.output_ids
        assert sample.rollout_logprobs[start:end] == pytest.approx(out.output_logprobs)
        assert sample.token_versions[start:end] == out.token_versions()
        for i in range(start, end):
            covered[i] += 1
    assert covered == mask, "mask 1 exactly on what the engine generated, each once"
    calls = sample.agent["calls"]
    gaps = runs(mask, 0)
    assert len(gaps) == len(calls) and sample.agent["num_turns"] == len(runs(mask, 1))
    for (a, b), call in zip(gaps, calls):
        assert call["at"] == a and call["ok"]
        closed = resp[a - 1] == eos
        want = ([] if closed else [eos]) + tok.encode(HEAD, add_special_tokens=False) + \
            tok.encode(call["answer"], add_special_tokens=False, split_special_tokens=True)[:6] + \
            tok.encode(TAIL, add_special_tokens=False)
        if b == len(resp) and sample.finish == "length":
            want = want[:b - a]  # cut at the budget
        assert resp[a:b] == want
        assert set(sample.token_versions[a:b]) == {sample.token_versions[a - 1]}
        assert sample.rollout_logprobs[a:b] == [0.0] * (b - a)
