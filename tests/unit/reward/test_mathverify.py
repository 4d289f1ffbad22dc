"""The opt-in Math-Verify scorer against verl 0.9.1's ``math_verify.compute_score`` (its own
code, run by ``verl_run`` in one child process): the same score on every case."""
from __future__ import annotations

import pytest

pytest.importorskip("math_verify", reason="Math-Verify is a test extra: pip install -e .[test]")

from megarl.reward.mathverify import compute_score  # noqa: E402
from tests.verl_reference import verl_run  # noqa: E402

# (response, ground truth): right and wrong answers in the shapes models write them
CASES = [
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("The answer is $\\boxed{0.5}$.", "\\frac{1}{2}"),
    ("So we get $\\boxed{\\dfrac12}$", "\\frac{1}{2}"),
    ("Final: 1/3", "\\frac{1}{3}"),
    ("Final: 0.33", "\\frac{1}{3}"),
    ("x = 5", "5"),
    ("$x=5$", "5"),
    ("The result is $\\boxed{x=5}$", "5"),
    ("I get 4", "5"),
    ("$\\boxed{-7}$", "-7"),
    ("$\\boxed{7}$", "-7"),
    ("$\\boxed{\\sqrt{2}}$", "\\sqrt2"),
    ("$\\boxed{\\sqrt{8}}$", "2\\sqrt{2}"),
    ("$\\boxed{1.4142}$", "\\sqrt{2}"),
    ("$\\boxed{\\pi}$", "\\pi"),
    ("$\\boxed{3.14159}$", "\\pi"),
    ("$\\boxed{2\\pi r}$", "2 \\pi r"),
    ("$\\boxed{90^\\circ}$", "90"),
    ("$\\boxed{90}$", "90^\\circ"),
    ("$\\boxed{50\\%}$", "50"),
    ("$\\boxed{0.5}$", "50\\%"),
    ("$\\boxed{[1, 2)}$", "[1,2)"),
    ("$\\boxed{(1, 2)}$", "[1,2)"),
    ("$\\boxed{\\{1, 2, 3\\}}$", "\\{3,2,1\\}"),
    ("$\\boxed{1, 2, 3}$", "1,2,3"),
    ("$\\boxed{(-\\infty, 3]}$", "(-\\infty,3]"),
    ("$\\boxed{x^2 + 2x + 1}$", "(x+1)^2"),
    ("$\\boxed{x^2 + 1}$", "(x+1)^2"),
    ("$\\boxed{\\frac{\\sqrt{3}}{2}}$", "\\frac{\\sqrt{3}}{2}"),
    ("$\\boxed{\\frac{1}{\\sqrt{3}}}$", "\\frac{\\sqrt{3}}{3}"),
    ("$\\boxed{1000}$", "1,000"),
    ("$\\boxed{1,000}$", "1000"),
    ("$\\boxed{10^{3}}$", "1000"),
    ("$\\boxed{1e3}$", "1000"),
    ("$\\boxed{\\text{B}}$", "B"),
    ("The answer is (C).", "C"),
    ("$\\boxed{y = 2x + 3}$", "y=2x+3"),
    ("$\\boxed{2x + 3}$", "y=2x+3"),
    ("no answer here", "7"),
    ("", "7"),
    ("$\\boxed{}$", "7"),
    ("The value is 12 and then 13", "13"),
    ("The value is 12 and then 13", "12"),
    ("$\\boxed{\\frac{22}{7}}$", "\\frac{22}{7}"),
    ("$\\boxed{3.142857}$", "\\frac{22}{7}"),
    ("$\\boxed{a = 2, b = 3}$", "a=2,b=3"),
    ("$\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}$",
     "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("$\\boxed{\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}}$",
     "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("$\\boxed{e^{i\\pi}}$", "-1"),
    ("$\\boxed{\\log_2 8}$", "3"),
    ("$\\boxed{\\binom{5}{2}}$", "10"),
    ("$\\boxed{5!}$", "120"),
    ("$\\boxed{\\infty}$", "\\infty"),
    ("$\\boxed{\\emptyset}$", "\\emptyset"),
    ("$\\boxed{2+3i}$", "2+3i"),
    ("$\\boxed{3i+2}$", "2+3i"),
    ("$\\boxed{0.125}$", "\\frac18"),
    ("$\\boxed{\\frac{2}{16}}$", "\\frac18"),
    ("$\\boxed{-\\frac{3}{4}}$", "-0.75"),
    ("$\\boxed{\\frac{-3}{4}}$", "-\\frac{3}{4}"),
    ("Therefore $n = 42$.", "42"),
    ("Therefore $n = 41$.", "42"),
]

VERL_CODE = '''
from verl.utils.reward_score import math_verify
outputs["scores"] = [math_verify.compute_score(sol, gt) for sol, gt in inputs["cases"]]
'''


def test_scores_equal_verls_math_verify():
    verl = verl_run(VERL_CODE, {"cases": CASES})["scores"]
    ours = [compute_score("math", sol, gt) for sol, gt in CASES]
    wrong = [f"{c!r}: verl {v!r}, megarl {m!r}" for c, v, m in zip(CASES, verl, ours)
             if float(v) != m]
    assert not wrong, "\n".join(wrong)
    assert len(CASES) >= 60 and 10 < sum(ours) < len(CASES) - 10  # both outcomes covered
    print(f"math-verify: {len(CASES)} cases equal to verl's, {int(sum(ours))} scored 1")
