"""The one owner of run phase state: which work of which step may run next, on which group.

`StepMachine` holds one training step's state (the table in `states.py` decides legal moves);
`Pipeline` holds every step's machine, the validation machine, which group is busy with what,
and the timeline of finished work; it decides what may start. It runs nothing and knows no
Ray or asyncio: a driver asks `ready()`, `start`s what it gets, runs it, and `finish`es it:

    while not pipeline.done:
        for action in pipeline.ready():      # group-disjoint; start them all
            pipeline.start(action)
            launch(action)                   # e.g. asyncio.create_task(run(action))
        action = await next_completed()
        pipeline.finish(action)

`ready()` already accounts for the actions it returns being started (starting GENERATE(j)
can unblock a SYNC), so the list is complete until the next `finish`.

Scheduling rules (with a = generate_ahead_steps, steps start_step .. total_steps-1):
- Tasks on one group serialize: a group runs one action at a time.
- Each state's work runs in step order (REWARD(k) after REWARD(k-1), ...).
- GENERATE(j) waits for SYNC(j - a) (not at all when j - a < start_step).
- LOGP(k) waits for TRAIN(k-1): the proximal policy is the weights TRAIN(k) starts from.
  With logp on a group of its own, LOGP(k) waits for SYNC(k-1) instead: its group holds a
  replica of the actor that receives version k through that sync, as the engines do.
- TRAIN(k) waits for SYNC(k-1).
- With a critic (`critic=True`), VALUES(k) runs between REF_LOGP(k) and LOGP(k), on the
  critic's group, and waits for TRAIN(k-1), which trains the critic too: values come from
  the critic TRAIN(k) starts from, as log-probs come from that actor.
- SYNC(k) waits until GENERATE(k + a - 1) has started (when that step exists; with
  `sync_between_generations`, until it has finished), and until every due validation of a
  version <= k has finished its GENERATE. This pins what generation
  sees, even when everything shares one group (there a = 2 still means one-step-off):

  **Weight versions.** Version v is the trainer's weights after v train steps (version
  start_step is the initial or resumed model); SYNC(k) publishes version k + 1. GENERATE(j)
  starts on version max(start_step, j - a + 1) exactly — a = 1: the weights trained on
  steps < j (synchronous on-policy, staleness 0); a = 2: one version older (one-step-off,
  staleness 1 after the first step). With the dual buffer a SYNC may land while GENERATE(j)
  still runs; its later tokens then come from a newer version (never an older one), and every
  token carries its version, so staleness is measured where data is consumed.
- REWARD/REF_LOGP/LOGP(k) overlap GENERATE(k+1) whenever they are on other groups.
- Priority on a contended group: training before validation; older steps first.
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from collections import deque
from typing import Callable, Iterable, Mapping, Sequence, Union

from megarl.cluster.topology import group_name, normalize_groups

from .states import CRITIC_WORK_STATES, IllegalTransition, StepMachine, StepState, work_states
from .validation import ValidationMachine, ValidationState, validates_after

logger = logging.getLogger(__name__)

S, V = StepState, ValidationState

TASK_OF_STATE = {S.GENERATE: "generate", S.REWARD: "reward", S.REF_LOGP: "ref_logp",
                 S.VALUES: "values", S.LOGP: "logp", S.TRAIN: "actor-train", S.SYNC: "sync",
                 S.CHECKPOINT: "checkpoint"}
"""The task (topology name) that does each state's work; "sync" is the trainer's export,
"values" the critic's forward (on the group of the topology task "critic"), "checkpoint" the
trainer's save (on the actor-train group)."""
VAL_TASK_OF_PHASE = {V.GENERATE: "val-generate", V.SCORE: "val-score"}
_ORDER = {state: i for i, state in enumerate(CRITIC_WORK_STATES + (S.CHECKPOINT,))}


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of work: `state`'s work for `step` on `group`.

    Validation actions have state VALIDATE, `phase` GENERATE or SCORE and step = version - 1
    (the step whose SYNC published the version; start_step - 1 for validating the initial
    weights).
    """
    step: int
    state: StepState
    group: str
    phase: ValidationState | None = None

    @property
    def task(self) -> str:
        """generate | reward | ref_logp | values | logp | actor-train | sync | checkpoint |
        val-generate | val-score"""
        if self.state is S.VALIDATE:
            return VAL_TASK_OF_PHASE[self.phase]
        return TASK_OF_STATE[self.state]

    @property
    def version(self) -> int | None:
        """For validation actions, the weight version validated."""
        return self.step + 1 if self.state is S.VALIDATE else None

    def __str__(self) -> str:
        if self.state is S.VALIDATE:
            return f"VALIDATE-{self.phase}(v{self.version})@{self.group}"
        return f"{self.state}({self.step})@{self.group}"


@dataclasses.dataclass(frozen=True)
class Interval:
    """Finished work: what ran on which group, when (the pipeline's clock)."""
    group: str
    task: str
    step: int
    start: float
    end: float


def task_groups(separated_node_tasks: Sequence[Union[str, Sequence[str]]]) -> dict[str, str]:
    """task -> group name from `trainer.separated_node_tasks` (names as in `GroupPlan.name`).

    `reward`, when no group lists it, runs on its own "reward" group (CPU, the driver's pool).
    """
    mapping = {task: group_name(tasks) for tasks in normalize_groups(separated_node_tasks)
               for task in tasks}
    mapping.setdefault("reward", "reward")
    return mapping


@dataclasses.dataclass(frozen=True)
class Incident:
    step: int
    task: str
    what: str
    at: float  # seconds since the pipeline started


class Pipeline:
    """Phase state of a run: step machines, validation, busy groups, timeline. See module doc.

    `groups` maps task -> group name for generate, reward, ref_logp, logp, actor-train
    (e.g. `task_groups(cfg.trainer.separated_node_tasks)`); optional keys: "sync" (default:
    the actor-train group), "val-generate" (default: the generate group), "val-score"
    (default: the reward group), "values" (default: the "critic" group, else the actor-train
    group). None puts every task on one group "colocated", reward on "reward". `critic`: the
    steps walk VALUES (`states.CRITIC_WORK_STATES`). `val_only`: validate version
    `start_step` once and schedule no train step. `start_step`: first step to run (resume);
    its weights are version `start_step`.
    """

    def __init__(self, generate_ahead_steps: int, total_steps: int, test_freq: int = -1,
                 val_before_train: bool = False, *, groups: Mapping[str, str] | None = None,
                 val_only: bool = False, start_step: int = 0, critic: bool = False,
                 save_freq: int = -1, sync_between_generations: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        if generate_ahead_steps < 1:
            raise ValueError(f"trainer.generate_ahead_steps must be >= 1, got "
                             f"{generate_ahead_steps}")
        if not 0 <= start_step <= total_steps:
            raise ValueError(f"start step {start_step} outside [0, total_steps={total_steps}]")
        self.ahead, self.total_steps, self.test_freq = generate_ahead_steps, total_steps, test_freq
        self.save_freq = save_freq
        # SYNC(k) after GENERATE(k+a-1) has finished: each generation on one version
        self.sync_between_generations = sync_between_generations
        self.start_step, self.val_only, self.clock = start_step, val_only, clock
        self.groups = self._resolve_groups(groups)
        # logp on a group of its own computes on a replica the weight sync keeps current
        self.separate_logp = self.groups["logp"] != self.groups["actor-train"]
        self.work = work_states(critic)
        self.weight_version = start_step
        """Latest version published by a finished SYNC (what the generators serve next)."""
        self.steps: dict[int, StepMachine] = {} if val_only else {
            k: StepMachine(k, clock) for k in range(start_step, total_steps)}
        self.validation = ValidationMachine(clock)
        # step -> its StepRecord (controller/batch.py), what its states produced, kept from
        # GENERATE until the step's last state has finished
        self.records: dict = {}
        self.val_queue: deque[int] = deque()
        """Versions whose validation is due and has not started, oldest first."""
        self.val_generated: set[int] = set()
        self.val_scored: set[int] = set()
        self.busy: dict[str, Action] = {}
        self.timeline: list[Interval] = []
        self.incidents: list[Incident] = []
        """What went wrong under a state and how it was mended (an engine died, was
        replaced, went live again), in the order it happened."""
        self.t0 = clock()
        self._first = start_step  # every step before it is DONE
        if val_only or val_before_train:
            self.val_queue.append(start_step)

    def add_intervals(self, intervals) -> None:
        """Work done outside the schedule (a step's tool calls): (group, task, step, start,
        end) on this pipeline's clock, shown on the timeline's row for `group`."""
        self.timeline.extend(Interval(*iv) for iv in intervals)

    def incident(self, step: int, task: str, what: str) -> None:
        """Record a failure (or its recovery) met by `task`'s work for `step`."""
        self.incidents.append(Incident(step, task, what, self.clock() - self.t0))
        logger.warning("step %d %s: %s", step, task, what)

    @staticmethod
    def _resolve_groups(groups: Mapping[str, str] | None) -> dict[str, str]:
        if groups is None:
            groups = {t: "colocated" for t in ("generate", "ref_logp", "logp", "actor-train")}
            groups["reward"] = "reward"
        groups = dict(groups)
        missing = [t for t in ("generate", "reward", "ref_logp", "logp", "actor-train")
                   if t not in groups]
        if missing:
            raise ValueError(f"no group given for task(s) {', '.join(missing)}")
        groups.setdefault("sync", groups["actor-train"])
        groups.setdefault("checkpoint", groups["actor-train"])
        groups.setdefault("val-generate", groups["generate"])
        groups.setdefault("val-score", groups["reward"])
        groups.setdefault("values", groups.get("critic", groups["actor-train"]))
        return groups

    # ---- versions ------------------------------------------------------------------------

    def weight_version_for_generate(self, step: int) -> int:
        """The version GENERATE(step) starts on: max(start_step, step - a + 1)."""
        return max(self.start_step, step - self.ahead + 1)

    def checkpoint_due(self, step: int) -> bool:
        """Whether CHECKPOINT(step) follows SYNC(step): every `save_freq` steps and the last,
        counting completed steps as verl does (0-based `step` completes step + 1; its
        checkpoint is global_step_<step + 1>)."""
        return (self.save_freq > 0 and not self.val_only
                and ((step + 1) % self.save_freq == 0 or step + 1 == self.total_steps))

    def _saved(self, step: int) -> bool:
        """Step's checkpoint, if one is due, has been written (True for steps before the run)."""
        return not self.checkpoint_due(step) or self._past(step, S.CHECKPOINT)

    def staleness(self, step: int) -> int:
        """Versions between step's first generated tokens and the TRAIN(step) that uses them."""
        return step - self.weight_version_for_generate(step)

    # ---- what may run ----------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return (self._first >= self.total_steps or self.val_only) and self._validation_idle()

    def _validation_idle(self) -> bool:
        return not self.val_queue and self.validation.state is V.IDLE

    def _past(self, step: int, state: StepState) -> bool:
        """Whether `state`'s work for `step` has finished (True for steps before the run)."""
        if step < self.start_step:
            return True
        if step >= self.total_steps:
            return False
        return self.steps[step].done_with(state)

    def _generate_started(self, step: int, started: set[Action]) -> bool:
        if step >= self.total_steps:
            return True  # no such step: nothing to pin
        if self.sync_between_generations:
            return self._past(step, S.GENERATE)
        return (self.steps[step].state is not S.PENDING
                or Action(step, S.GENERATE, self.groups["generate"]) in started)

    def _val_blocks_sync(self, k: int) -> bool:
        """A due validation of a version <= k has not finished its GENERATE."""
        pending = list(self.val_queue)
        if self.validation.version is not None and self.validation.state is V.GENERATE:
            pending.append(self.validation.version)
        return any(v <= k and v not in self.val_generated for v in pending)

    def _step_candidate(self, k: int, started: set[Action]) -> Action | None:
        m = self.steps[k]
        if m.running or m.state in (S.CHECKPOINT, S.VALIDATE, S.DONE):
            return None
        if m.state is S.SYNC:  # finished, and `finish` left it here: a checkpoint is due
            action = Action(k, S.CHECKPOINT, self.groups["checkpoint"])
            return None if action in started else action
        nxt = S.GENERATE if m.state is S.PENDING else self.work[self.work.index(m.state) + 1]
        action = Action(k, nxt, self.groups[TASK_OF_STATE[nxt]])
        if action in started or not self._past(k - 1, nxt):
            return None
        if nxt is S.GENERATE and not self._past(k - self.ahead, S.SYNC):
            return None
        if nxt in (S.VALUES, S.LOGP) and not self._past(k - 1, S.TRAIN):
            return None
        if nxt is S.LOGP and self.separate_logp and not self._past(k - 1, S.SYNC):
            return None  # the logp group's replica receives version k through SYNC(k-1)
        if nxt is S.TRAIN and not (self._past(k - 1, S.SYNC) and self._saved(k - 1)):
            return None  # the checkpoint of step k-1 holds the weights TRAIN(k) changes
        if nxt is S.SYNC and (not self._generate_started(k + self.ahead - 1, started)
                              or self._val_blocks_sync(k)):
            return None
        return action

    def _val_candidate(self, started: set[Action]) -> Action | None:
        vm = self.validation
        if vm.running:
            return None
        if vm.state is V.IDLE and self.val_queue:
            action = Action(self.val_queue[0] - 1, S.VALIDATE, self.groups["val-generate"],
                            V.GENERATE)
        elif vm.state is V.GENERATE:
            action = Action(vm.version - 1, S.VALIDATE, self.groups["val-score"], V.SCORE)
        else:
            return None
        return None if action in started else action

    def _candidates(self, started: set[Action]) -> Iterable[tuple[tuple, Action]]:
        """(priority, action) for every action whose dependencies allow it to start."""
        pending_seen = False
        for k in range(self._first, self.total_steps if not self.val_only else self._first):
            if (self.steps[k].state is S.PENDING
                    and Action(k, S.GENERATE, self.groups["generate"]) not in started):
                if pending_seen:
                    break  # GENERATE runs in step order: later pending steps cannot start
                pending_seen = True
            action = self._step_candidate(k, started)
            if action is not None:
                yield (0, k, _ORDER[action.state]), action
        action = self._val_candidate(started)
        if action is not None:
            yield (1, action.step, 0), action

    def ready(self) -> list[Action]:
        """Actions that may start now, at most one per free group, best first.

        Start all of them: the list already assumes each earlier one has started.
        """
        chosen: list[Action] = []
        taken = set(self.busy)
        started: set[Action] = set()
        while True:
            best = min(((p, a) for p, a in self._candidates(started) if a.group not in taken),
                       default=None, key=lambda pa: pa[0])
            if best is None:
                return chosen
            chosen.append(best[1])
            taken.add(best[1].group)
            started.add(best[1])

    # ---- moves ---------------------------------------------------------------------------

    def start(self, action: Action, *, now: float | None = None) -> None:
        """Mark `action` running (its group busy). Raises if it may not start now."""
        if action.group in self.busy:
            raise IllegalTransition(action.step, self._state_of(action), action.state,
                                    f"group {action.group} is busy with {self.busy[action.group]}")
        if action not in {a for _, a in self._candidates(set())}:
            raise IllegalTransition(action.step, self._state_of(action), action.state,
                                    f"{action} is not ready")
        now = self.clock() if now is None else now
        if action.state is S.VALIDATE:
            if action.phase is V.GENERATE:
                version = self.val_queue.popleft()
                self.validation.advance(V.GENERATE, group=action.group, version=version,
                                        reason=self._val_reason(version), now=now)
            else:
                self.validation.advance(V.SCORE, group=action.group,
                                        reason="validation responses generated", now=now)
        else:
            self.steps[action.step].advance(action.state, group=action.group,
                                            reason=self._reason(action), now=now)
        self.busy[action.group] = action

    def finish(self, action: Action, *, now: float | None = None) -> None:
        """`action`'s work is over: free its group, record it, and make the moves it allows."""
        if self.busy.get(action.group) != action:
            raise IllegalTransition(action.step, self._state_of(action), action.state,
                                    f"{action} is not running")
        now = self.clock() if now is None else now
        del self.busy[action.group]
        self.timeline.append(Interval(action.group, action.task, action.step,
                                      self.busy_since(action, now), now))
        if action.state is S.VALIDATE:
            self._finish_validation(action, now)
            return
        m = self.steps[action.step]
        m.complete(group=action.group, now=now)
        k = action.step
        validates = validates_after(k, total_steps=self.total_steps, test_freq=self.test_freq)
        if action.state is S.SYNC:
            self.weight_version = k + 1
            if validates:  # queued now, so it overlaps a checkpoint rather than follow it
                self.val_queue.append(k + 1)
            if self.checkpoint_due(k):
                return  # stays in SYNC (finished) until CHECKPOINT(k) starts
        if action.state in (S.SYNC, S.CHECKPOINT):
            if validates and k + 1 not in self.val_scored:
                m.advance(S.VALIDATE, group=self.groups["val-generate"], now=now,
                          reason=f"test_freq={self.test_freq}: validate v{k + 1}")
            else:
                m.advance(S.DONE, group=action.group, now=now,
                          reason="saved" if action.state is S.CHECKPOINT else
                          "synced; no checkpoint or validation due")
                self._advance_first()

    def _finish_validation(self, action: Action, now: float) -> None:
        vm = self.validation
        vm.complete(group=action.group, now=now)
        if action.phase is V.GENERATE:
            self.val_generated.add(vm.version)
            return
        version = vm.version
        self.val_scored.add(version)
        vm.advance(V.DONE, group=action.group, reason="scored", now=now)
        vm.advance(V.IDLE, group=action.group, reason="pass complete", now=now)
        m = self.steps.get(version - 1)
        if m is not None and m.state is S.VALIDATE:
            m.complete(group=action.group, now=now)
            m.advance(S.DONE, group=action.group, reason=f"validation of v{version} scored",
                      now=now)
            self._advance_first()

    def _advance_first(self) -> None:
        while self._first < self.total_steps and self.steps[self._first].state is S.DONE:
            self._first += 1

    # ---- helpers -------------------------------------------------------------------------

    def busy_since(self, action: Action, now: float) -> float:
        if action.state is S.VALIDATE:
            return self.validation.started.get(action.phase, now)
        return self.steps[action.step].started.get(action.state, now)

    def _state_of(self, action: Action) -> StepState:
        if action.state is S.VALIDATE or action.step not in self.steps:
            return S.VALIDATE if action.state is S.VALIDATE else S.PENDING
        return self.steps[action.step].state

    def _reason(self, action: Action) -> str:
        k, state = action.step, action.state
        if state is S.GENERATE:
            return (f"weights v{self.weight_version_for_generate(k)} "
                    f"(generate_ahead_steps={self.ahead})")
        if state is S.SYNC:
            if self.sync_between_generations and k + self.ahead - 1 < self.total_steps:
                return (f"publish v{k + 1}, GENERATE({k + self.ahead - 1}) finished "
                        "(sync_between_generations)")
            return f"publish v{k + 1}"
        if state is S.CHECKPOINT:
            return f"save_freq={self.save_freq}: save v{k + 1}"
        prev = self.work[self.work.index(state) - 1]
        return f"{prev} finished"

    def _val_reason(self, version: int) -> str:
        if self.val_only:
            return "val_only"
        if version == self.start_step and version - 1 not in self.steps:
            return "val_before_train"
        return f"test_freq={self.test_freq}"

    def step_window(self, step: int) -> tuple[float, float]:
        """(start, end) of `step`'s period: previous SYNC's end (or t0) to this SYNC's end."""
        end = self.steps[step].finished[S.SYNC]
        prev = self.steps.get(step - 1)
        start = prev.finished[S.SYNC] if prev is not None else self.t0
        return start, end


Durations = Union[Mapping[str, float], Callable[[Action], float]]


def simulate(pipeline: Pipeline, durations: Durations) -> list[Interval]:
    """Drive `pipeline` to completion on a virtual clock; returns its timeline.

    `durations`: task name (see `Action.task`) -> seconds (missing tasks take 0), or a
    function of the action. The same loop a real driver runs, minus the work.
    """
    cost = durations if callable(durations) else (lambda a: float(durations.get(a.task, 0.0)))
    now, seq, heap = pipeline.t0, 0, []
    while not pipeline.done:
        for action in pipeline.ready():
            pipeline.start(action, now=now)
            heapq.heappush(heap, (now + cost(action), seq, action))
            seq += 1
        if not heap:
            raise RuntimeError(f"pipeline stalled: nothing running, nothing ready "
                               f"(steps: {[str(m.state) for m in pipeline.steps.values()]})")
        now, _, action = heapq.heappop(heap)
        pipeline.finish(action, now=now)
    return pipeline.timeline
