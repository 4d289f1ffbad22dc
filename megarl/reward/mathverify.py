"""Math answers checked by Hugging Face's Math-Verify (`pip install math-verify`), as verl's
``math_verify`` scorer uses it: an opt-in reward, ``reward.reward_fn:
megarl.reward.mathverify:compute_score``.

The ground truth is read as LaTeX inside ``\\boxed{}``; the response as a plain expression or
as LaTeX (its boxed answer, ``$...$`` spans ...). The score is 1.0 when any parse of the
response is equivalent (sympy, with Math-Verify's own tolerances and set/interval/equation
rules) to any parse of the ground truth, else 0.0, and 0.0 when either side yields nothing,
when the library raises, or when a parse or comparison runs out of time (Math-Verify's own
signal-based deadlines; reward pool workers call it on their main thread, where those work).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger(__name__)

_TARGETS: Optional[tuple] = None


def _targets() -> tuple:
    global _TARGETS
    if _TARGETS is None:
        try:
            from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
        except ImportError as err:
            raise ImportError("megarl.reward.mathverify needs Math-Verify: "
                              "pip install 'math-verify[antlr4_13_2]'") from err
        # (gold, prediction) extraction targets: the gold is LaTeX, a response either
        _TARGETS = ((LatexExtractionConfig(),), (ExprExtractionConfig(), LatexExtractionConfig()))
    return _TARGETS


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: Optional[dict] = None) -> float:
    """1.0 if the response's answer is equivalent to ``ground_truth`` by Math-Verify."""
    del data_source, extra_info
    gold_targets, pred_targets = _targets()
    from math_verify import parse, verify

    try:
        gold = parse("\\boxed{" + str(ground_truth) + "}", gold_targets)
        pred = parse(solution_str, pred_targets)
        if not gold or not pred:
            return 0.0
        return max(1.0 if any(verify(g, p) for g in gold) else 0.0 for p in pred)
    except Exception as err:  # noqa: BLE001 - the library's failures score 0, as verl's do
        logger.debug("math-verify failed on %r: %s", solution_str[:200], err)
        return 0.0
