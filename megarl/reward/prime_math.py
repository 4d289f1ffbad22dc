"""PRIME's math scoring as verl 0.9.1 does it for the ``numina_*`` sets
(``verl/utils/reward_score/prime_math/``): ``(correct, format_ok, extracted)``, of which
verl's dispatch keeps ``float(correct)``.

The answer (``match_answer``) is cut out of the response by markers, in order: after the last
``answer:``/``answer is``/``answers are``, before ``is the answer``-style phrases, the inside of
the last ``\\boxed{}``/``\\fbox{}``, the part before a last ``". "``, then after the last
``be``/``is``/``are``/``=``/``:``/``get``. It is correct when the PRM800K grader accepts it
(``prm800k.grade_answer``, variant ``PRIME``), else when ``math_equal`` does: equal as
strings (any case, any spaces), as numbers within 1e-4 relative (also x/100 and x*100, for
percentages), element by element for tuples, intervals and matrices; ``$5`` is 5,
``50\\%`` is 50, ``1011_2`` is 1011, ``\\pi`` is tried as math.pi and as 3.14.

verl's last resort, sympy equivalence (``symbolic_equal``), never succeeds in 0.9.1: it opens
``timeout_limit(...)`` as a context manager, which it is not, so every attempt raises and is
swallowed. It is left out here, which keeps the result the same.

Deliberate differences: where verl calls Python's ``eval`` on the model's text (an answer
containing ``\\pi``, a list compared with a ``pmatrix``) or sympy's ``parse_expr`` (a
``Matrix(...)``), megarl evaluates only literals (numbers, tuples, lists, sets) and
arithmetic on numbers, and no names or calls; an expression verl would evaluate by name
(``abs(-2)``) is treated as not evaluable, and an integer power past ~100,000 bits (which
would hang verl) is refused.
"""
from __future__ import annotations

import ast
import math
import operator
import re
from math import isclose

from megarl.reward.prm800k import PRIME, grade_answer

_LEADING_MARKERS = ("answer:", "answer is", "answers are")
_TRAILING_MARKERS = ("is answer", "is the answer", "are answers", "are the answers")
_LAST_MARKERS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n",
                 "get\n")
_PI_VALUES = (math.pi, 3.14)


def _last_boxed(text: str):
    """The stripped inside of the last ``\\boxed``/``\\fbox`` group, or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    left = None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
            if left is None:
                left = i
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[left + 1:i].strip() if left is not None else None
    return None


def match_answer(response: str) -> tuple[bool, str]:
    """(an answer was marked and holds a digit, the answer text). Indices come from
    ``response.lower()`` and cut ``response``, as verl does."""
    matched = False
    for marker in _LEADING_MARKERS:
        i = response.lower().rfind(marker)
        if i != -1:
            matched = True
            response = response[i + len(marker):].strip()
    for marker in _TRAILING_MARKERS:
        i = response.lower().rfind(marker)
        if i != -1:
            matched = True
            response = response[:i].strip()
    boxed = _last_boxed(response)
    if boxed:
        matched = True
        response = boxed
    if ". " in response:
        response = response[:response.lower().rfind(". ")].strip()
    for marker in _LAST_MARKERS:
        i = response.lower().rfind(marker)
        if i != -1:
            matched = True
            response = response[i + len(marker):].strip()
    return matched and any(c.isdigit() for c in response), response


# -- literal arithmetic, in place of verl's eval ----------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow, ast.BitXor: operator.xor, ast.BitAnd: operator.and_,
           ast.BitOr: operator.or_, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
           ast.MatMult: operator.matmul}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Invert: operator.invert,
          ast.Not: operator.not_}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt,
            ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}
_NUMBER = (int, float, complex)  # bool is an int
_MAX_BITS = 100_000


def _number(value):
    if not isinstance(value, _NUMBER):
        raise ValueError("only arithmetic on numbers is evaluated")
    return value


def _eval_node(node):
    if isinstance(node, ast.Constant):
        return _number(node.value)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_eval_node(e) for e in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_number(_eval_node(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _number(_eval_node(node.left)), _number(_eval_node(node.right))
        if isinstance(node.op, (ast.Pow, ast.LShift)) and isinstance(left, int) \
                and isinstance(right, int) and right > 0 and abs(left) > 1:
            bits = right if isinstance(node.op, ast.LShift) else right * abs(left).bit_length()
            if bits > _MAX_BITS:
                raise ValueError("integer too large to evaluate")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.BoolOp):
        result = None
        for value in node.values:
            result = _number(_eval_node(value))
            if isinstance(node.op, ast.And) and not result:
                return result
            if isinstance(node.op, ast.Or) and result:
                return result
        return result
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        left = _number(_eval_node(node.left))
        for op, comparator in zip(node.ops, node.comparators):
            right = _number(_eval_node(comparator))
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    raise ValueError(f"not evaluated: {type(node).__name__}")


def literal_eval(text: str):
    """Python's ``eval`` of ``text`` for literals and arithmetic on numbers (leading spaces
    and tabs dropped, as ``eval`` drops them); raises on anything else."""
    return _eval_node(ast.parse(text.lstrip(" \t"), mode="eval").body)


# -- math_equal --------------------------------------------------------------------------------

def _as_number(value):
    """(True, float) when ``value`` reads as a number (commas dropped), else (False, None)."""
    text = str(value)
    try:
        return True, float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return False, None


def _substitute_pi(text: str, pi: float):
    """``2\\pi`` -> ``2*3.14...``, ``\\pi`` -> ``1*3.14...``, then evaluated where it can be."""
    i = text.find("\\pi")
    while i != -1:
        factor = "*" if i > 0 and text[i - 1].isdigit() else "1*"
        text = text[:i] + f"{factor}{pi}" + text[i + 3:]
        i = text.find("\\pi", i + 1)
    try:
        return literal_eval(text)
    except Exception:  # noqa: BLE001 - verl keeps the substituted text
        return text


def _normalize(answer, pi: float):
    if isinstance(answer, str):
        if re.match(r"\$\d+(\.\d+)?", answer):
            return answer[1:]
        if re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer):
            return answer.replace("\\%", "").replace("%", "")
        if "_" in answer:  # a base: "1011_2" -> 1011 (ValueError when not a number)
            return int(float(answer.split("_")[0]))
        if "\\pi" in answer:
            return _substitute_pi(answer, pi)
    return answer


_INTERVALS = ((r"^Interval\((.*)\)$", "[{}]"), (r"^Interval\.Ropen\((.*)\)$", "[{})"),
              (r"^Interval\.Lopen\((.*)\)$", "({}]"), (r"^Interval\.open\((.*)\)$", "({})"))


def _format_intervals(prediction: str) -> str:
    for pattern, template in _INTERVALS:
        m = re.match(pattern, prediction)
        if m:
            return template.format(m.group(1))
    return prediction


# what megarl hands to sympy's parse_expr (an eval): no calls, strings, underscores or powers
_SAFE_MATRIX = re.compile(r"Matrix\(\[[\[\]0-9A-Za-z.,+\-*/ ]*\]\)")


def _all_equal(preds, refs, include_percentage, tolerance) -> bool:
    # a list, not a generator: verl compares every pair, so a later error still raises
    return all([math_equal(p, r, include_percentage, tolerance) for p, r in zip(preds, refs)])


def math_equal(prediction, reference, include_percentage: bool = True,
               tolerance: float = 1e-4, pi: float = math.pi) -> bool:
    """ToRA's ``math_equal`` as verl 0.9.1 runs it (its sympy step never succeeds there)."""
    prediction, reference = _normalize(prediction, pi), _normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    (pred_is_num, pred_num), (ref_is_num, ref_num) = _as_number(prediction), _as_number(reference)
    if pred_is_num and ref_is_num:
        candidates = [ref_num / 100, ref_num, ref_num * 100] if include_percentage else [ref_num]
        return any(isclose(c, pred_num, rel_tol=tolerance) for c in candidates)
    if not prediction and prediction not in [0, False]:
        return False
    reference, prediction = str(reference).strip(), str(prediction).strip()
    prediction = _format_intervals(prediction)
    pred_str, ref_str = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) \
            or (prediction.startswith("(") and prediction.endswith(")")
                and not reference.startswith("[")):
        pred_str, ref_str = pred_str.strip("[]()"), ref_str.strip("[]()")
    for brace in "{}()":
        ref_str, pred_str = ref_str.replace(brace, ""), pred_str.replace(brace, "")
    if pred_str == ref_str:
        return True
    # [a, b] vs [c, d]: element by element, same brackets
    if (prediction and reference and prediction[0] in "([" and prediction[-1] in ")]"
            and prediction[0] == reference[0] and prediction[-1] == reference[-1]):
        pred_parts, ref_parts = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and _all_equal(pred_parts, ref_parts,
                                                            include_percentage, tolerance):
            return True
    if "," in prediction and "," in reference:
        pred_parts = [p.strip() for p in prediction.split(",")]
        ref_parts = [r.strip() for r in reference.split(",")]
        if len(pred_parts) == len(ref_parts):
            return _all_equal(pred_parts, ref_parts, include_percentage, tolerance)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        pred_parts = prediction[prediction.find("(") + 1:-1].split(",")
        ref_parts = reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and _all_equal(pred_parts, ref_parts,
                                                            include_percentage, tolerance):
            return True
    if "\\begin{pmatrix}" in reference and prediction.startswith("Matrix"):
        if _matrix_equal(prediction, reference, include_percentage, tolerance):
            return True
    elif "\\begin{pmatrix}" in reference and prediction.startswith("[") \
            and prediction.endswith("]"):
        if _list_matrix_equal(prediction, reference, include_percentage, tolerance):
            return True
    return False


def _matrix_equal(prediction: str, reference: str, include_percentage, tolerance) -> bool:
    """A sympy ``Matrix([[1], [2]])`` against the items of a pmatrix (verl's rule: every
    other whitespace-separated word of the reference, between the first and the last)."""
    if not _SAFE_MATRIX.fullmatch(prediction) or "**" in prediction:
        return False  # verl would parse it with sympy; megarl parses only plain numbers
    try:
        from sympy.parsing.sympy_parser import parse_expr

        pred_matrix = parse_expr(prediction)
        ref_items = reference.split()[1:-1:2]
        return len(pred_matrix) == len(ref_items) and _all_equal(
            list(pred_matrix), ref_items, include_percentage, tolerance)
    except Exception:  # noqa: BLE001 - as verl
        return False


def _list_matrix_equal(prediction: str, reference: str, include_percentage, tolerance) -> bool:
    """A Python list literal against a pmatrix's rows (``&`` columns, ``\\`` rows); an
    unreadable list raises (verl's eval raises there, outside its try)."""
    pred_matrix = literal_eval(prediction)
    if not isinstance(pred_matrix, list):
        return False
    try:
        rows = (reference.removeprefix("\\\\begin{pmatrix}").removeprefix("\\begin{pmatrix}")
                .removesuffix("\\\\end{pmatrix}").removesuffix("\\end{pmatrix}").split("\\"))
        ref_items = [row.split("&") if "&" in row else row for row in rows]
        return len(pred_matrix) == len(ref_items) and _all_equal(
            pred_matrix, ref_items, include_percentage, tolerance)
    except Exception:  # noqa: BLE001 - as verl
        return False


def compute_score(model_output, ground_truth) -> tuple[bool, bool, str]:
    """(correct, response has "Step 2:" and a box, the extracted answer)."""
    model_output, ground_truth = str(model_output), str(ground_truth)
    _, extracted = match_answer(model_output)
    format_ok = "Step 2:" in model_output and "\\box" in model_output
    if grade_answer(extracted, ground_truth, PRIME):
        return True, True, extracted
    try:
        if "\\pi" in extracted or "\\pi" in ground_truth:
            correct = any([math_equal(extracted, ground_truth, pi=pi) for pi in _PI_VALUES])
        else:
            correct = math_equal(extracted, ground_truth)
    except Exception:  # noqa: BLE001 - as verl: an error is a wrong answer
        correct = False
    return correct, format_ok, extracted
