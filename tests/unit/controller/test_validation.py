"""Validation StateMachine: its table, its triggers, and how the pipeline interleaves it."""
import itertools
import logging

import pytest

from megarl.controller.machine import Action, Pipeline, simulate, task_groups
from megarl.controller.states import StepState
from megarl.controller.validation import (TRANSITIONS, IllegalValidationTransition,
                                          ValidationMachine, ValidationState, validates_after)

S, V = StepState, ValidationState
SEPARATED = task_groups([["logp", "actor-train", "ref_logp"], "generate"])
COLOCATED = {t: "all" for t in ("generate", "reward", "ref_logp", "logp", "actor-train")}
DUR = {"generate": 4.0, "reward": 0.5, "ref_logp": 0.5, "logp": 0.5, "actor-train": 2.0,
       "sync": 0.25, "val-generate": 1.5, "val-score": 0.25}


def by(tl, task, step):
    return next(i for i in tl if i.task == task and i.step == step)


def test_cycle_and_logging(caplog):
    caplog.set_level(logging.DEBUG, logger="megarl.controller")
    vm = ValidationMachine(clock=lambda: 0.0)
    for cycle in range(2):
        vm.advance(V.GENERATE, group="gen", reason="test_freq", version=cycle, now=0)
        assert vm.running and vm.version == cycle
        vm.complete(group="gen", now=2)
        vm.advance(V.SCORE, group="reward", reason="generated", now=2)
        vm.complete(group="reward", now=3)
        vm.advance(V.DONE, group="reward", reason="scored", now=3)
        assert vm.duration(V.GENERATE) == 2 and vm.duration(V.SCORE) == 1
        vm.advance(V.IDLE, group="reward", reason="again", now=3)
        assert vm.version is None
    assert "validation v0: IDLE -> GENERATE on gen (test_freq)" in caplog.messages


@pytest.mark.parametrize("frm,to", [
    (a, b) for a, b in itertools.product(ValidationState, ValidationState)
    if b not in TRANSITIONS[a]])
def test_every_illegal_pair_raises(frm, to):
    vm = ValidationMachine(clock=lambda: 0.0)
    path = [V.GENERATE, V.SCORE, V.DONE]
    for state in path[:path.index(frm) + 1] if frm is not V.IDLE else []:
        vm.advance(state, group="g", reason="walk", version=5)
        if vm.running:
            vm.complete(group="g")
    assert vm.state is frm
    with pytest.raises(IllegalValidationTransition) as err:
        vm.advance(to, group="g", reason="bad", version=5)
    assert (err.value.frm, err.value.to) == (frm, to)


def test_running_and_missing_version_raise():
    vm = ValidationMachine()
    with pytest.raises(IllegalValidationTransition, match="no version"):
        vm.advance(V.GENERATE, group="g", reason="r")
    vm.advance(V.GENERATE, group="g", reason="r", version=0)
    with pytest.raises(IllegalValidationTransition, match="still running"):
        vm.advance(V.SCORE, group="g", reason="r")
    vm.complete(group="g")
    with pytest.raises(IllegalValidationTransition, match="nothing is running"):
        vm.complete(group="g")


def test_trigger_rule():
    due = [k for k in range(10) if validates_after(k, total_steps=10, test_freq=3)]
    assert due == [2, 5, 8, 9]  # every 3rd step, and the last
    assert not any(validates_after(k, total_steps=10, test_freq=-1) for k in range(10))


def run(a, groups, steps=6, durations=DUR, **kw):
    p = Pipeline(a, steps, groups=groups, clock=lambda: 0.0, **kw)
    served = {}

    def cost(action):
        if action.task == "val-generate":
            served[action.version] = p.weight_version
        return durations.get(action.task, 0.0)

    return p, simulate(p, cost), served


@pytest.mark.parametrize("groups", [SEPARATED, COLOCATED], ids=["separated", "colocated"])
@pytest.mark.parametrize("a", [1, 2, 3])
def test_interleaving_validates_the_right_weights(a, groups):
    p, tl, served = run(a, groups, test_freq=2, val_before_train=True)
    assert sorted(p.val_scored) == [0, 2, 4, 6]
    assert served == {v: v for v in (0, 2, 4, 6)}  # generators hold exactly that version
    for v in (0, 2, 4, 6):
        gen, score = by(tl, "val-generate", v - 1), by(tl, "val-score", v - 1)
        assert gen.group == groups["generate"] and score.start >= gen.end
        if v > 0:
            assert gen.start >= by(tl, "sync", v - 1).end
        if v < 6:
            assert by(tl, "sync", v).start >= gen.end  # SYNC(v) waits for the validation
    for k in range(6):  # steps whose SYNC triggered validation went through VALIDATE
        assert (S.VALIDATE in p.steps[k].started) == (k in (1, 3, 5))


def test_validation_fills_idle_generate_time_when_train_bound():
    train_bound = {**DUR, "generate": 1.0, "actor-train": 4.0}
    _, with_val, _ = run(2, SEPARATED, durations=train_bound, test_freq=2)
    _, without, _ = run(2, SEPARATED, durations=train_bound)
    last_sync = lambda tl: max(i.end for i in tl if i.task == "sync")
    assert last_sync(with_val) == last_sync(without)  # training was not stalled at all
    for v in (2, 4):  # validation ran in the generate group's gap between two GENERATEs
        gen = by(with_val, "val-generate", v - 1)
        assert by(with_val, "generate", v + 1).end <= gen.start
        if v + 2 < 6:
            assert gen.end <= by(with_val, "generate", v + 2).start


def test_training_generate_goes_before_validation():
    p = Pipeline(2, 4, 1, True, groups=SEPARATED, clock=lambda: 0.0)
    assert [str(a) for a in p.ready()] == ["GENERATE(0)@generate"]


def test_val_only_schedules_validation_alone(caplog):
    caplog.set_level(logging.DEBUG, logger="megarl.controller")
    p = Pipeline(2, 10, test_freq=2, val_before_train=True, groups=SEPARATED, val_only=True,
                 clock=lambda: 0.0)
    assert p.steps == {}
    tl = simulate(p, DUR)
    assert [i.task for i in tl] == ["val-generate", "val-score"]
    assert p.val_scored == {0} and p.done and p.weight_version == 0
    assert any("(val_only)" in m for m in caplog.messages)


def test_illegal_validation_start():
    p = Pipeline(1, 2, test_freq=1, groups=SEPARATED, clock=lambda: 0.0)
    from megarl.controller.states import IllegalTransition
    with pytest.raises(IllegalTransition, match="not ready"):  # nothing due yet
        p.start(Action(-1, S.VALIDATE, "generate", V.GENERATE))


def test_first_last_table():
    from megarl.controller.validation import first_last_table

    first = {"version": 0, "val/reward_mean": 0.01, "val/exact_frac": 0.0,
             "val/eos_frac": 0.0, "val/response_length_mean": 4.0}
    mid = {**first, "version": 50, "val/exact_frac": 0.5}
    last = {"version": 400, "val/reward_mean": 1.0, "val/exact_frac": 0.96875,
            "val/eos_frac": 1.0, "val/response_length_mean": 2.0}
    lines = first_last_table([first, mid, last]).splitlines()
    assert lines[0].split() == ["validation", "v0", "v400"]        # first and last pass only
    assert lines[1].split() == ["exact-match", "accuracy", "0.000", "0.969"]
    assert lines[2].split() == ["ended", "by", "a", "stop", "token", "0.000", "1.000"]
    assert lines[3].split()[-2:] == ["4.00", "2.00"] and len(lines) == 5
    assert len({len(line) for line in lines}) == 1                   # aligned columns
    # a metric one of the two passes lacks is left out; no pass, no table
    del last["val/eos_frac"]
    assert "stop token" not in first_last_table([first, last])
    assert first_last_table([]) == ""
