"""Checkpoint names end to end (real Ray, Megatron, embedded engine): a run names its
checkpoints by completed steps as verl does, and a checkpoint that an older megarl wrote
(named by the 0-based index of its last step, checkpoint format 2) still resumes exactly where
it left off.

The finished run is conftest.py's `undamaged` (shared with test_checkpoint_fallback.py), so
this module adds one resumed run. The kill -9 / resume case with the new names is
test_torchrun_launch.py::test_a_trainer_rank_killed_twice_restarts_the_run_which_trains_exactly.
"""
import json
import os
import shutil

from test_train_e2e import _args, fresh_loader, megarl, trained

from megarl.controller import checkpoint as ckpt

TOTAL, SAVE_FREQ = 4, 2  # the `undamaged` run's
EXTRA = [f"trainer.total_training_steps={TOTAL}", f"trainer.save_freq={SAVE_FREQ}",
         "trainer.test_freq=-1", "trainer.val_before_train=False"]


def make_old_style(root, done: int):
    """Rewrite global_step_<done> as megarl wrote it before checkpoint format 3: named
    global_step_<done-1>, its driver state's `step` done-1, format 2, LATEST done-1. The
    weights, loader position and RNG state are untouched."""
    d = ckpt.step_dir(root, done)
    state = json.loads((d / ckpt.DRIVER_STATE).read_text())
    state.update({"step": done - 1, ckpt.FORMAT_KEY: 2})
    (d / ckpt.DRIVER_STATE).write_text(json.dumps(state))
    ckpt.write_manifest(d, done - 1)
    os.replace(d, ckpt.step_dir(root, done - 1))
    (root / ckpt.LATEST).write_text(str(done - 1))
    return ckpt.step_dir(root, done - 1)


def test_names_count_completed_steps_and_an_old_style_checkpoint_resumes(quickstart_assets,
                                                                         undamaged, tmp_path):
    done = undamaged / "megarl" / "t"
    # save_freq 2 over 4 steps: global_step_2 and global_step_4, as the log counts steps
    assert ckpt.steps(done) == [TOTAL, SAVE_FREQ]
    assert (done / ckpt.LATEST).read_text() == str(TOTAL)
    for k in (SAVE_FREQ, TOTAL):
        state = json.loads((ckpt.step_dir(done, k) / ckpt.DRIVER_STATE).read_text())
        assert (state["step"], state["weight_version"], state[ckpt.FORMAT_KEY]) == (k, k, 3)
    first = trained(undamaged)

    # the same run as an older megarl left it when killed after 2 steps: global_step_1
    shutil.copytree(undamaged / "megarl", tmp_path / "megarl")
    root = tmp_path / "megarl" / "t"
    shutil.rmtree(ckpt.step_dir(root, TOTAL))
    old = make_old_style(root, SAVE_FREQ)
    before = len((root / "trained_prompts.jsonl").read_text().splitlines())
    out = megarl("train", _args(quickstart_assets, tmp_path, *EXTRA))
    assert f"{old}: an old-style checkpoint (format 2)" in out
    assert f"resuming after step {SAVE_FREQ} from {old}; training continues at step " \
           f"{SAVE_FREQ + 1}/{TOTAL}" in out
    assert f"checkpoint after step {TOTAL} saved to {ckpt.step_dir(root, TOTAL)}" in out
    assert f"step {TOTAL}/{TOTAL}" in out
    # it trained the steps after the checkpoint's (0-based 2 and 3), once, on the batches an
    # uninterrupted run drew
    records = (root / "trained_prompts.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records[before:]] == list(range(SAVE_FREQ, TOTAL))
    steps = trained(tmp_path)
    assert steps == first
    loader = fresh_loader(quickstart_assets)
    assert all(steps[k] == sorted(p.uid for p in loader.next_batch()) for k in range(TOTAL))
    # what it saved is named the new way, beside the old one
    assert ckpt.steps(root) == [TOTAL, SAVE_FREQ - 1]
    assert (root / ckpt.LATEST).read_text() == str(TOTAL)
    assert not ckpt.resume_point(root).old_naming
