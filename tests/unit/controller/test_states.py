"""The step transition table and StepMachine: every legal edge walked, every illegal one raising."""
import itertools
import logging

import pytest

from megarl.controller.machine import StepMachine
from megarl.controller.states import (CRITIC_WORK_STATES, TRANSITIONS, WORK_STATES,
                                      IllegalTransition, StepState, check, why)

S = StepState
PATH = [S.GENERATE, S.REWARD, S.REF_LOGP, S.LOGP, S.TRAIN, S.SYNC]


CRITIC_PATH = [S.GENERATE, S.REWARD, S.REF_LOGP, S.VALUES, S.LOGP, S.TRAIN, S.SYNC]


def test_table_is_the_documented_chain():
    assert tuple(PATH) == WORK_STATES
    assert tuple(CRITIC_PATH) == CRITIC_WORK_STATES
    for path in (PATH, CRITIC_PATH):
        chain = [S.PENDING] + path
        for a, b in zip(chain, chain[1:]):
            assert b in TRANSITIONS[a]
    # REF_LOGP is the one fork: VALUES with a critic, LOGP without
    assert TRANSITIONS[S.REF_LOGP] == {S.VALUES, S.LOGP}
    for a in set(StepState) - {S.REF_LOGP, S.SYNC, S.CHECKPOINT, S.VALIDATE, S.DONE}:
        assert len(TRANSITIONS[a]) == 1
    # after SYNC: an optional CHECKPOINT, then an optional VALIDATE
    assert TRANSITIONS[S.SYNC] == {S.CHECKPOINT, S.VALIDATE, S.DONE}
    assert TRANSITIONS[S.CHECKPOINT] == {S.VALIDATE, S.DONE}
    assert TRANSITIONS[S.VALIDATE] == {S.DONE}
    assert TRANSITIONS[S.DONE] == frozenset()
    assert set(TRANSITIONS) == set(StepState)
    for frm, targets in TRANSITIONS.items():
        for to in targets:
            assert why(frm, to)  # every edge says why it exists


@pytest.mark.parametrize("frm,to", [
    (a, b) for a, b in itertools.product(StepState, StepState) if b not in TRANSITIONS[a]])
def test_every_illegal_pair_raises(frm, to):
    with pytest.raises(IllegalTransition) as err:
        check(7, frm, to)
    assert (err.value.step, err.value.frm, err.value.to) == (7, frm, to)
    assert "step 7" in str(err.value) and f"{frm} -> {to}" in str(err.value)


def walk(m, path, group="g"):
    t = 0.0
    for state in path:
        m.advance(state, group=group, reason=f"r-{state}", now=t)
        if state is not S.DONE:
            m.complete(group=group, now=t + 1)
        t += 2
    return m


@pytest.mark.parametrize("path", [PATH, CRITIC_PATH])
@pytest.mark.parametrize("tail", [[S.DONE], [S.VALIDATE, S.DONE], [S.CHECKPOINT, S.DONE],
                                  [S.CHECKPOINT, S.VALIDATE, S.DONE]])
def test_walk_every_path_logs_step_group_reason(path, tail, caplog):
    caplog.set_level(logging.DEBUG, logger="megarl.controller")
    m = walk(StepMachine(3), path + tail, group="gen")
    assert m.state is S.DONE and not m.running
    moves = [r.getMessage() for r in caplog.records if "->" in r.getMessage()]
    assert len(moves) == len(path) + len(tail)
    assert moves[0] == "step 3: PENDING -> GENERATE on gen (r-GENERATE)"
    for state in path:
        assert m.duration(state) == 1.0


def test_cannot_skip_repeat_or_leave_done():
    m = StepMachine(0)
    with pytest.raises(IllegalTransition):
        m.advance(S.REWARD, group="g", reason="skip")
    walk(m, [S.GENERATE])
    with pytest.raises(IllegalTransition):
        m.advance(S.GENERATE, group="g", reason="again")
    walk(m, PATH[1:] + [S.DONE])
    with pytest.raises(IllegalTransition):
        m.advance(S.GENERATE, group="g", reason="after done")


def test_cannot_move_on_while_running_or_complete_twice():
    m = StepMachine(1)
    m.advance(S.GENERATE, group="g", reason="go", now=0)
    with pytest.raises(IllegalTransition, match="still running"):
        m.advance(S.REWARD, group="g", reason="too early")
    m.complete(group="g", now=1)
    with pytest.raises(IllegalTransition, match="nothing is running"):
        m.complete(group="g", now=2)
