"""Checkpoint names count completed steps, as verl's do (megarl/controller/checkpoint.py,
steps.py, setup.py): `save_freq: 4` over 8 steps writes global_step_4 and global_step_8, and a
resume from global_step_k trains step k+1 (1-based; 0-based index k) next. Checkpoints of an
older megarl (format <= 2, or none: named by the 0-based index of their last step, so
global_step_k after k+1 steps) still resume exactly where they left off, with a warning."""
import asyncio
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.controller import checkpoint as ckpt
from megarl.controller.machine import Pipeline
from megarl.controller.setup import _position
from megarl.controller.steps import checkpoint as checkpoint_work
from megarl.controller.steps import resume_state

ACTOR_FILES = ("actor/.metadata", "actor/common.pt", "actor/megarl_meta.json",
               "actor/__0_0.distcp")


def _actor_files(d):
    for rel in ACTOR_FILES:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(os.urandom(64))


def _state(step, *, offset, fmt=None):
    s = {"step": step, "weight_version": step, "loader": {"epoch": 0, "offset": offset},
         "rng": ckpt.rng_state(), "partial": None, "kl_coef": 0.001}
    if fmt is not None:
        s[ckpt.FORMAT_KEY] = fmt
    return s


def save_new(root, done: int):
    """As the driver saves after `done` completed steps (format 3, via commit)."""
    tmp = ckpt.begin(root, done)
    _actor_files(tmp)
    return ckpt.commit(root, done, _state(done, offset=8 * done))


def save_old(root, done: int, fmt=2):
    """As megarl saved before format 3: named by the 0-based index of the last step trained
    (done - 1), `step` the same; format 2 with a manifest, None before manifests."""
    index = done - 1
    d = ckpt.begin(root, index)
    _actor_files(d)
    state = _state(index, offset=8 * done, fmt=fmt)
    state["weight_version"] = done
    (d / ckpt.DRIVER_STATE).write_text(json.dumps(state, default=ckpt._jsonable))
    if fmt is not None:
        ckpt.write_manifest(d, index)
    os.replace(d, ckpt.step_dir(root, index))
    (root / ckpt.LATEST).write_text(str(index))
    return ckpt.step_dir(root, index)


def test_save_freq_names_directories_by_completed_steps_like_verl(tmp_path):
    """The driver's own save path: CHECKPOINT(k) of 0-based step k writes global_step_<k+1>,
    its driver state and LATEST saying k+1; save_freq counts completed steps, and the last
    step is always saved."""
    for total, freq, names in ((8, 4, [4, 8]), (40, 20, [20, 40]), (10, 4, [4, 8, 10])):
        p = Pipeline(1, total, save_freq=freq)
        assert [k + 1 for k in range(total) if p.checkpoint_due(k)] == names

    saved = []

    class Actor:
        async def save(self, path, step):
            saved.append(step)
            _actor_files(Path(path).parent)

    run = SimpleNamespace(plan=SimpleNamespace(ckpt_root=tmp_path), actor=Actor(), critic=None,
                          loader=SimpleNamespace(state_dict=lambda: {"epoch": 0, "offset": 32}),
                          loggers=SimpleNamespace(log=lambda step, m: saved.append(("log", step))))
    st = SimpleNamespace(run=run, pipeline=SimpleNamespace(records={}), kl_coef=0.002,
                         rollout=SimpleNamespace(state_dict=lambda: None),
                         cfg=SimpleNamespace(trainer=SimpleNamespace(max_actor_ckpt_to_keep=None)))
    k = 3  # the fourth step
    rec = SimpleNamespace(step=k, resume_after=resume_state(st, k))
    asyncio.run(checkpoint_work(st, rec))
    d = tmp_path / "global_step_4"
    assert ckpt.steps(tmp_path) == [4]
    assert (tmp_path / ckpt.LATEST).read_text() == "4"
    state = json.loads((d / ckpt.DRIVER_STATE).read_text())
    assert (state["step"], state["weight_version"], state[ckpt.FORMAT_KEY]) == (4, 4, 3)
    assert saved == [4, ("log", 4)]  # the actor's meta and the timing: step 4 too
    assert ckpt.completed_steps(state) == 4 and not ckpt.old_naming(state)


def test_new_checkpoint_resumes_at_its_number_without_a_warning(tmp_path, caplog):
    save_new(tmp_path, 4)
    save_new(tmp_path, 8)
    with caplog.at_level(logging.WARNING):
        rp = ckpt.resume_point(tmp_path)
    assert (rp.step, rp.completed_steps, rp.old_naming) == (8, 8, False)
    assert not caplog.records
    rp = ckpt.resume_from(ckpt.step_dir(tmp_path, 4))
    assert (rp.step, rp.completed_steps) == (4, 4)


@pytest.mark.parametrize("fmt", [2, 1, None], ids=["format-2", "format-1", "pre-manifest"])
def test_old_style_checkpoint_is_detected_and_resumes_after_the_right_step(tmp_path, caplog,
                                                                           fmt):
    d = save_old(tmp_path, 4, fmt=fmt)  # 4 steps done, named global_step_3
    assert d.name == "global_step_3"
    with caplog.at_level(logging.WARNING):
        rp = ckpt.resume_point(tmp_path)
    assert (rp.step, rp.path, rp.completed_steps, rp.old_naming) == (3, d, 4, True)
    warned = [r.getMessage() for r in caplog.records if "old-style" in r.getMessage()]
    assert len(warned) == 1
    assert str(d) in warned[0] and "holds 4 completed steps" in warned[0]
    assert "resumes after step 4" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert ckpt.resume_from(d).completed_steps == 4  # resume_from_path: the same
    assert "old-style" in caplog.text


def _cfg(total):
    return SimpleNamespace(trainer=SimpleNamespace(total_training_steps=total, total_epochs=1))


class Loader:
    steps_per_epoch = 100

    def __init__(self):
        self.loaded = None

    def load_state_dict(self, s):
        self.loaded = s


@pytest.mark.parametrize("style", ["new", "old"])
def test_resume_continues_exactly_where_the_checkpoint_left_off(tmp_path, caplog, style):
    """Either naming resumes at 0-based step 4 (1-based step 5) after 4 steps, with the
    loader and RNG state that checkpoint saved, so no prompt is trained twice or skipped."""
    (save_new if style == "new" else save_old)(tmp_path, 4)
    rp = ckpt.resume_point(tmp_path)
    loader = Loader()
    with caplog.at_level(logging.INFO):
        start, state, total = _position(_cfg(8), rp, loader, val_only=False)
    assert (start, total) == (4, 8)
    assert loader.loaded == {"epoch": 0, "offset": 32}  # where 4 steps of 8 prompts left it
    assert state is rp.state
    assert f"resuming after step 4 from {rp.path}; training continues at step 5/8" \
        in caplog.text
    # validation only: the checkpoint's weights, version 4 (v4 = after 4 steps) either way
    start, _, total = _position(_cfg(8), rp, Loader(), val_only=True)
    assert (start, total) == (4, 4)


def test_a_finished_runs_checkpoint_under_a_smaller_budget_is_refused(tmp_path):
    from megarl.config import ConfigError

    save_old(tmp_path, 8)  # global_step_7: 8 steps done
    with pytest.raises(ConfigError, match=r"this run has 6 steps, .*has trained 8"):
        _position(_cfg(6), ckpt.resume_point(tmp_path), Loader(), val_only=False)
    # exactly done: nothing left to train, not an error
    assert _position(_cfg(8), ckpt.resume_point(tmp_path), Loader(), False)[0] == 8


def test_a_run_resumed_from_an_old_checkpoint_saves_new_names_beside_it(tmp_path, caplog):
    """Old global_step_3 (4 steps), then the resumed run's global_step_6 and _8: resume takes
    the newest, retention counts them in the order they were written, and LATEST follows."""
    save_old(tmp_path, 4)
    save_new(tmp_path, 6)
    save_new(tmp_path, 8)
    with caplog.at_level(logging.WARNING):
        rp = ckpt.resume_point(tmp_path)
    assert (rp.step, rp.completed_steps) == (8, 8) and "old-style" not in caplog.text
    assert ckpt.prune(tmp_path, 2) == [3]
    assert ckpt.steps(tmp_path) == [8, 6]
    # a damaged newest one falls back across formats, to the old-style one
    save_old(tmp_path, 3)  # global_step_2 (3 steps), LATEST now names it
    (tmp_path / ckpt.LATEST).write_text("8")
    for s in (8, 6):
        (ckpt.step_dir(tmp_path, s) / "actor/common.pt").write_bytes(b"")
    rp = ckpt.resume_point(tmp_path)
    assert (rp.step, rp.completed_steps, rp.old_naming) == (2, 3, True)


@pytest.mark.parametrize("fmt,match", [
    (ckpt.FORMAT + 1, r"checkpoint_format 4 is newer than this megarl reads \(up to 3\)"),
    ("3", r"checkpoint_format '3' is not a format number"),
    (0, r"checkpoint_format 0 is not a format number")])
def test_unknown_format_counts_as_damage(tmp_path, fmt, match):
    d = save_new(tmp_path, 2)
    state = json.loads((d / ckpt.DRIVER_STATE).read_text())
    (d / ckpt.DRIVER_STATE).write_text(json.dumps({**state, ckpt.FORMAT_KEY: fmt}))
    ckpt.write_manifest(d, 2)
    with pytest.raises(ValueError, match=match):
        ckpt.verify(d)
