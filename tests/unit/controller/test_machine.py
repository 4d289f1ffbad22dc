"""Pipeline scheduling: groups serialize, generate_ahead_steps pins weight versions, overlap."""
import pytest

from megarl.controller.machine import Action, Pipeline, simulate, task_groups
from megarl.controller.states import IllegalTransition, StepState

S = StepState
SEPARATED = task_groups([["logp", "actor-train", "ref_logp"], "generate"])
COLOCATED = {t: "all" for t in ("generate", "reward", "ref_logp", "logp", "actor-train")}
DUR = {"generate": 4.0, "reward": 0.5, "ref_logp": 0.5, "logp": 0.5, "actor-train": 2.0,
       "sync": 0.25, "val-generate": 1.5, "val-score": 0.25}


def run(a, groups, steps=6, durations=DUR, **kw):
    p = Pipeline(a, steps, groups=groups, clock=lambda: 0.0, **kw)
    seen = {}  # GENERATE(j) -> version the generators served when it started

    def cost(action):
        if action.state is S.GENERATE:
            seen[action.step] = p.weight_version
        return durations.get(action.task, 0.0)

    tl = simulate(p, cost)
    assert p.done and all(m.state is S.DONE for m in p.steps.values())
    return p, tl, seen


def by(tl, task, step=None):
    hits = [i for i in tl if i.task == task and (step is None or i.step == step)]
    return hits if step is None else hits[0]


def overlaps(x, y):
    return x.start < y.end and y.start < x.end


def test_task_groups_from_config():
    assert SEPARATED == {"logp": "logp+actor-train+ref_logp", "actor-train":
                         "logp+actor-train+ref_logp", "ref_logp": "logp+actor-train+ref_logp",
                         "generate": "generate", "reward": "reward"}
    assert task_groups([["generate", "reward", "logp"]])["reward"] == "generate+reward+logp"


@pytest.mark.parametrize("groups", [SEPARATED, COLOCATED], ids=["separated", "colocated"])
@pytest.mark.parametrize("a", [1, 2, 3])
def test_weight_version_of_every_generate_is_exact(a, groups):
    p, tl, seen = run(a, groups)
    for j in range(6):
        assert seen[j] == p.weight_version_for_generate(j) == max(0, j - a + 1)
        assert p.staleness(j) == min(j, a - 1)
    for k in range(6):
        # per-state step order; TRAIN(k) after SYNC(k-1); LOGP(k) after TRAIN(k-1)
        for task in ("generate", "reward", "ref_logp", "logp", "actor-train", "sync"):
            if k:
                assert by(tl, task, k).start >= by(tl, task, k - 1).end
        if k:
            assert by(tl, "actor-train", k).start >= by(tl, "sync", k - 1).end
            assert by(tl, "logp", k).start >= by(tl, "actor-train", k - 1).end
        if k - a >= 0:
            assert by(tl, "generate", k).start >= by(tl, "sync", k - a).end
    # groups serialize
    for g in set(i.group for i in tl):
        mine = sorted((i for i in tl if i.group == g), key=lambda i: i.start)
        assert all(x.end <= y.start for x, y in zip(mine, mine[1:]))


def test_one_step_off_overlaps_generate_with_train_on_separate_groups():
    p, tl, _ = run(2, SEPARATED)
    assert all(overlaps(by(tl, "generate", k + 1), by(tl, "actor-train", k)) for k in range(4))
    # REWARD/REF_LOGP/LOGP(k) overlap GENERATE(k+1) when on other groups
    assert overlaps(by(tl, "ref_logp", 2), by(tl, "generate", 3))
    assert overlaps(by(tl, "reward", 2), by(tl, "generate", 3))
    # generate-bound: the generate group never waits after the first step
    gens = by(tl, "generate")
    assert all(x.end == y.start for x, y in zip(gens, gens[1:]))
    sync_p, sync_tl, _ = run(1, SEPARATED)
    assert tl[-1].end < sync_tl[-1].end
    assert not any(overlaps(g, t) for g in by(sync_tl, "generate")
                   for t in by(sync_tl, "actor-train"))


@pytest.mark.parametrize("a", [1, 2, 3])
def test_colocated_nothing_overlaps(a):
    _, tl, _ = run(a, COLOCATED)
    tl = sorted(tl, key=lambda i: i.start)
    assert all(x.end <= y.start for x, y in zip(tl, tl[1:]))
    assert tl[-1].end == pytest.approx(6 * sum(v for k, v in DUR.items()
                                               if not k.startswith("val")))


def test_colocated_two_ahead_is_really_one_step_off():
    """Everything on one group: GENERATE(k+1) still runs before SYNC(k) publishes v(k+1)."""
    _, tl, seen = run(2, COLOCATED)
    for k in range(5):
        assert by(tl, "generate", k + 1).end <= by(tl, "sync", k).start
        assert seen[k + 1] == k


def test_ready_is_group_disjoint_and_complete():
    p = Pipeline(2, 4, groups=SEPARATED, clock=lambda: 0.0)
    first = p.ready()
    assert first == [Action(0, S.GENERATE, "generate")]
    p.start(first[0], now=0)
    assert p.ready() == []
    p.finish(first[0], now=1)
    nxt = p.ready()
    assert {(a.step, a.state) for a in nxt} == {(0, S.REWARD), (1, S.GENERATE)}
    assert len({a.group for a in nxt}) == len(nxt)


def test_illegal_starts_and_finishes_raise():
    p = Pipeline(1, 3, groups=SEPARATED, clock=lambda: 0.0)
    with pytest.raises(IllegalTransition, match="not ready"):
        p.start(Action(0, S.TRAIN, SEPARATED["actor-train"]))
    with pytest.raises(IllegalTransition, match="not ready"):
        p.start(Action(1, S.GENERATE, "generate"))  # a=1: waits for SYNC(0)
    gen = Action(0, S.GENERATE, "generate")
    with pytest.raises(IllegalTransition, match="not running"):
        p.finish(gen)
    p.start(gen)
    with pytest.raises(IllegalTransition, match="busy"):
        p.start(gen)
    p.finish(gen)
    with pytest.raises(IllegalTransition, match="not running"):
        p.finish(gen)


def test_sync_waits_for_the_generate_it_must_not_change():
    """a=3, generate slow: SYNC(k) may not start before GENERATE(k+2) has started."""
    p, tl, seen = run(3, SEPARATED, durations={**DUR, "generate": 1.0, "actor-train": 0.1})
    for k in range(4):
        assert by(tl, "sync", k).start >= by(tl, "generate", k + 2).start


def test_resume_from_a_later_step():
    p, tl, seen = run(2, SEPARATED, steps=8, start_step=5)
    assert sorted(p.steps) == [5, 6, 7]
    assert seen == {5: 5, 6: 5, 7: 6}
    assert p.weight_version == 8


def test_bad_arguments():
    with pytest.raises(ValueError, match="generate_ahead_steps"):
        Pipeline(0, 3)
    with pytest.raises(ValueError, match="ref_logp"):
        Pipeline(1, 3, groups={"generate": "g", "reward": "r", "logp": "t", "actor-train": "t"})
    with pytest.raises(ValueError, match="start step"):
        Pipeline(1, 3, start_step=4)


def test_defaults_and_step_window():
    p = Pipeline(1, 2, clock=lambda: 0.0)
    assert p.groups["sync"] == p.groups["actor-train"] == "colocated"
    assert p.groups["val-generate"] == "colocated" and p.groups["val-score"] == "reward"
    simulate(p, {"generate": 1, "actor-train": 1, "sync": 1})
    assert p.step_window(0) == (0.0, 3.0) and p.step_window(1) == (3.0, 6.0)


def test_zero_steps_is_done_at_once():
    p = Pipeline(2, 0)
    assert p.done and p.ready() == []


@pytest.mark.parametrize("a", [1, 2])
def test_critic_steps_walk_values_on_the_critic_group(a):
    # the critic on its own group: VALUES(k) runs there, after REF_LOGP(k), before LOGP(k),
    # and never before TRAIN(k-1) (which trains the critic too) has finished
    groups = task_groups([["logp", "actor-train", "ref_logp"], "generate", "critic"])
    dur = {**DUR, "values": 0.75}
    p, tl, seen = run(a, groups, durations=dur, critic=True)
    assert p.groups["values"] == "critic"
    for k in range(6):
        v = by(tl, "values", k)
        assert v.group == "critic"
        assert by(tl, "ref_logp", k).end <= v.start and v.end <= by(tl, "logp", k).start
        if k:
            assert by(tl, "actor-train", k - 1).end <= v.start
    assert seen == {j: max(0, j - a + 1) for j in range(6)}  # versions as without a critic
    # without a critic no step has a VALUES state, and the schedule is the same as before
    p2, tl2, _ = run(a, task_groups([["logp", "actor-train", "ref_logp"], "generate"]))
    assert not by(tl2, "values")


def test_critic_beside_actor_train_by_default():
    p, tl, _ = run(1, SEPARATED, steps=3, durations={**DUR, "values": 0.75}, critic=True)
    assert p.groups["values"] == p.groups["actor-train"]
    assert all(i.group == p.groups["actor-train"] for i in by(tl, "values"))


# ------------------------------------------------------------------ CHECKPOINT, a scheduled action
SAVE = {**DUR, "checkpoint": 3.0}


@pytest.mark.parametrize("test_freq", [-1, 2])
def test_a_checkpoint_runs_on_the_trainer_group_beside_generation(test_freq):
    """save_freq=2 over 6 steps one step off: CHECKPOINT(1), (3), (5) on the trainer's group;
    GENERATE(k+2) runs while step k is saved, TRAIN(k+1) waits for the save; a validation due
    at the same step does not wait for the save, and the run ends after the last save."""
    p, tl, _ = run(2, SEPARATED, durations=SAVE, save_freq=2, test_freq=test_freq)
    saves = by(tl, "checkpoint")
    assert [i.step for i in saves] == [1, 3, 5]
    assert {i.group for i in saves} == {SEPARATED["actor-train"]}
    for c in saves:
        k = c.step
        assert c.start == by(tl, "sync", k).end  # saving starts as soon as the weights are out
        if k + 2 < 6:
            assert overlaps(by(tl, "generate", k + 2), c)
        if k + 1 < 6:
            assert by(tl, "actor-train", k + 1).start >= c.end
        if test_freq == 2:  # queued when SYNC(k) finished: it needs only the generate group
            assert by(tl, "val-generate", k).start < c.end or \
                by(tl, "val-generate", k).start == by(tl, "generate", k + 2).end
        walked = [st for st in p.steps[k].started if st not in (S.VALIDATE, S.DONE)]
        assert walked[-2:] == [S.SYNC, S.CHECKPOINT]
    if test_freq == -1:
        assert max(i.end for i in tl) == saves[-1].end
    # steps without a save never enter CHECKPOINT
    assert all(S.CHECKPOINT not in p.steps[k].started for k in (0, 2, 4))


def test_without_save_freq_no_step_is_saved_and_the_schedule_is_unchanged():
    _, plain, _ = run(2, SEPARATED)
    _, off, _ = run(2, SEPARATED, durations=SAVE, save_freq=-1)
    assert plain == off and not by(off, "checkpoint")


def test_the_last_step_is_saved_whatever_save_freq():
    p, tl, _ = run(1, COLOCATED, steps=5, durations=SAVE, save_freq=4)
    assert [i.step for i in by(tl, "checkpoint")] == [3, 4]
    assert p.checkpoint_due(4) and not p.checkpoint_due(2)


@pytest.mark.parametrize("a", [2, 3])
def test_sync_between_generations_puts_each_generate_on_one_version(a):
    """Default: SYNC(k) may land while GENERATE(k+a-1) runs (its later tokens newer). With
    the switch, no SYNC overlaps any GENERATE, each GENERATE sees one version, and training
    still overlaps generation."""
    _, free, _ = run(a, SEPARATED)
    assert any(overlaps(s, g) for s in by(free, "sync") for g in by(free, "generate"))
    p, tl, seen = run(a, SEPARATED, sync_between_generations=True)
    for s in by(tl, "sync"):
        assert not any(overlaps(s, g) for g in by(tl, "generate")), s
        if s.step + a - 1 < 6:
            assert s.start >= by(tl, "generate", s.step + a - 1).end
    assert all(seen[j] == max(0, j - a + 1) for j in range(6))
    assert any(overlaps(t, g) for t in by(tl, "actor-train") for g in by(tl, "generate"))
    assert p._reason(Action(0, S.SYNC, "x")) == \
        f"publish v1, GENERATE({a - 1}) finished (sync_between_generations)"
