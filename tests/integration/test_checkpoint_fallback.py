"""Damaged checkpoints of a real training run: found before training, named, and the run
resumes from the newest good one with the same per-step batches as an undamaged run.

One `megarl train` run (real Ray, Megatron, embedded engine) saves checkpoints after 2 and 4
steps (global_step_2, global_step_4). Each damage kind is applied to a copy of its run
directory and checked at selection (what `megarl train` does before data, models or Ray are
loaded); flipped bytes in a weight file also resume end to end, and a run left with no good
checkpoint stops with exit 2.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import ROOT
from test_train_e2e import _args, fresh_loader, megarl, trained

from megarl.controller import checkpoint as ckpt

# the `undamaged` run's (conftest.py, a session fixture shared with test_checkpoint_naming_e2e.py),
# which the copies resume with
EXTRA = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1",
         "trainer.val_before_train=False"]
LAST, GOOD = 4, 2  # the checkpoints the run saves: after 2 and 4 completed steps


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src / "megarl", dst / "megarl")
    return dst / "megarl" / "t"


def flip(f: Path, n=4096):
    data = bytearray(f.read_bytes())
    at = len(data) // 2
    data[at:at + n] = bytes(b ^ 0x5A for b in data[at:at + n])
    f.write_bytes(bytes(data))


def truncate(f: Path):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


# damage kind -> (what it does to the latest step dir, the file the message must name)
DAMAGE = {
    "distcp-flipped": (lambda d: flip(d / "actor/__0_0.distcp"), "__0_0.distcp: checksum"),
    "distcp-truncated": (lambda d: truncate(d / "actor/__0_1.distcp"), "__0_1.distcp: "),
    "metadata-truncated": (lambda d: truncate(d / "actor/.metadata"), ".metadata: "),
    "optimizer-truncated": (lambda d: truncate(d / "actor/optim/rank_00000.pt"),
                            "rank_00000.pt: "),
    "common-truncated": (lambda d: truncate(d / "actor/common.pt"), "common.pt: "),
    "driver-state-half-written": (lambda d: truncate(d / "driver_state.json"),
                                  "driver_state.json: "),
    "driver-state-missing": (lambda d: (d / "driver_state.json").unlink(),
                             "driver_state.json: missing"),
    "manifest-missing": (lambda d: (d / "manifest.json").unlink(), "manifest.json: missing"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_named_and_the_previous_checkpoint_chosen(undamaged, tmp_path, caplog, kind):
    root = copy_run(undamaged, tmp_path)
    damage, names = DAMAGE[kind]
    damage(ckpt.step_dir(root, LAST))
    got = ckpt.resume_point(root)
    assert (got.step, got.path) == (GOOD, ckpt.step_dir(root, GOOD))
    warning = next(r.getMessage() for r in caplog.records if "resuming from" in r.getMessage())
    assert f"{ckpt.step_dir(root, LAST)} is damaged" in warning and names in warning
    assert f"resuming from {ckpt.step_dir(root, GOOD)}" in warning


def test_non_number_in_latest_file_is_named_and_the_newest_good_one_used(undamaged, tmp_path,
                                                                         caplog):
    root = copy_run(undamaged, tmp_path)
    (root / ckpt.LATEST).write_text("step three\n")
    assert ckpt.resume_point(root).step == LAST
    assert f"{root / ckpt.LATEST}: not a step number" in caplog.text
    # with the newest also damaged, the walk goes on to the previous one
    flip(ckpt.step_dir(root, LAST) / "actor/__0_1.distcp")
    assert ckpt.resume_point(root).step == GOOD


def resume_after_damage(assets, undamaged, tmp_path, damage) -> str:
    root = copy_run(undamaged, tmp_path)
    damage(ckpt.step_dir(root, LAST))
    return megarl("train", _args(assets, tmp_path, *EXTRA))


def test_resume_from_the_previous_checkpoint_trains_the_undamaged_batches(
        quickstart_assets, undamaged, tmp_path):
    """End to end for the kind the selection tests share: the rest differ only in the file."""
    kind = "distcp-flipped"
    out = resume_after_damage(quickstart_assets, undamaged, tmp_path, DAMAGE[kind][0])
    root = tmp_path / "megarl" / "t"
    lines = out.splitlines()
    warned = next(i for i, line in enumerate(lines) if "resuming from" in line)
    assert DAMAGE[kind][1] in lines[warned]
    # found before the data, models or Ray were loaded
    first_ray = next(i for i, line in enumerate(lines) if "megarl.cluster.placement" in line)
    first_data = next(i for i, line in enumerate(lines) if "megarl.data.dataset" in line)
    assert warned < first_data < first_ray
    # global_step_2 holds 2 completed steps: the run goes on at step 3 (0-based index 2)
    assert f"resuming after step {GOOD} " in out
    assert f"training continues at step {GOOD + 1}/4" in out
    # the audit trail holds the retrained steps twice; the last record of each step counts
    records = (root / "trained_prompts.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records[4:]] == list(range(GOOD, LAST))
    steps = trained(tmp_path)
    assert steps == trained(undamaged)
    loader = fresh_loader(quickstart_assets)
    assert all(steps[k] == sorted(p.uid for p in loader.next_batch()) for k in range(4))
    # the damaged checkpoint was written again, whole
    assert ckpt.resume_point(root).step == LAST


def test_no_good_checkpoint_stops_before_anything_starts(quickstart_assets, undamaged,
                                                         tmp_path):
    root = copy_run(undamaged, tmp_path)
    truncate(ckpt.step_dir(root, LAST) / "actor/common.pt")
    (ckpt.step_dir(root, GOOD) / "manifest.json").unlink()
    p = subprocess.run([sys.executable, "-m", "megarl.cli", "train",
                        *_args(quickstart_assets, tmp_path, *EXTRA)],
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "megarl.data.dataset" not in p.stderr
    assert "megarl.cluster" not in p.stderr  # no worker, no Ray
    assert "no usable checkpoint" in p.stderr and "common.pt: " in p.stderr
