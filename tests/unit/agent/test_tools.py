"""Tools, their argument checks, the call parsers, the tool worker pool, the task's reward."""
import asyncio
import json

import pytest

from megarl.agent.executor import ToolPool
from megarl.agent.parsers import parse_hermes
from megarl.agent.tasks import parse_lookup_call
from megarl.agent.tools import (ToolArgumentError, calculator, check_arguments, lookup,
                                tool_specs)
from megarl.config import ConfigError, load_config
from megarl.reward import tool_lookup

SCHEMA = {"type": "object", "required": ["key"],
          "properties": {"key": {"type": "string"}, "n": {"type": "integer"}}}


@pytest.mark.parametrize("args, why", [
    ({}, "missing required argument(s): key"),
    ({"key": "a", "zz": 1}, "unknown argument(s): zz"),
    ({"key": 3}, "argument 'key' must be of type string"),
    ({"key": "a", "n": True}, "argument 'n' must be of type integer"),
    ([1], "arguments must be a JSON object"),
])
def test_arguments_that_break_the_schema_are_named(args, why):
    with pytest.raises(ToolArgumentError, match=why.replace("(", r"\(").replace(")", r"\)")):
        check_arguments(SCHEMA, args)
    check_arguments(SCHEMA, {"key": "a", "n": 2})


def test_calculator_is_arithmetic_only():
    assert calculator("(2 + 3) * 4 - 6 / 3") == "18"
    assert calculator("7 // 2 + 7 % 2 + 2 ** 3") == "12"
    assert calculator("1 / 4") == "0.25"
    for bad in ("__import__('os')", "x + 1", "9 ** 9 ** 9", "2 +"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_lookup_reads_the_samples_table():
    assert lookup("3", table={"3": "8"}) == "8"
    with pytest.raises(KeyError):
        lookup("4", table={"3": "8"})


def test_hermes_calls_and_malformed_ones():
    text = ('I will call. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}'
            '</tool_call><tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"5\\"}"}'
            '</tool_call><tool_call>{not json</tool_call><tool_call>{"arguments": {}}'
            '</tool_call><tool_call>{"name": "lookup", "arguments": {"key": "9"}}')
    calls, errors = parse_hermes(text)
    assert [(c.name, c.arguments) for c in calls] == [
        ("calculator", {"expression": "1+2"}), ("lookup", {"key": "5"}), ("lookup", {"key": "9"})]
    assert len(errors) == 2 and "not valid JSON" in errors[0] and "name" in errors[1]
    assert parse_hermes("no call here") == ([], [])


def test_tool_config_is_checked_by_key():
    assert [s["name"] for s in tool_specs(["calculator", "lookup"])] == ["calculator", "lookup"]
    with pytest.raises(ConfigError, match=r"multi_turn.tools\[1\]: unknown built-in tool 'calc'"):
        tool_specs(["python", "calc"])
    with pytest.raises(ConfigError, match=r"tools\[0\].function"):
        tool_specs([{"name": "x", "function": "no_colon"}])
    with pytest.raises(ConfigError, match=r"given twice"):
        tool_specs(["lookup", "lookup"])
    with pytest.raises(ConfigError, match=r"multi_turn.tools: multi_turn.enable=true needs"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.enable=true"])
    with pytest.raises(ConfigError, match=r"multi_turn.tool_response_truncate_side"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=up"])
    cfg = load_config(None, ["actor_rollout_ref.rollout.multi_turn.enable=true",
                             "actor_rollout_ref.rollout.multi_turn.tools=[calculator]"])
    assert cfg.actor_rollout_ref.rollout.multi_turn.tools == ["calculator"]


TOOLS_PY = '''
import time

def raises(x: str):
    raise RuntimeError("tool broke on " + x)

def hangs(x: str):
    time.sleep(600)

def garbage(x: str):
    return {"set": str({1, 2}), "bytes": str(b"\\xff" * 3)}

def dies(x: str):
    import os
    os._exit(3)
'''


def test_failing_tools_answer_with_errors_and_the_pool_goes_on(tmp_path):
    """A tool that raises, hangs (killed at the limit), returns garbage or kills its worker:
    each call comes back as an error text (or the garbage as text); the next call works."""
    f = tmp_path / "tools_t.py"
    f.write_text(TOOLS_PY)
    any_args = {"type": "object", "properties": {"x": {"type": "string"}}}
    specs = tool_specs(["calculator"] + [{"name": n, "function": f"{f}:{n}", "parameters": any_args}
                                         for n in ("raises", "hangs", "garbage", "dies")])
    pool = ToolPool(specs, 2, 2.0)
    try:
        async def go():
            return await asyncio.gather(
                pool.call("raises", {"x": "a"}), pool.call("hangs", {"x": "a"}),
                pool.call("garbage", {"x": "a"}), pool.call("dies", {"x": "a"}),
                pool.call("calculator", {"expression": 5}), pool.call("nope", {}),
                pool.call("calculator", {"expression": "6*7"}))
        out = asyncio.run(go())
        stats = pool.stats()
    finally:
        pool.close()
    (r_ok, r_text, _), (h_ok, h_text, h_s), (g_ok, g_text, _), (d_ok, d_text, _), \
        (a_ok, a_text, _), (n_ok, n_text, _), (c_ok, c_text, _) = out
    assert not r_ok and "RuntimeError: tool broke on a" in r_text
    assert not h_ok and "timed out after 2s (worker killed)" in h_text and 2.0 <= h_s < 10
    assert g_ok and json.loads(g_text)["set"] == "{1, 2}"
    assert not d_ok and "worker process died (exit code 3)" in d_text
    assert not a_ok and "argument 'expression' must be of type string" in a_text
    assert not n_ok and "no tool named 'nope'" in n_text
    assert c_ok and c_text == "42"
    assert stats["tool/calls"] == 7 and stats["tool/failures"] == 5
    assert stats["tool/timeouts"] == 1 and stats["tool/worker_restarts"] == 2


def test_lookup_task_reward_pays_for_tool_use_not_guessing():
    # "Look up 4": the table says 7
    info = {"key": "4", "finish_reason": "stop", "final_turn": "7<|im_end|>",
            "tool_calls": [{"name": "lookup", "arguments": {"key": "4"}, "ok": True,
                            "answer": "7"}]}

    def score(**changes):
        return tool_lookup.compute_score(tool_lookup.DATA_SOURCE, "", "7", {**info, **changes})

    assert score() == 1.0
    # without the tool: a guessed answer pays nothing, the key copied pays (less if the
    # turn goes on after it)
    assert score(tool_calls=[]) == 0.0
    assert score(tool_calls=[], final_turn="4") == pytest.approx(0.3)
    assert score(tool_calls=[], final_turn="4 4<|im_end|>") == pytest.approx(0.2)
    # a wrong key: copying what the tool said, then stopping, pays; the key does not
    wrong_key = [{"name": "lookup", "arguments": {"key": "5"}, "ok": True, "answer": "2"}]
    assert score(tool_calls=wrong_key, final_turn="2<|im_end|>") == pytest.approx(0.35)
    assert score(tool_calls=wrong_key) == pytest.approx(0.05)
    # the right key, then: a wrong answer, an answer cut before its stop, an answer that
    # repeats itself, another call instead of an answer
    assert score(final_turn="3<|im_end|>") == pytest.approx(0.45)
    assert score(finish_reason="length", final_turn="7") == pytest.approx(0.65)
    assert score(final_turn="777<|im_end|>") == pytest.approx(0.5)
    assert score(final_turn="7</tool_call>") == pytest.approx(0.65)
    # a call the parser refused: no tool answered, so nothing was copied from it
    failed = [{"name": None, "arguments": None, "ok": False, "answer": "Error: ..."}]
    assert score(tool_calls=failed, final_turn="7<|im_end|>") == 0.0


def test_lookup_task_parser_reads_the_bare_key_and_the_marked_call():
    # the form the CPU task learns: one bare character that ends its turn
    for text in ("4<|im_end|>", " 4<|im_end|>", "<tool_call>4</tool_call>", "4</tool_call>",
                 "x<tool_call> 4 </tool_call>"):
        assert parse_lookup_call(text)[0][0].arguments == {"key": "4"}, text
    # an answer, not a call: longer than a key, or cut before the end of its turn
    for text in ("7", "77<|im_end|>", "7 3<|im_end|>", "<|im_end|>", "?<|im_end|>"):
        assert parse_lookup_call(text) == ([], []), text
    assert parse_lookup_call("<tool_call></tool_call>")[1]
    hermes = '<tool_call>{"name": "lookup", "arguments": {"key": "2"}}</tool_call>'
    assert parse_lookup_call(hermes)[0][0].arguments == {"key": "2"}
