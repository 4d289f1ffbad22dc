"""Which reward function scores a response: the built-in dispatch by data source, or a
user function named by ``reward.reward_fn`` as an import path (``module:function``, or
``path/to/file.py:function``), plus a plain synchronous ``score_batch``.

A reward function has verl's signature
``fn(data_source, solution_str, ground_truth, extra_info=None) -> float`` and may also
return a dict with a ``"score"`` key (verl allows that). The built-in dispatch
(``default_compute_score``) returns, for every data source verl 0.9.1's own
``default_compute_score`` names except its code sets, what verl's returns, value and type:
a float, or ``math_dapo``'s dict. Left out here: the streaming process pool with per-call
timeouts lives in ``megarl.reward.pool``, the code sandbox in ``megarl.reward.sandbox``.
"""
from __future__ import annotations

import inspect
import logging
import math
from typing import Callable, Optional, Sequence

from megarl.utils.errors import ConfigError
from megarl.utils.imports import load_callable
from megarl.reward import (code_exec, geo3k, gsm8k, last_digit, math_dapo, math_exact,
                           math_hendrycks, prime_math, qa_em, quickstart, tool_lookup)

logger = logging.getLogger(__name__)

RewardFn = Callable[..., object]

# verl 0.9.1's default_compute_score (verl/utils/reward_score/__init__.py), source by source,
# each to megarl's copy of the scorer verl calls there, with verl's arguments (its defaults).
# Its code sets (codecontests, apps, codeforces, taco) go to a sandbox there and to
# megarl's code_exec here (docs/rewards.md says how they differ).
VERL_SOURCES: dict[str, Callable] = {
    "openai/gsm8k": gsm8k.compute_score,
    **dict.fromkeys(("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                     "HuggingFaceH4/MATH-500"), math_hendrycks.compute_score),
    **dict.fromkeys(("math_dapo", "math", "math_dapo_reasoning"), math_dapo.compute_score),
    **dict.fromkeys(("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime",
                     "numina_synthetic_amc", "numina_cn_k12", "numina_olympiads"),
                    prime_math.compute_score),
    "hiyouga/geometry3k": geo3k.compute_score,
    **dict.fromkeys(("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                     "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle"),
                    qa_em.compute_score),
}
# verl matches these by prefix after the exact names ("aime2024", "aime_2025", ...).
VERL_PREFIXES: dict[str, Callable] = {"aime": math_dapo.compute_score}


def _verl_result(res):
    """What verl's default_compute_score makes of a scorer's result: a dict as it is, a
    number or bool as a float, a tuple (prime_math's) as its first item, as a float."""
    if isinstance(res, dict):
        return res
    if isinstance(res, (int, float, bool)):
        return float(res)
    return float(res[0])


def _as_verl_dispatch(scorer: Callable) -> RewardFn:
    def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None):
        del data_source, extra_info  # verl passes neither to these scorers
        return _verl_result(scorer(solution_str, ground_truth))
    compute_score.__qualname__ = f"{scorer.__module__}.compute_score (verl dispatch)"
    return compute_score


# Exact data_source names with a built-in scorer: megarl's own, verl's, and the code sets.
DATA_SOURCES: dict[str, RewardFn] = {
    quickstart.DATA_SOURCE: quickstart.compute_score,
    last_digit.DATA_SOURCE: last_digit.compute_score,
    tool_lookup.DATA_SOURCE: tool_lookup.compute_score,
    "gsm8k": math_exact.compute_score,  # megarl's lenient name; verl's is openai/gsm8k
    **{name: _as_verl_dispatch(fn) for name, fn in VERL_SOURCES.items()},
    **{name: code_exec.compute_score for name in code_exec.DATA_SOURCES},
}
_PREFIXED = {prefix: _as_verl_dispatch(fn) for prefix, fn in VERL_PREFIXES.items()}


class UnknownDataSourceError(ValueError, NotImplementedError):
    """No built-in scorer for a data source. A NotImplementedError too, which verl raises."""


def builtin_for(data_source: str) -> Optional[RewardFn]:
    """The built-in scorer of ``data_source``: the table above, then verl's prefixes
    (``aime*``), then any other name containing math/gsm8k (megarl's lenient exact-match)
    or code (sandboxed test cases); None where there is none."""
    fn = DATA_SOURCES.get(data_source)
    if fn is None:
        fn = next((f for p, f in _PREFIXED.items() if data_source.startswith(p)), None)
    if fn is None and any(k in data_source.lower() for k in ("math", "gsm8k")):
        fn = math_exact.compute_score
    if fn is None and "code" in data_source.lower():
        fn = code_exec.compute_score
    return fn


def no_builtin_message(data_source: str) -> str:
    return (f"no built-in reward for data_source {data_source!r} (known: {sorted(DATA_SOURCES)}"
            f", a name starting with {', '.join(sorted(VERL_PREFIXES))}, or one containing "
            f"math, gsm8k or code); set reward.reward_fn to 'module:function'")


def default_compute_score(data_source: str, solution_str: str, ground_truth,
                          extra_info=None):
    """Dispatch on ``data_source`` (``builtin_for``): a float, or a dict with a ``"score"``
    where verl's scorer returns one (``math_dapo``, ``math``, ``aime*``)."""
    fn = builtin_for(data_source)
    if fn is None:
        raise UnknownDataSourceError(no_builtin_message(data_source))
    return fn(data_source, solution_str, ground_truth, extra_info)


def load_reward_fn(path: Optional[str | RewardFn]) -> RewardFn:
    """The reward function for ``reward.reward_fn``; None gives the data-source dispatch."""
    if path is None or (isinstance(path, str) and not path.strip()):
        return default_compute_score
    if callable(path):
        return path
    fn = load_callable(path, "reward.reward_fn")
    _check_signature(fn, path)
    logger.info("reward function: %s", path)
    return fn


def _check_signature(fn: RewardFn, path: str) -> None:
    """A run calls the function with verl's four arguments (extra_info always holds at least
    the finish reason), as verl does: one that cannot take them would fail every call."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return
    try:
        sig.bind("data_source", "solution_str", "ground_truth", {})
    except TypeError as err:
        raise ConfigError(f"reward.reward_fn: {path!r}: {fn.__name__}{sig} cannot be called "
                          f"as fn(data_source, solution_str, ground_truth, extra_info), "
                          f"verl's signature ({err}); add an extra_info=None parameter"
                          ) from None


def _as_score(value, fn: RewardFn, uid: str) -> float:
    if isinstance(value, dict):
        value = value.get("score")
    try:
        score = float(value)
    except (TypeError, ValueError):
        score = math.nan
    if not math.isfinite(score):
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(f"reward function {name} returned {value!r} for prompt {uid}; "
                         f"expected a finite number (or a dict with a 'score')")
    return score


def score_batch(fn: RewardFn, items: Sequence, solutions: Sequence[str]) -> list[float]:
    """Score ``solutions[i]`` against ``items[i]`` (a ``Prompt``), in order, in this process.

    An exception inside ``fn`` is re-raised naming the prompt: a silently zero reward would
    look like a policy that learns nothing.
    """
    if len(items) != len(solutions):
        raise ValueError(f"score_batch: {len(items)} prompts but {len(solutions)} solutions")
    scores = []
    for item, sol in zip(items, solutions):
        try:
            value = fn(item.data_source, sol, item.ground_truth, item.extra_info)
        except Exception as err:
            name = getattr(fn, "__qualname__", repr(fn))
            raise RuntimeError(f"reward function {name} failed on prompt {item.uid} "
                               f"(data_source {item.data_source!r}): {err}") from err
        scores.append(_as_score(value, fn, item.uid))
    return scores
