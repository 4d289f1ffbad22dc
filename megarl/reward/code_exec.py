"""Built-in reward for coding tasks: run the response's program on stdin/stdout test cases.

The program is the last fenced ```` ```python ```` block of the response (else the last plain
```` ``` ```` block, else the whole text). ``ground_truth`` holds the tests as JSON (a string) or
as the decoded value, in either common shape:

- ``[{"input": "1 2\\n", "output": "3\\n"}, ...]``
- ``{"inputs": [...], "outputs": [...]}`` (APPS / TACO style)

Each test runs in ``megarl.reward.sandbox.run_program`` (fresh namespaces, time and memory
limits, no network). Outputs are compared after stripping trailing whitespace on every line
and trailing blank lines. The score is the fraction of tests passed, or 1/0 when
``extra_info["all_or_nothing"]`` is true (it then stops at the first failure). ``extra_info``
may also set ``time_limit_s`` and ``memory_limit_mb`` per task. Deliberately left out:
special judges (floating-point tolerance, several valid answers) and function-call style tests.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

from megarl.reward.sandbox import run_program

DATA_SOURCES = ("code", "codecontests", "deepmind/code_contests", "apps", "codeparrot/apps",
                "taco", "BAAI/TACO")
DEFAULT_TIME_LIMIT_S = 5.0
DEFAULT_MEMORY_LIMIT_MB = 256

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last ```python block, else the last fenced block, else the whole text."""
    blocks = _FENCE.findall(text)
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if py:
        return py[-1]
    if blocks:
        return blocks[-1][1]
    return text


def parse_tests(ground_truth: Any) -> list[tuple[str, str]]:
    """(stdin, expected stdout) pairs from either test shape; ValueError names what is wrong."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if isinstance(tests, dict):
        if "inputs" not in tests or "outputs" not in tests:
            raise ValueError(f"code tests: a dict needs 'inputs' and 'outputs', got keys "
                             f"{sorted(tests)}")
        if len(tests["inputs"]) != len(tests["outputs"]):
            raise ValueError(f"code tests: {len(tests['inputs'])} inputs but "
                             f"{len(tests['outputs'])} outputs")
        pairs = list(zip(tests["inputs"], tests["outputs"]))
    elif isinstance(tests, list):
        try:
            pairs = [(t["input"], t["output"]) for t in tests]
        except (TypeError, KeyError) as err:
            raise ValueError(f"code tests: each list item needs 'input' and 'output' ({err})")
    else:
        raise ValueError(f"code tests: expected a list or dict, got {type(tests).__name__}")
    if not pairs:
        raise ValueError("code tests: no test cases")
    return [(_as_text(i), _as_text(o)) for i, o in pairs]


def _as_text(value) -> str:
    if isinstance(value, list):  # some sets store lines as a list
        return "\n".join(map(str, value))
    return str(value)


def normalize_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def compute_score(data_source: str, solution_str: str, ground_truth,
                  extra_info: Optional[dict] = None) -> float:
    """Fraction of test cases the extracted program passes (verl's signature)."""
    del data_source
    opts = extra_info or {}
    tests = parse_tests(ground_truth)
    code = extract_code(solution_str)
    all_or_nothing = bool(opts.get("all_or_nothing", False))
    passed = 0
    for stdin, expected in tests:
        result = run_program(code, stdin,
                             time_limit_s=float(opts.get("time_limit_s", DEFAULT_TIME_LIMIT_S)),
                             memory_limit_mb=int(opts.get("memory_limit_mb",
                                                          DEFAULT_MEMORY_LIMIT_MB)))
        ok = result.ok and normalize_output(result.stdout) == normalize_output(expected)
        passed += ok
        if all_or_nothing and not ok:
            return 0.0
    return 1.0 if all_or_nothing else passed / len(tests)
