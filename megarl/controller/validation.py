"""Validation StateMachine: when validation is due, and the states one validation goes through.

    IDLE -> GENERATE -> SCORE -> DONE -> IDLE

One `ValidationMachine` serves a whole run; each pass validates one weight version (version
v = the weights after v train steps; v = start step is the initial or resumed model).
A pass is due
- before training, on the initial weights, if `trainer.val_before_train`;
- after SYNC(k) of every step k with (k + 1) % test_freq == 0, on the weights that SYNC(k)
  just published (version k + 1); also after the last step when test_freq > 0, as verl does;
- once, alone, with `trainer.val_only=True` (the pipeline then schedules no train step).

What this module leaves to `megarl.controller.machine.Pipeline`: *when* a due pass runs. The
pipeline runs GENERATE on the generate group, between two training GENERATEs (a ready
training GENERATE goes first, so validation fills the generate group's idle time), and SCORE on
the reward group; the only thing that ever waits for validation is the next SYNC, which may not
replace the weights being validated before their validation GENERATE has finished.
"""
from __future__ import annotations

import enum
import logging
import time
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

logger = logging.getLogger(__name__)

TRANSITION_LOG_LEVEL = logging.DEBUG


class ValidationState(enum.Enum):
    IDLE = "idle"
    GENERATE = "generate"
    SCORE = "score"
    DONE = "done"

    def __str__(self) -> str:
        return self.name


V = ValidationState

TRANSITIONS: Mapping[ValidationState, frozenset[ValidationState]] = MappingProxyType({
    V.IDLE: frozenset({V.GENERATE}),    # a due pass takes the generate group
    V.GENERATE: frozenset({V.SCORE}),   # responses to every validation prompt are in
    V.SCORE: frozenset({V.DONE}),       # every response is scored; metrics can be reported
    V.DONE: frozenset({V.IDLE}),        # ready for the next pass
})


class IllegalValidationTransition(Exception):
    """A validation move the table forbids; names the version, from and to."""

    def __init__(self, version: int | None, frm: ValidationState, to: ValidationState,
                 detail: str = ""):
        allowed = ", ".join(sorted(s.name for s in TRANSITIONS[frm]))
        msg = (f"validation of version {version}: illegal transition {frm} -> {to} "
               f"(from {frm} allowed: {allowed})")
        super().__init__(msg + (f"; {detail}" if detail else ""))
        self.version, self.frm, self.to = version, frm, to


def validates_after(step: int, *, total_steps: int, test_freq: int) -> bool:
    """Whether SYNC(step) is followed by validating its weights (verl's test_freq rule)."""
    return test_freq > 0 and ((step + 1) % test_freq == 0 or step == total_steps - 1)


class ValidationMachine:
    """The states of the current validation pass; `version` is the weights it validates.

    `state` is where the pass is; `running` says whether that state's work is in flight
    (GENERATE/SCORE) or finished and waiting for the next move. Every move is logged with
    version, group and reason; `started`/`finished` hold timestamps of the current pass.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.state = V.IDLE
        self.version: int | None = None
        self.running = False
        self.started: dict[ValidationState, float] = {}
        self.finished: dict[ValidationState, float] = {}

    def advance(self, to: ValidationState, *, group: str, reason: str,
                version: int | None = None, now: float | None = None) -> None:
        """Move to `to` (IDLE -> GENERATE needs `version`); raises on an illegal move."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalValidationTransition(self.version, self.state, to)
        if self.running:
            raise IllegalValidationTransition(self.version, self.state, to,
                                              f"{self.state} is still running")
        if to is V.GENERATE:
            if version is None:
                raise IllegalValidationTransition(None, self.state, to, "no version given")
            self.version, self.started, self.finished = version, {}, {}
        now = self.clock() if now is None else now
        logger.log(TRANSITION_LOG_LEVEL, "validation v%s: %s -> %s on %s (%s)",
                   self.version, self.state, to, group, reason)
        self.state = to
        self.running = to in (V.GENERATE, V.SCORE)
        self.started[to] = now
        if to is V.IDLE:
            self.version = None

    def complete(self, *, group: str, reason: str = "", now: float | None = None) -> None:
        """The current state's work has finished (not a transition: the state stays)."""
        if not self.running:
            raise IllegalValidationTransition(self.version, self.state, self.state,
                                              "nothing is running")
        now = self.clock() if now is None else now
        self.running = False
        self.finished[self.state] = now
        logger.log(TRANSITION_LOG_LEVEL, "validation v%s: %s finished on %s in %.3fs%s",
                   self.version, self.state, group, now - self.started[self.state],
                   f" ({reason})" if reason else "")

    def duration(self, state: ValidationState) -> float | None:
        if state in self.started and state in self.finished:
            return self.finished[state] - self.started[state]
        return None


# The end-of-run table's rows: (metric, label, format). Metrics a run lacks are left out.
TABLE_ROWS = (("val/exact_frac", "exact-match accuracy", "{:.3f}"),
              ("val/eos_frac", "ended by a stop token", "{:.3f}"),
              ("val/response_length_mean", "response length (tokens)", "{:.2f}"),
              ("val/reward_mean", "reward mean", "{:.3f}"))


def first_last_table(results: Sequence[Mapping]) -> str:
    """First vs last validation pass as a small text table (empty without a pass).

    ``results`` are the driver's validation records, ``{"version": v, "val/...": x}`` in the
    order they ran; the run logs the table when it ends, so a newcomer sees in three lines
    what training changed without opening TensorBoard.
    """
    if not results:
        return ""
    first, last = results[0], results[-1]
    table = [("validation", f"v{first['version']}", f"v{last['version']}")]
    table += [(label, fmt.format(first[key]), fmt.format(last[key]))
              for key, label, fmt in TABLE_ROWS if key in first and key in last]
    w = [max(len(row[i]) for row in table) for i in range(3)]
    return "\n".join(f"{a:<{w[0]}}  {b:>{w[1]}}  {c:>{w[2]}}" for a, b, c in table)
