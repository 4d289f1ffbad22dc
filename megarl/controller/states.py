"""The states of one training step and the one table of legal moves between them.

This module owns the vocabulary of the controller: `StepState`, `TRANSITIONS`,
`IllegalTransition`, and `StepMachine` (one step's state and the times of its work). It says nothing about *when* a move happens (that is
`megarl.controller.machine.Pipeline`) or about validation's own states
(`megarl.controller.validation`).

    PENDING -> GENERATE -> REWARD -> REF_LOGP -> [VALUES] -> LOGP -> TRAIN -> SYNC
                              SYNC -> [CHECKPOINT] -> VALIDATE -> DONE
                                  \\________________\\______________/

VALUES (the critic's value of every prefix, for GAE) is a state of a run with a critic
(``algorithm.adv_estimator=gae``) and of no other: such a run walks `CRITIC_WORK_STATES`, any
other `WORK_STATES`; REF_LOGP has one edge for each. CHECKPOINT is a step's when
`trainer.save_freq` asks for one after it: it runs on the trainer's group while the other
groups go on (GENERATE(k+2) overlaps CHECKPOINT(k) one step off), and TRAIN(k+1) waits for it.

A step is in a state from the moment that state's work starts until the next state's work
starts; whether the work of the current state has finished is the machine's business.
"""
from __future__ import annotations

import enum
import logging
import time
from types import MappingProxyType
from typing import Callable, Mapping

logger = logging.getLogger(__name__)
TRANSITION_LOG_LEVEL = logging.DEBUG


class StepState(enum.Enum):
    PENDING = "pending"
    GENERATE = "generate"
    REWARD = "reward"
    REF_LOGP = "ref_logp"
    VALUES = "values"
    LOGP = "logp"
    TRAIN = "train"
    SYNC = "sync"
    CHECKPOINT = "checkpoint"
    VALIDATE = "validate"
    DONE = "done"

    def __str__(self) -> str:  # log lines read "GENERATE", not "StepState.GENERATE"
        return self.name


S = StepState

# Why each edge exists (and why there are no others: no state is skipped, none repeated).
_EDGES: dict[StepState, tuple[tuple[StepState, str], ...]] = {
    S.PENDING: ((S.GENERATE, "a step starts by sampling responses to its prompts"),),
    S.GENERATE: ((S.REWARD, "scores need finished responses (streaming reward scores most of "
                            "them during GENERATE; REWARD collects the tail)"),),
    S.REWARD: ((S.REF_LOGP, "the reference policy's log-probs (KL) need the final batch, "
                            "which REWARD may still filter or reorder"),),
    S.REF_LOGP: ((S.VALUES, "GAE needs the critic's values of the final batch (a run with a "
                            "critic); they come before LOGP so LOGP stays last before TRAIN"),
                 (S.LOGP, "the batch is complete except for the proximal policy's log-probs; "
                          "LOGP runs last before TRAIN so it sees the weights TRAIN starts from "
                          "(on a group of its own, once SYNC(k-1) has brought them there)")),
    S.VALUES: ((S.LOGP, "the critic's values are in; what is missing is the proximal policy's "
                        "log-probs, taken last before TRAIN"),),
    S.LOGP: ((S.TRAIN, "advantages and the decoupled importance ratio need rewards, reference, "
                       "proximal and behaviour log-probs"),),
    S.TRAIN: ((S.SYNC, "new trainer weights are worth nothing until the generators have them"),),
    S.SYNC: ((S.CHECKPOINT, "save_freq (or the last step) asks to save the weights just "
                            "synced with where the data stands; the trainer's group saves "
                            "while the other groups go on"),
             (S.VALIDATE, "test_freq (or the last step) asks to validate the weights just "
                          "synced, on the generate group"),
             (S.DONE, "no checkpoint and no validation is due after this step")),
    S.CHECKPOINT: ((S.VALIDATE, "saved; the validation of this step's weights (started when "
                                "SYNC finished) has not been scored yet"),
                   (S.DONE, "saved, and no validation is due or it has been scored")),
    S.VALIDATE: ((S.DONE, "validation of this step's weights has been scored"),),
    S.DONE: (),
}

TRANSITIONS: Mapping[StepState, frozenset[StepState]] = MappingProxyType(
    {state: frozenset(to for to, _ in edges) for state, edges in _EDGES.items()})
"""state -> the states it may move to next. The only transition table of the controller."""

WORK_STATES: tuple[StepState, ...] = (S.GENERATE, S.REWARD, S.REF_LOGP, S.LOGP, S.TRAIN, S.SYNC)
"""States every training step works through, in order (VALIDATE only when due)."""

CRITIC_WORK_STATES: tuple[StepState, ...] = (S.GENERATE, S.REWARD, S.REF_LOGP, S.VALUES, S.LOGP,
                                             S.TRAIN, S.SYNC)
"""The same for a run with a critic: VALUES between REF_LOGP and LOGP."""


def work_states(critic: bool) -> tuple[StepState, ...]:
    return CRITIC_WORK_STATES if critic else WORK_STATES


def why(frm: StepState, to: StepState) -> str:
    """The documented reason for edge `frm -> to` (KeyError if there is no such edge)."""
    for target, reason in _EDGES[frm]:
        if target is to:
            return reason
    raise KeyError(f"{frm} -> {to}")


class IllegalTransition(Exception):
    """A move the table forbids: names the step, where it was and where it was asked to go."""

    def __init__(self, step: int, frm: StepState, to: StepState, detail: str = ""):
        allowed = ", ".join(sorted(s.name for s in TRANSITIONS[frm])) or "nothing (final)"
        msg = f"step {step}: illegal transition {frm} -> {to} (from {frm} allowed: {allowed})"
        super().__init__(msg + (f"; {detail}" if detail else ""))
        self.step, self.frm, self.to = step, frm, to


def check(step: int, frm: StepState, to: StepState) -> None:
    """Raise `IllegalTransition` unless the table allows `frm -> to`."""
    if to not in TRANSITIONS[frm]:
        raise IllegalTransition(step, frm, to)


class StepMachine:
    """One training step's state; moves only along `states.TRANSITIONS`.

    `running` says whether the current state's work is in flight or finished; `started` and
    `finished` record when each state's work began and ended (timing metrics).
    """

    def __init__(self, step: int, clock: Callable[[], float] = time.monotonic):
        self.step, self.clock = step, clock
        self.state = S.PENDING
        self.running = False
        self.started: dict[StepState, float] = {}
        self.finished: dict[StepState, float] = {}

    def advance(self, to: StepState, *, group: str, reason: str,
                now: float | None = None) -> None:
        """Move to `to`, whose work starts now (DONE has none). Logs step, group, reason."""
        check(self.step, self.state, to)
        if self.running:
            raise IllegalTransition(self.step, self.state, to, f"{self.state} is still running")
        now = self.clock() if now is None else now
        logger.log(TRANSITION_LOG_LEVEL, "step %d: %s -> %s on %s (%s)",
                   self.step, self.state, to, group, reason)
        self.state = to
        self.running = to is not S.DONE
        self.started[to] = now
        if to is S.DONE:
            self.finished[to] = now

    def complete(self, *, group: str, reason: str = "", now: float | None = None) -> None:
        """The current state's work has finished (the state stays until the next advance)."""
        if not self.running:
            raise IllegalTransition(self.step, self.state, self.state, "nothing is running")
        now = self.clock() if now is None else now
        self.running = False
        self.finished[self.state] = now
        logger.log(TRANSITION_LOG_LEVEL, "step %d: %s finished on %s in %.3fs%s", self.step,
                   self.state, group, now - self.started[self.state],
                   f" ({reason})" if reason else "")

    def done_with(self, state: StepState) -> bool:
        """Whether `state`'s work for this step has finished."""
        return state in self.finished

    def duration(self, state: StepState) -> float | None:
        if state in self.started and state in self.finished:
            return self.finished[state] - self.started[state]
        return None
