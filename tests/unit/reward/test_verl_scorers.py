"""megarl's built-in scorers against verl 0.9.1's ``default_compute_score``, case by case.

Every family verl's dispatch names (its code sets aside) gets cases written to exercise its
rules: formats, extraction edge cases, LaTeX variants, wrong answers, empty strings, answers
past the length limits. One child process (``verl_run``, once for the module) scores them all
with verl's own code; megarl's ``default_compute_score`` must return the same thing: the same
exception type, or the same value of the same type (a float, or a dict with the same keys,
values and value types).

Two of verl's scorers import packages megarl's environment lacks: ``prime_math`` (the
``numina_*`` sets) needs pylatexenc, ``geo3k`` needs mathruler (and pylatexenc). Their cases
carry the result verl 0.9.1 gave with pylatexenc 2.11 and mathruler 0.1.0 installed
(recorded 2026-11-28; re-record by running verl with both on ``PYTHONPATH``), which megarl
must equal. The child also runs verl's ``prime_math`` live: where pylatexenc is missing it
stands megarl's ``latex_to_text`` in for it (so everything but the LaTeX-to-text step is
verl's own), and that live result must agree too. ``latex_to_text`` itself is checked against
pylatexenc 2.11's recorded output (and live, where pylatexenc is installed).
"""
from __future__ import annotations

import pytest

from megarl.reward import default_compute_score
from megarl.reward.latex_text import latex_to_text
from megarl.reward.registry import (DATA_SOURCES, VERL_PREFIXES, VERL_SOURCES,
                                    UnknownDataSourceError, builtin_for)
from tests.verl_reference import verl_run

SOURCES = {  # family -> the data sources its cases cycle through
    "gsm8k": ("openai/gsm8k",),
    "math": ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"),
    "math_dapo": ("math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime_2025", "aime"),
    "numina": ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime",
               "numina_synthetic_amc", "numina_cn_k12", "numina_olympiads"),
    "geo3k": ("hiyouga/geometry3k",),
    "search_r1": ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                  "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle"),
}
MIN_CASES = 60
PAD = "Let me think step by step. " * 12  # 324 characters of reasoning

GSM8K = [  # (response, ground truth): "#### N" in the last 300 characters, compared as text
    ("Natalia sold 48/2 = 24 clips in May. 48+24 = 72\n#### 72", "72"),
    ("#### 72", "72"),
    ("#### 72\n", "72"),
    ("The answer is 72.", "72"),
    ("The answer is \\boxed{72}", "72"),
    ("####72", "72"),
    ("####  72", "72"),
    ("## 72", "72"),
    ("##### 72", "72"),
    ("#### 1,000", "1000"),
    ("#### 1,000", "1,000"),
    ("#### 7,2", "72"),
    ("#### 72,", "72"),
    ("#### $1,000", "1000"),
    ("#### -5", "-5"),
    ("#### --5", "-5"),
    ("#### - 5", "-5"),
    ("#### 3.50", "3.5"),
    ("#### 3.5", "3.5"),
    ("#### 72.0", "72"),
    ("#### 72.", "72"),
    ("#### 0072", "72"),
    ("#### .", "."),
    ("#### 1.000.000", "1.000.000"),
    ("#### 1e3", "1000"),
    ("#### 5/2", "5"),
    ("#### 72 dollars", "72"),
    ("#### seventy-two", "72"),
    ("#### 72\n#### 73", "72"),
    ("#### 73, no wait\n#### 72", "72"),
    ("#### 72", 72),
    ("#### 72", "She sold 72 clips. #### 72"),
    ("#### 72", " 72"),
    ("#### 0", "0"),
    ("#### -0", "0"),
    ("", "72"),
    ("#### ", "72"),
    ("####", "72"),
    (PAD + "#### 72", "72"),
    ("#### 72" + "x" * 293, "72"),
    ("#### 72" + "x" * 294, "72"),
    ("#### 72" + "x" * 295, "72"),
    ("#### 72 " + PAD, "72"),
    ("x" * 1000 + "\n#### 18", "18"),
    ("Step 1: 16 - 3 - 4 = 9\nStep 2: 9 * 2 = 18\n#### 18", "18"),
    ("Janet makes 9 * $2 = $18 every day.\n#### 18", "18"),
    ("Janet makes 9 * $2 = $18 every day.", "18"),
    ("#### 18 eggs", "18"),
    ("#### 18.00", "18"),
    ("#### 1,8", "18"),
    ("#### ,18", "18"),
    ("#### .5", ".5"),
    ("#### .5", "0.5"),
    ("#### 12 #### 13", "13"),
    ("#### 12 ####13", "12"),
    ("#### \n72", "72"),
    ("####\t72", "72"),
    ("# ### 72", "72"),
    ("#### 3", "3"),
    ("#### 3 hours", "3"),
    ("#### 70000", "70,000"),
    ("#### 70,000", "70000"),
    ("#### 1,234,567", "1234567"),
    ("#### -1,234", "-1234"),
]

MATH = [  # (response, ground truth): the last \\boxed{}, Hendrycks' string normalisation
    ("So the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\tfrac12}", "\\frac{1}{2}"),
    ("\\boxed{\\frac12}", "\\frac{1}{2}"),
    ("\\boxed{\\frac1{72}}", "\\frac{1}{72}"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{.5}", "\\frac{1}{2}"),
    ("\\boxed{1/2}", "\\frac12"),
    ("\\boxed{2/4}", "\\frac{1}{2}"),
    ("\\boxed{03/4}", "\\frac{3}{4}"),
    ("\\boxed{-1/2}", "\\frac{-1}{2}"),
    ("\\boxed{-1/2}", "-\\frac{1}{2}"),
    ("\\boxed{0.25}", "\\frac{1}{4}"),
    ("\\boxed{x=5}", "5"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{xy=5}", "5"),
    ("\\boxed{abc=5}", "5"),
    ("\\boxed{k=3}", "k = 3"),
    ("\\boxed{90^\\circ}", "90"),
    ("\\boxed{90^{\\circ}}", "90^\\circ"),
    ("\\boxed{5\\%}", "5"),
    ("\\boxed{5\\%}", "5\\%"),
    ("\\boxed{\\$5}", "5"),
    ("\\boxed{10 \\text{ cm}}", "10"),
    ("\\boxed{3\\text{ cm}\\text{ m}}", "3"),
    ("\\boxed{3\\text{ cm}\\text{ m}}", "3\\text{ cm}\\text{ m}"),
    ("\\boxed{\\sqrt2}", "\\sqrt{2}"),
    ("\\boxed{2\\sqrt3}", "2\\sqrt{3}"),
    ("\\boxed{\\sqrt{2}}", "\\sqrt2"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}"),
    ("\\boxed{\\left(1,2\\right)}", "(1,2)"),
    ("\\boxed{(1, 2)}", "(1,2)"),
    ("\\boxed{\\left[ -1, 3 \\right)}", "[-1,3)"),
    ("\\boxed{\\!5}", "5"),
    ("\\boxed{\\frac{1}{2}\n}", "\\frac{1}{2}"),
    ("\\boxed{\\text{(A)}}", "\\text{(A)}"),
    ("\\boxed{\\text{(A)}}", "(A)"),
    ("\\boxed{5}", "5.0"),
    ("\\boxed{5}", 5),
    ("\\boxed{5}", "\\boxed{5}"),
    ("\\boxed 5$ and more", "5"),
    ("\\boxed 5", "5"),
    ("\\boxed 3$ then \\boxed{5}", "5"),
    ("\\fbox{5}", "5"),
    ("\\boxed{5", "5"),
    ("the answer is 5", "5"),
    ("", "5"),
    ("\\boxed{3} or rather \\boxed{5}", "5"),
    ("\\boxed{3} or rather \\boxed{5}", "3"),
    ("\\boxed{\\boxed{5}}", "5"),
    ("$\\boxed{\\frac{3}{4}}$", "\\frac34"),
    ("\\boxed{\\frac{3}{4}}", "0.75"),
    ("\\boxed{\\sqrt}", "\\sqrt"),
    ("\\boxed{\\frac}", "\\frac"),
    ("\\boxed{\\frac1}", "\\frac1"),
    ("\\boxed{}", ""),
    ("\\boxed{ }", ""),
    ("\\boxed{x^2+1}", "x^2 + 1"),
    ("\\boxed{1+x^2}", "x^2+1"),
    (PAD + "\\boxed{42}", "42"),
    ("\\boxed{42}" + PAD, "42"),
    ("\\boxed{\\$1,000}", "1000"),
    ("\\boxed{1,000}", "1,000"),
    ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}"),
    ("\\boxed{\\infty}", "\\infty"),
    ("\\boxed{\\text{Devon}}", "\\text{Devon}"),
]

DAPO = [  # (response, ground truth): Minerva's "Answer:", else the last \\boxed{} unnormalised
    ("Answer: 5", "5"),
    ("answer: 5", "5"),
    ("ANSWER : 5", "5"),
    ("Answer:5", "5"),
    ("Answer: 4", "5"),
    ("Answer: x = 5", "5"),
    ("Answer: 5", "x=5"),
    ("Answer: 5 dollars", "5"),
    ("Answer: \\$5", "5"),
    ("Answer: 3 units", "3"),
    ("Answer: 12 inches", "12"),
    ("Answer: 90^\\circ", "90"),
    ("Answer: 90 degrees", "90"),
    ("Answer: 1,000", "1000"),
    ("Answer: 1,000,000", "1000000"),
    ("Answer: 1,2", "12"),
    ("Answer: \\frac12", "\\frac{1}{2}"),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}"),
    ("Answer: \\sqrt3", "\\sqrt{3}"),
    ("Answer: 0.5", "\\frac{1}{2}"),
    ("Answer: \\boxed{5}", "5"),
    ("Answer: $5$", "5"),
    ("Answer: $x$ is $5$", "5"),
    ("Answer: 5.", "5"),
    ("Answer: \\text{(A)}", "A"),
    ("Answer: \\text{(A)}", "(A)"),
    ("Answer: \\textbf{B}", "B"),
    ("Answer: \\overline{12}", "12"),
    ("Answer: \\text{yes}", "yes"),
    ("Answer: a cat", "cat"),
    ("Answer: 1\\text{ and }2", "1,2"),
    ("Answer: 033", "33"),
    ("Answer: 33", "033"),
    ("Answer: 5\nAnswer: 6", "6"),
    ("Answer: 5\nAnswer: 6", "5"),
    ("Answer: \n5", "5"),
    ("Answer:", "5"),
    ("Answer:\n\\boxed{5}", "5"),
    ("Answer: [INVALID]\n\\boxed{5}", "5"),
    ("The final answer is $\\boxed{33}$.", "33"),
    ("Final Answer: The final answer is 33. I hope it is correct.", "33"),
    ("\\boxed{5}", "5"),
    ("\\boxed{ 5}", "5"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{x=5}", "5"),
    ("\\boxed{5} and then some more words that push the box out of the last hundred chars...",
     "5"),
    ("\\boxed{5}" + "." * 90, "5"),
    ("\\boxed{5}" + "." * 91, "5"),
    ("\\boxed{5", "5"),
    ("", "5"),
    ("no answer at all", "[INVALID]"),
    ("5", "5"),
    (PAD + "Answer: 7", "7"),
    ("Answer: 7 " + PAD, "7"),
    ("Answer: 7\n" + "x" * 295, "7"),
    ("Answer: 7\n" + "x" * 288, "7"),
    ("Answer: \\boxed{\\frac{1}{2}}", "0.5"),
    ("Answer: 2\\sqrt{2}", "2\\sqrt{2}"),
    ("Answer: (1,2)", "(1, 2)"),
    ("Answer: \\{1,2\\}", "\\{1, 2\\}"),
    ("Answer: 10^{\\circ}", "10"),
    ("Answer: 17 students", "17"),
    ("Answer: 5", 5),
]

QA = [  # (response, ground truth): exact match inside the last <answer></answer>
    ("<answer>Paris</answer>", {"target": ["Paris"]}),
    ("<answer> paris </answer>", {"target": ["Paris"]}),
    ("<answer>PARIS</answer>", {"target": ["paris"]}),
    ("<answer>The Paris</answer>", {"target": ["Paris"]}),
    ("<answer>Paris.</answer>", {"target": ["Paris"]}),
    ("<answer>Paris, France</answer>", {"target": ["Paris"]}),
    ("<answer>Paris</answer>", {"target": ["Paris, France"]}),
    ("<answer>Paris France</answer>", {"target": ["Paris, France"]}),
    ("<answer>London</answer>", {"target": ["Paris"]}),
    ("<answer>London</answer>", {"target": ["Paris", "London"]}),
    ("<answer>Londres</answer>", {"target": ["London", "Londres"]}),
    ("<answer>Paris</answer>", {"target": "Paris"}),
    ("<answer>Paris</answer>", {"target": ("Lyon", "Paris")}),
    ("<answer>Paris</answer>", {"target": []}),
    ("Paris", {"target": ["Paris"]}),
    ("The answer is Paris.", {"target": ["Paris"]}),
    ("<answer>Paris", {"target": ["Paris"]}),
    ("Paris</answer>", {"target": ["Paris"]}),
    ("<ANSWER>Paris</ANSWER>", {"target": ["Paris"]}),
    ("<answer>London</answer> no, <answer>Paris</answer>", {"target": ["Paris"]}),
    ("<answer>Paris</answer> no, <answer>London</answer>", {"target": ["Paris"]}),
    ("<answer>\nParis\n</answer>", {"target": ["Paris"]}),
    ("<answer>Barack  Obama</answer>", {"target": ["Barack Obama"]}),
    ("<answer>Obama</answer>", {"target": ["Barack Obama"]}),
    ("<answer>Barack Obama</answer>", {"target": ["Obama"]}),
    ("<answer>U.S.A.</answer>", {"target": ["USA"]}),
    ("<answer>U.S.A</answer>", {"target": ["U S A"]}),
    ("<answer>An apple</answer>", {"target": ["apple"]}),
    ("<answer>a</answer>", {"target": ["the"]}),
    ("<answer></answer>", {"target": [""]}),
    ("<answer></answer>", {"target": ["Paris"]}),
    ("<answer>theater</answer>", {"target": ["ater"]}),
    ("<answer>the theater</answer>", {"target": ["theater"]}),
    ("<answer>Paris’</answer>", {"target": ["Paris"]}),
    ("<answer>Paris!</answer>", {"target": ["paris?"]}),
    ("<answer>1,000</answer>", {"target": ["1000"]}),
    ("<answer>1 000</answer>", {"target": ["1000"]}),
    ("<answer>42</answer>", {"target": ["42"]}),
    ("<answer>forty-two</answer>", {"target": ["fortytwo"]}),
    ("<answer>São Paulo</answer>", {"target": ["sao paulo"]}),
    ("<answer>São Paulo</answer>", {"target": ["SÃO PAULO"]}),
    ("<answer>Paris</answer>" * 10, {"target": ["Paris"]}),
    ("<answer>Paris</answer>" * 11, {"target": ["Paris"]}),
    ("<answer>" * 11 + "Paris</answer>", {"target": ["Paris"]}),
    ("<answer>Paris</answer>" + "</answer>" * 10, {"target": ["Paris"]}),
    ("<answer>Paris</answer>" + "</answer>" * 9, {"target": ["Paris"]}),
    ("<answer>London</answer>" * 11, {"target": ["Paris"]}),
    ("<think>It is Paris</think><answer>Paris</answer>", {"target": ["Paris"]}),
    ("<search>capital of France</search><information>Paris is the capital"
     "</information><answer>Paris</answer>", {"target": ["Paris"]}),
    ("<answer>Paris</answer><answer></answer>", {"target": ["Paris"]}),
    ("<answer><answer>Paris</answer></answer>", {"target": ["Paris"]}),
    ("<answer>Paris</ answer>", {"target": ["Paris"]}),
    ("", {"target": ["Paris"]}),
    ("", {"target": [""]}),
    ("<answer>the the the</answer>", {"target": [""]}),
    ("<answer>\t Mount\nEverest \t</answer>", {"target": ["Mount Everest"]}),
    ("<answer>Mt. Everest</answer>", {"target": ["Mount Everest", "Mt Everest"]}),
    ("<answer>George Washington</answer>", {"target": ["george washington", "washington"]}),
    ("<answer>Washington</answer>", {"target": ["George Washington"]}),
    ("<answer>1776</answer>", {"target": ["1776", "July 4, 1776"]}),
    ("<answer>July 4 1776</answer>", {"target": ["July 4, 1776"]}),
    (PAD + "<answer>Paris</answer>", {"target": ["Paris"]}),
    ("<answer>Paris</answer>" + PAD, {"target": ["Paris"]}),
]


# -- the two families verl scores with packages megarl lacks: verl's results recorded -------------
# (response, ground truth, what verl 0.9.1 returned with pylatexenc 2.11 and mathruler 0.1.0)

NUMINA = [
    # grade_answer, mathd step (Hendrycks normalisation)
    ("The answer is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("The answer is \\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
    ("So we get \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{x=5}", "5", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{\\text{(B)}}", "B", 1.0),
    ("\\boxed{\\textbf{(B)}}", "\\textbf{(B)}", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{3/4}", "\\frac{3}{4}", 1.0),
    # grade_answer, its own normalisation
    ("The answer is 5 degrees", "5", 1.0),
    ("The answer is 3 cm^2", "3", 1.0),
    ("The answer is 12 liters", "12", 1.0),
    ("The answer is 2 million", "2000000", 0.0),
    ("The answer is 1,000,000", "1000000", 1.0),
    ("The answer is 50\\%", "50", 1.0),
    ("The answer is \\$5", "5", 1.0),
    ("\\boxed{5.0}", "5", 1.0),
    ("\\boxed{7 3/4}", "7\\frac{3}{4}", 1.0),
    ("\\boxed{- 3}", "-3", 1.0),
    ("\\boxed{\\text{Yes}}", "yes", 1.0),
    ("\\boxed{2 or 3}", "2, 3", 0.0),
    ("\\boxed{2 and 3}", "(2, 3)", 0.0),
    # LaTeX through pylatexenc, then sympy
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 1.0),
    ("\\boxed{\\frac{\\pi}{3}}", "\\pi/3", 1.0),
    ("\\boxed{(-\\infty, 1) \\cup (2, \\infty)}", "(-\\infty,1)\\cup(2,\\infty)", 1.0),
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
    ("\\boxed{(x+1)^{2}}", "x^2+2x+1", 0.0),
    ("\\boxed{a \\cdot b}", "ab", 1.0),
    ("\\boxed{2 \\times 3}", "6", 0.0),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{2/4}", "1/2", 0.0),
    ("\\boxed{\\frac{6}{3}}", "2", 0.0),
    ("\\boxed{1.5}", "\\frac{3}{2}", 1.0),
    ("\\boxed{\\frac{3}{2}}", "1.5", 1.0),
    ("\\boxed{\\sqrt[3]{2}}", "2^{1/3}", 0.0),
    ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{[1, 2)}", "(1, 2)", 0.0),
    ("\\boxed{(1, 2, 3)}", "(1, 2)", 0.0),
    ("\\boxed{x + y + z}", "z + y + x", 0.0),
    ("\\boxed{\\mathrm{(C)}}", "C", 1.0),
    ("\\boxed{\\log_2 8}", "3", 0.0),
    ("\\boxed{e^{x}}", "e^x", 1.0),
    # math_equal: numbers, percentages, pi, bases, intervals, tuples, matrices
    ("\\boxed{0.333}", "1/3", 0.0),
    ("\\boxed{0.3333}", "0.33333", 1.0),
    ("\\boxed{50}", "0.5", 1.0),
    ("\\boxed{0.5}", "50", 1.0),
    ("\\boxed{6.2832}", "2\\pi", 1.0),
    ("\\boxed{6.28}", "2\\pi", 1.0),
    ("\\boxed{2\\pi}", "6.283185", 1.0),
    ("\\boxed{\\pi^2}", "9.8696", 0.0),
    ("\\boxed{1011_2}", "1011", 1.0),
    ("\\boxed{x_1}", "3", 0.0),
    ("\\boxed{\\$12}", "12", 1.0),
    ("\\boxed{25\\%}", "25", 1.0),
    ("\\boxed{Interval(1, 2)}", "[1, 2]", 1.0),
    ("\\boxed{Interval.open(0, 1)}", "(0,1)", 1.0),
    ("\\boxed{(0.5, 0.25)}", "(\\frac{1}{2}, \\frac{1}{4})", 1.0),
    ("\\boxed{0.5, 0.25}", "\\frac{1}{2}, 25\\%", 0.0),
    ("\\boxed{Point(1, 2)}", "(1, 2)", 0.0),
    ("\\boxed{[1, 2]}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 0.0),
    ("\\boxed{[[1, 2], [3, 4]]}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", 0.0),
    ("\\boxed{[1, x]}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 0.0),
    ("\\boxed{Matrix([[1], [2]])}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 1.0),
    ("\\boxed{1e-9}", "0", 1.0),
    ("\\boxed{\\infty}", "\\infty", 1.0),
    # match_answer: the markers
    ("Step 1: think. Step 2: so the answer is 42.", "42", 1.0),
    ("We conclude that 42 is the answer", "42", 0.0),
    ("The final answer: 17. I hope it is correct.", "17", 1.0),
    ("Thus x = 3 and y = 4", "4", 1.0),
    ("so we get\n12", "12", 1.0),
    ("The answers are 3 and 4", "3, 4", 0.0),
    ("the area must be 36", "36", 1.0),
    ("There is no numeric answer here", "5", 0.0),
    ("", "0", 0.0),
    ("\\boxed{}", "", 1.0),
    ("\\fbox{8}", "8", 1.0),
    ("The answer is \\boxed{8", "8", 1.0),
    ("İİİ answer: 5", "5", 0.0),
    # wrong answers
    ("The answer is \\boxed{4}", "5", 0.0),
    ("The answer is \\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("The answer is \\boxed{x^2}", "x^3", 0.0),
    ("The answer is \\boxed{(1,2)}", "(2,1)", 0.0),
    ("The answer is \\boxed{\\sqrt{2}}", "2", 0.0),
    ("The answer is \\boxed{5}", "5.5", 0.0),
]

GEO3K = [
    # right answer, right format: 1.0
    ("<think>The two angles are supplementary.</think> The answer is \\boxed{60}", "60", 1.0),
    ("<think>x</think>\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 1.0),
    ("<think>x</think>\\boxed{2 \\sqrt 3}", "2\\sqrt{3}", 1.0),
    ("<think>x</think>\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 1.0),
    ("<think>x</think>\\boxed{\\frac{5}{2}}", "2.5", 1.0),
    ("<think>x</think>\\boxed{2.5}", "\\frac{5}{2}", 1.0),
    ("<think>x</think>\\boxed{\\dfrac{5}{2}}", "\\frac{5}{2}", 1.0),
    ("<think>x</think>\\boxed{60^\\circ}", "60", 1.0),
    ("<think>x</think>\\boxed{60^{\\circ}}", "60", 1.0),
    ("<think>x</think>\\boxed{60 degrees}", "60", 1.0),
    ("<think>x</think>\\boxed{12 cm}", "12", 1.0),
    ("<think>x</think>\\boxed{x = 7}", "7", 1.0),
    ("<think>x</think>\\boxed{7.0}", "7", 1.0),
    ("<think>x</think>\\boxed{16\\pi}", "16 \\pi", 1.0),
    ("<think>x</think>\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("<think>x</think>\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("<think>x</think>\\boxed{50\\%}", "50", 1.0),
    ("<think>x</think>\\boxed{50%}", "50", 1.0),
    ("<think>x</think>\\boxed{\\text{B}}", "B", 1.0),
    ("<think>x</think>\\boxed{b}", "B", 1.0),
    ("<think>x</think>\\boxed{4\\sqrt{2}}", "\\sqrt{32}", 1.0),
    ("<think>x</think>\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("<think>multi\nline</think>\nso\n\\boxed{9}\ndone", "9", 1.0),
    # right answer, no format: 0.9
    ("The answer is \\boxed{60}", "60", 0.9),
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 0.9),
    ("<think>x</think> \\boxed{60} <think>", "60", 1.0),
    ("<THINK>x</THINK> \\boxed{60}", "60", 0.9),
    ("<think>x \\boxed{60}", "60", 0.9),
    ("\\boxed{60}<think>x</think>", "60", 0.9),
    ("<think>x</think>\\fbox{60}\\boxed{60}", "60", 1.0),
    # wrong answer, right format: 0.1
    ("<think>x</think>\\boxed{61}", "60", 0.1),
    ("<think>x</think>\\boxed{2\\sqrt{2}}", "2\\sqrt{3}", 0.1),
    ("<think>x</think>\\boxed{\\frac{4}{2}}", "\\frac{2}{1}", 0.1),
    ("<think>x</think>\\boxed{2/4}", "1/2", 0.1),
    ("<think>x</think>\\boxed{1.33}", "\\frac{4}{3}", 0.1),
    ("<think>x</think>\\boxed{}", "0", 0.1),
    ("<think>x</think>\\boxed{60}}", "61", 0.1),
    ("<think>x</think>\\boxed{x^2+y^2+z^2}", "z^2+y^2+x^2", 0.1),
    ("<think>x</think>\\boxed{(1,2)}", "[1,2]", 0.1),
    ("<think>x</think>\\boxed{5 \\text{ and } 6}", "5,6", 1.0),
    # wrong, no format, no box: 0.0
    ("The answer is 60", "60", 0.0),
    ("", "60", 0.0),
    ("\\boxed{60", "60", 0.0),
    ("<think>x</think> answer: 60", "60", 0.0),
    ("<think></think>\\boxed{7}", "8", 0.1),
    ("\\boxed{None}", "None", 0.9),
    ("no box at all", "None", 0.9),
    ("\\boxed{3} and later \\boxed{4}", "3", 0.0),
    ("\\boxed{3} and later \\boxed{4}", "4", 0.9),
    ("\\boxed{\\boxed{5}}", "5", 0.9),
    ("\\boxed{1,000}", "1000", 0.9),
    ("\\boxed{1 million}", "1000000", 0.0),
    ("\\boxed{5 liters}", "5", 0.0),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", 0.9),
    ("\\boxed{\\sqrt2}", "\\sqrt{2}", 0.9),
    ("\\boxed{3\\frac{1}{2}}", "3.5", 0.9),
    ("\\boxed{3 1/2}", "\\frac{7}{2}", 0.9),
    ("\\boxed{\\pi}", "3.14159", 0.0),
    ("\\boxed{\\infty}", "\\infty", 0.9),
    ("\\boxed{-\\infty}", "- \\infty", 0.9),
    ("\\boxed{\\angle ABC}", "\\angle ABC", 0.9),
    ("\\boxed{\\overline{AB}}", "AB", 0.9),
    ("\\boxed{\\mathrm{m}\\angle 1 = 30}", "30", 0.0),
    ("\\boxed{y=2x+1}", "2x+1", 0.9),
]

LATEX = [  # (LaTeX, pylatexenc 2.11's text, or the exception it raises)
    ('\\frac{1}{2}', '1/2'),
    (' \\frac{1}{2}', ' 1/2'),
    ('\\frac12', '1/2'),
    ('\\frac 1 2', '1/2'),
    ('\\frac{a+b}{c}', 'a+b/c'),
    ('\\frac{\\sqrt{3}}{2}', '√(3)/2'),
    ('\\frac\\pi2', 'π/2'),
    ('\\frac{1}', '%s/%s1'),
    ('\\frac', '%s/%s'),
    ('\\frac{}{}', '/'),
    ('\\dfrac12', '12'),
    ('2\\sqrt{3}', '2√(3)'),
    ('\\sqrt2', '√(2)'),
    ('\\sqrt[3]{2}', '√(2)'),
    ('\\sqrt [3] {x}', '√(x)'),
    ('\\sqrt', KeyError),
    ('\\sqrt{}', '√()'),
    ('\\sqrt{x^2+1}', '√(x^2+1)'),
    ('\\pi', 'π'),
    ('3\\pi r^2', '3πr^2'),
    ('\\infty', '∞'),
    ('(-\\infty, 3]', '(-∞, 3]'),
    ('\\left(1,2\\right)', '(1,2)'),
    ('\\{1,2\\}', '{1,2}'),
    ('\\text{cm}', 'cm'),
    ('\\text{ and }', ' and '),
    ('\\mathrm{(C)}', '(C)'),
    ('\\textbf{(B)}', '(B)'),
    ('\\texttt{x}', ''),
    ('\\mbox{x}', ''),
    ('\\emph{a}', 'a'),
    ('\\mathbf{v}', '𝐯'),
    ('\\mathbb{R}', 'ℝ'),
    ('\\mathcal{L}', 'ℒ'),
    ('\\boxed{3}', '3'),
    ('\\foo{3}', '3'),
    ('\\operatorname{lcm}(4,6)', 'lcm(4,6)'),
    ('\\sin x', 'sinx'),
    ('\\sin  x + \\cos y', 'sinx + cosy'),
    ('\\log_2 8', 'log_2 8'),
    ('\\ln 2', 'ln2'),
    ('a\\,b', 'a b'),
    ('a\\;b', 'a b'),
    ('a\\!b', 'ab'),
    ('a\\quad b', 'a  b'),
    ('a\\ b', 'a b'),
    ('a~b', 'a\xa0b'),
    ('1\\%', '1%'),
    ('\\$5', '$5'),
    ('\\&', '&'),
    ('\\#', '#'),
    ('\\_', '_'),
    ('\\cdot', '·'),
    ('\\times', '×'),
    ('\\div', '÷'),
    ('\\pm 2', '±2'),
    ('\\le', '≤'),
    ('\\geq', '≥'),
    ('\\neq', '≠'),
    ('\\approx', '≈'),
    ('\\cup', '∪'),
    ('\\cap', '∩'),
    ('\\in', '∈'),
    ('\\subseteq', '⊆'),
    ('\\circ', '∘'),
    ('90^\\circ', '90^∘'),
    ('\\angle ABC', '∠ABC'),
    ('\\triangle ABC', 'ABC'),
    ('\\overline{AB}', 'AB'),
    ('\\hat{x}', 'x̂'),
    ('\\vec{v}', 'v⃗'),
    ('\\bar x', 'x̅'),
    ("\\'e", 'é'),
    ('\\~{n}', 'ñ'),
    ('\\not=', '≠'),
    ('\\alpha+\\beta', 'α+β'),
    ('\\Omega', 'Ω'),
    ('\\varepsilon', 'ε'),
    ('\\phi', 'ϕ'),
    ('\\dots', '…'),
    ('\\ldots', '…'),
    ('\\cdots', '⋯'),
    ('\\lfloor x \\rfloor', '⌊x ⌋'),
    ('\\Rightarrow', '⇒'),
    ('\\to', '→'),
    ('\\mapsto', '↦'),
    ('x_{1}', 'x_1'),
    ('x^{2}', 'x^2'),
    ("f\\'(x)", 'f(́x)'),
    ("f''(x)", 'f”(x)'),
    ('1--2', '1–2'),
    ('a---b', 'a—b'),
    ("``q\\'\\'", '“q́́'),
    ('{a}{b}', 'ab'),
    ('{a} {b}', 'a b'),
    ('a}b', 'ab'),
    ('{a', 'a'),
    ('a \\end{x} b', 'a  b'),
    ('\\begin{pmatrix}1\\\\2\\end{pmatrix}', '[ 1; 2 ]'),
    ('\\begin{pmatrix}1 & 2\\\\3 & 4\\end{pmatrix}', '[ 1 2; 3 4 ]'),
    ('\\begin{bmatrix} a & bb \\end{bmatrix}', '[  a bb ]'),
    ('\\begin{pmatrix}\\end{pmatrix}', ValueError),
    ('\\begin{cases} 1 & x>0 \\\\ 0 & x\\le 0\\end{cases}', ' 1     x>0 \n 0     x≤0'),
    ('\\begin{array}{cc} 1 & 2 \\end{array}', '[ 1 2 ]'),
    ('\\begin{equation} x=1 \\end{equation}', '\n    x=1\n'),
    ('\\(x\\)', 'x'),
    ('\\[ x^2 \\]', '\n    x^2\n'),
    ('\\(\\pi r\\)', 'π r'),
    ('\\[\\alpha x\\]', '\n    α x\n'),
    ('a % comment\nb', 'a \nb'),
    ('x \\\\ y', 'x \n y'),
    ('x \\\\[2mm] y', 'x \n y'),
    ('\\hspace{1cm}x', 'x'),
    ('\\label{eq}x', 'x'),
    ('\\ref{eq}', '<ref>'),
    ('\\textcolor{red}{5}', '5'),
    ('\\ensuremath{\\pi}', 'π'),
    ('\\ket{0}', '|0⟩'),
    ('\\xrightarrow{f}', ''),
    ('\\\\', '\n'),
    ('\\', ''),
    ('a\n\nb', 'a\n\nb'),
    ('\\sin\n\nx', 'sin\n\nx'),
    ('\\prime', "'"),
    ('\\textdegree', '°'),
    ('\\-', '\xad'),
    ('\\lbrace 1 \\rbrace', '{1 }'),
    ('\\begin', '\\begin'),
    ('\\end', '\\end'),
    ('\\begin{x', '\\beginx'),
    ('\\frac{1}{2', '1/2'),
    ('\\sqrt[3', KeyError),
    ('x \\in \\mathbb{Z}', 'x ∈ℤ'),
    ('\\bigcup_{i=1}^n A_i', '⋃_i=1^n A_i'),
    ('\\sum_{k=1}^{n} k', '∑_k=1^n k'),
    ('\\int_0^1 x\\,dx', '∫_0^1 x dx'),
    ('\\lim_{x\\to 0}', 'lim_x→0'),
    ('\\|x\\|', 'x'),
    ('|x|', '|x|'),
]

CASES = {"gsm8k": GSM8K, "math": MATH, "math_dapo": DAPO,
         "numina": [(s, g) for s, g, _ in NUMINA], "geo3k": [(s, g) for s, g, _ in GEO3K],
         "search_r1": QA}
RECORDED = {"numina": [r for _, _, r in NUMINA], "geo3k": [r for _, _, r in GEO3K]}

VERL_CODE = '''
import ast, contextlib, importlib, inspect, io, sys, types


def have(name):
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


installed = {name: have(name) for name in ("pylatexenc", "mathruler")}
stand_in_calls = []
if not installed["pylatexenc"]:
    # verl's prime_math imports pylatexenc at module level: megarl's converter stands in
    from megarl.reward.latex_text import latex_to_text

    class LatexNodes2Text:
        def latex_to_text(self, latex, **flags):
            stand_in_calls.append(latex)
            return latex_to_text(latex)

    package, module = types.ModuleType("pylatexenc"), types.ModuleType("pylatexenc.latex2text")
    module.LatexNodes2Text, package.latex2text = LatexNodes2Text, module
    sys.modules.update({"pylatexenc": package, "pylatexenc.latex2text": module})

from verl.utils import reward_score
from verl.utils.reward_score import default_compute_score


def score(data_source, solution, ground_truth):
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # verl prints now and then
            return ("ok", default_compute_score(data_source, solution, ground_truth))
    except Exception as err:
        return ("error", type(err).__name__)


results, stand_in = {}, {}
for family, calls in inputs["cases"].items():
    if family == "geo3k" and not installed["mathruler"]:
        continue
    results[family], stand_in[family] = [], []
    for call in calls:
        stand_in_calls.clear()
        results[family].append(score(*call))
        stand_in[family].append(bool(stand_in_calls))
outputs.update(results=results, stand_in=stand_in, installed=installed,
               unknown=score("no/such_source", "x", "x"))
if installed["pylatexenc"]:
    from pylatexenc.latex2text import LatexNodes2Text
    texts = []
    for latex in inputs["latex"]:
        try:
            texts.append(LatexNodes2Text().latex_to_text(latex))
        except Exception as err:
            texts.append(type(err).__name__)
    outputs["latex"] = texts

# the data sources verl's dispatch names: `data_source == "x"`, `in [...]`, `.startswith("x")`
names, prefixes = set(), []
for node in ast.walk(ast.parse(inspect.getsource(reward_score.default_compute_score))):
    if isinstance(node, ast.Compare) and getattr(node.left, "id", None) == "data_source":
        for c in node.comparators:
            names |= {e.value for e in ast.walk(c) if isinstance(e, ast.Constant)}
    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "startswith":
        prefixes += [a.value for a in node.args]
outputs.update(names=sorted(names), prefixes=prefixes)
'''


def _calls(family: str) -> list[tuple]:
    names = SOURCES[family]
    return [(names[i % len(names)], sol, gt) for i, (sol, gt) in enumerate(CASES[family])]


@pytest.fixture(scope="module")
def verl() -> dict:
    return verl_run(VERL_CODE, {"cases": {f: _calls(f) for f in CASES},
                                "latex": [latex for latex, _ in LATEX]})


def _megarl(data_source, solution, ground_truth) -> tuple:
    try:
        return ("ok", default_compute_score(data_source, solution, ground_truth))
    except Exception as err:  # noqa: BLE001 - compared with verl's exception
        return ("error", type(err).__name__)


def _same(a: tuple, b: tuple) -> bool:
    """The same exception type, or the same value of the same type (dicts: key by key)."""
    if a[0] != b[0] or type(a[1]) is not type(b[1]):
        return False
    if isinstance(a[1], dict):
        return a[1].keys() == b[1].keys() and all(
            type(a[1][k]) is type(b[1][k]) and a[1][k] == b[1][k] for k in a[1])
    return a[1] == b[1]


@pytest.mark.parametrize("family", list(CASES))
def test_family_equals_verl(verl, family, record_property):
    calls = _calls(family)
    live, recorded = verl["results"].get(family), RECORDED.get(family)
    assert live is not None or recorded is not None
    wrong = []
    for i, call in enumerate(calls):
        got = _megarl(*call)
        if live is not None and not _same(got, live[i]):
            wrong.append(f"{call!r}: verl {live[i]!r}, megarl {got!r}")
        if recorded is not None and not _same(got, ("ok", recorded[i])):
            wrong.append(f"{call!r}: verl (recorded) {recorded[i]!r}, megarl {got!r}")
    stand_in = sum(verl["stand_in"].get(family, ()))
    summary = (f"{family}: {len(calls)} cases, {len(calls) - len(wrong)} equal to verl "
               f"({'live' if live is not None else 'recorded'}"
               f"{', recorded too' if live is not None and recorded is not None else ''}"
               f"{f', {stand_in} live through the pylatexenc stand-in' if stand_in else ''})")
    print(summary)
    record_property("cases", summary)
    assert not wrong, "\n".join(wrong)
    assert len(calls) >= MIN_CASES


def _text(latex: str):
    try:
        return latex_to_text(latex)
    except Exception as err:  # noqa: BLE001 - compared with pylatexenc's exception
        return type(err)


def test_latex_to_text_equals_pylatexenc(verl):
    live = verl.get("latex")  # only where pylatexenc is installed
    for i, (latex, expected) in enumerate(LATEX):
        got = _text(latex)
        assert got == expected, (latex, expected, got)
        if live is not None:
            assert (got.__name__ if isinstance(got, type) else got) == live[i], (latex, live[i])


def test_dispatch_names_are_verls(verl):
    """The table holds every data source verl's dispatch names, its code sets aside (megarl's
    code_exec scores those), and verl's one prefix."""
    code_sets = {"codecontests", "apps", "codeforces", "taco"}
    assert set(verl["names"]) == set(VERL_SOURCES) | code_sets
    assert set(verl["names"]) - code_sets <= set(DATA_SOURCES)
    assert verl["prefixes"] == list(VERL_PREFIXES)
    assert all(builtin_for(name) is not None for name in code_sets)


def test_unknown_source_raises_what_verl_raises(verl):
    assert verl["unknown"] == ("error", "NotImplementedError")
    with pytest.raises(NotImplementedError, match="no built-in reward"):
        default_compute_score("no/such_source", "x", "x")
    with pytest.raises(ValueError):  # megarl's own callers catch ValueError
        default_compute_score("no/such_source", "x", "x")
    assert issubclass(UnknownDataSourceError, NotImplementedError)


def test_megarl_sources_keep_their_scorers():
    """Names verl does not know keep megarl's scorers: the lenient exact match for `gsm8k`
    and for other names containing math/gsm8k, the code sandbox for names containing code."""
    assert default_compute_score("megarl/quickstart", "7", "7") == 1.0
    assert default_compute_score("gsm8k", "answer: 72", "She sold 72. #### 72") == 1.0
    assert default_compute_score("my-math-set", "\\boxed{1,000}", "1000") == 1.0
    assert default_compute_score("openai/gsm8k", "answer: 72", "72") == 0.0  # verl: strict
    assert default_compute_score("aime_2024", "Answer: 5", "5") == {
        "score": 1.0, "acc": True, "pred": "5"}
    assert builtin_for("my_code_set").__module__ == "megarl.reward.code_exec"
