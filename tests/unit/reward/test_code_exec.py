"""Built-in code reward: extracted programs scored on stdin/stdout tests in the sandbox."""
from __future__ import annotations

import json

import pytest

from megarl.reward import code_exec
from megarl.reward.registry import default_compute_score
from megarl.reward.sandbox import SandboxUnavailableError, run_program

try:
    run_program("pass")
    _UNAVAILABLE = ""
except SandboxUnavailableError as err:
    _UNAVAILABLE = str(err)
needs_sandbox = pytest.mark.skipif(
    bool(_UNAVAILABLE), reason=f"host cannot create namespaces for the sandbox: {_UNAVAILABLE}")

TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"},
         {"input": "-1 1\n", "output": "0\n"}, {"input": "2 2\n", "output": "4  \n\n"}]


def answer(body: str) -> str:
    return f"Let me think.\n```python\nprint('draft')\n```\nFinal:\n```python\n{body}\n```\n"


def test_extract_code():
    assert code_exec.extract_code(answer("x = 1")) == "x = 1\n"
    assert code_exec.extract_code("```\ny = 2\n```") == "y = 2\n"
    assert code_exec.extract_code("z = 3") == "z = 3"


def test_parse_tests_shapes_and_errors():
    a = code_exec.parse_tests(json.dumps(TESTS))
    b = code_exec.parse_tests({"inputs": [t["input"] for t in TESTS],
                               "outputs": [t["output"] for t in TESTS]})
    assert a == b and len(a) == 4
    with pytest.raises(ValueError, match="inputs"):
        code_exec.parse_tests({"inputs": ["1"]})
    with pytest.raises(ValueError, match="no test cases"):
        code_exec.parse_tests("[]")


@needs_sandbox
def test_correct_partial_wrong():
    gt = json.dumps(TESTS)
    right = answer("a, b = map(int, input().split())\nprint(a + b)")
    partial = answer("a, b = map(int, input().split())\nprint(a + b if a > 0 else 7)")
    wrong = answer("print(42)")
    assert code_exec.compute_score("code", right, gt) == 1.0
    assert code_exec.compute_score("code", partial, gt) == 0.75
    assert code_exec.compute_score("code", wrong, gt) == 0.0
    assert code_exec.compute_score("code", partial, gt, {"all_or_nothing": True}) == 0.0
    assert code_exec.compute_score("code", right, TESTS, {"all_or_nothing": True}) == 1.0
    crash = answer("raise ValueError('no')")
    assert code_exec.compute_score("code", crash, gt) == 0.0


@needs_sandbox
def test_registry_dispatch_and_time_limit():
    gt = json.dumps(TESTS[:1])
    right = answer("a, b = map(int, input().split())\nprint(a + b)")
    for ds in ("codecontests", "apps", "taco", "my_code_task"):
        assert default_compute_score(ds, right, gt) == 1.0
    slow = answer("while True: pass")
    assert code_exec.compute_score("code", slow, gt, {"time_limit_s": 0.5}) == 0.0
