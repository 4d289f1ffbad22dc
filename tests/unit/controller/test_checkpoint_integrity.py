"""Checkpoint manifests, verification, resume fallback and retention (megarl/controller/
checkpoint.py) on step directories with the file kinds a training checkpoint holds."""
import json
import logging
import os
import shutil

import pytest

from megarl.config import ConfigError
from megarl.controller import checkpoint as ckpt

# The file kinds of a training checkpoint (relative to the step dir), with made-up contents.
ACTOR_FILES = {"actor/__0_0.distcp": 20_000, "actor/__0_1.distcp": 20_000,
               "actor/.metadata": 3_000, "actor/common.pt": 1_500,
               "actor/megarl_meta.json": 200, "actor/optim/rank_00000.pt": 9_000,
               "actor/hf/config.json": 300}


def save(root, step, legacy=False):
    """Write step `step` the way the driver does: actor files into the temp dir, then commit."""
    tmp = ckpt.begin(root, step)
    for rel, size in ACTOR_FILES.items():
        f = tmp / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(os.urandom(size))
    state = {"step": step, "loader": {"epoch": 0, "offset": 8 * (step + 1)},
             "rng": {"python": step}}
    if not legacy:
        return ckpt.commit(root, step, state)
    # as checkpoints were written before manifests: driver state only, no format key
    (tmp / ckpt.DRIVER_STATE).write_text(json.dumps(state))
    os.replace(tmp, ckpt.step_dir(root, step))
    (root / ckpt.LATEST).write_text(str(step))
    return ckpt.step_dir(root, step)


def truncate(f):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def flip(f, at=None, n=64):
    data = bytearray(f.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    f.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_size_and_checksum(tmp_path):
    d = save(tmp_path, 3)
    m = json.loads((d / ckpt.MANIFEST).read_text())
    assert m["step"] == 3 and m["checksum"] == "crc32"
    assert set(m["files"]) == {*ACTOR_FILES, ckpt.DRIVER_STATE}  # not itself
    for rel, entry in m["files"].items():
        assert entry["size"] == (d / rel).stat().st_size
    assert ckpt.verify(d)["step"] == 3
    # the driver state records that the checkpoint has a manifest
    assert json.loads((d / ckpt.DRIVER_STATE).read_text())[ckpt.FORMAT_KEY] == ckpt.FORMAT
    assert not list(tmp_path.glob(".*.tmp")), "the temp dir was renamed into place"


def test_flipped_bytes_are_found_by_checksum(tmp_path):
    d = save(tmp_path, 1)
    flip(d / "actor/__0_1.distcp")
    with pytest.raises(ValueError, match=r"__0_1\.distcp: checksum .*damaged contents"):
        ckpt.verify(d)


@pytest.mark.parametrize("rel", ["actor/__0_0.distcp", "actor/.metadata", "actor/common.pt",
                                 "actor/optim/rank_00000.pt", ckpt.DRIVER_STATE])
def test_each_truncated_file_kind_is_named(tmp_path, rel):
    d = save(tmp_path, 1)
    truncate(d / rel)
    with pytest.raises(ValueError, match=f"{rel}: .* bytes, manifest.json says .*truncated"):
        ckpt.verify(d)


@pytest.mark.parametrize("rel,match", [
    (ckpt.MANIFEST, r"manifest\.json: missing \(the checkpoint was written with one\)"),
    (ckpt.DRIVER_STATE, r"driver_state\.json: missing \(listed in manifest\.json\)"),
    ("actor/common.pt", r"common\.pt: missing \(listed in manifest\.json\)")])
def test_missing_files_are_named(tmp_path, rel, match):
    d = save(tmp_path, 1)
    (d / rel).unlink()
    with pytest.raises(ValueError, match=match):
        ckpt.verify(d)


def test_half_written_manifest_is_named(tmp_path):
    d = save(tmp_path, 1)
    truncate(d / ckpt.MANIFEST)
    with pytest.raises(ValueError, match=r"manifest\.json: unreadable checkpoint manifest"):
        ckpt.verify(d)


def test_pre_manifest_checkpoint_is_used_with_a_warning(tmp_path, caplog):
    d = save(tmp_path, 2, legacy=True)
    with caplog.at_level(logging.WARNING):
        assert ckpt.verify(d)["step"] == 2
    assert "written before checkpoints had manifests" in caplog.text
    # its structure is still checked, and a half-written driver state is named
    (d / "actor/common.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"common\.pt: missing or empty"):
        ckpt.verify(d)
    d = save(tmp_path, 3, legacy=True)
    truncate(d / ckpt.DRIVER_STATE)
    with pytest.raises(ValueError, match=r"driver_state\.json: unreadable driver state"):
        ckpt.verify(d)


def test_resume_falls_back_to_the_newest_good_checkpoint(tmp_path, caplog):
    for s in (1, 3, 5):
        save(tmp_path, s)
    flip(ckpt.step_dir(tmp_path, 5) / "actor/__0_0.distcp")
    truncate(ckpt.step_dir(tmp_path, 3) / "actor/.metadata")
    with caplog.at_level(logging.WARNING):
        got = ckpt.resume_point(tmp_path)
    assert (got.step, got.path) == (1, ckpt.step_dir(tmp_path, 1))
    assert got.state["loader"] == {"epoch": 0, "offset": 16}
    fallback = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
    assert len(fallback) == 1
    # names the damaged checkpoint, its file, and the one used instead
    assert "global_step_5" in fallback[0] and "__0_0.distcp" in fallback[0]
    assert str(ckpt.step_dir(tmp_path, 1)) in fallback[0]
    assert ".metadata" in caplog.text  # step 3's damage is logged too


def test_undamaged_latest_is_used_without_warnings(tmp_path, caplog):
    for s in (1, 3):
        save(tmp_path, s)
    with caplog.at_level(logging.WARNING):
        assert ckpt.resume_point(tmp_path).step == 3
    assert not caplog.records
    assert ckpt.resume_point(tmp_path / "absent") is None


@pytest.mark.parametrize("text", ["three", "", "3.5", "\xff"])
def test_unreadable_latest_file_is_named_and_the_step_dirs_are_used(tmp_path, caplog, text):
    for s in (1, 3):
        save(tmp_path, s)
    (tmp_path / ckpt.LATEST).write_text(text, encoding="latin-1")
    with caplog.at_level(logging.WARNING):
        assert ckpt.resume_point(tmp_path).step == 3
    assert f"{tmp_path / ckpt.LATEST}: not a step number" in caplog.text


def test_latest_is_the_commit_point(tmp_path):
    """A step dir newer than LATEST (killed between the rename and LATEST) is not used, and a
    missing LATEST with step dirs present still resumes (it was killed before the first one)."""
    for s in (1, 3):
        save(tmp_path, s)
    (tmp_path / ckpt.LATEST).write_text("1")
    assert ckpt.resume_point(tmp_path).step == 1
    (tmp_path / ckpt.LATEST).unlink()
    assert ckpt.resume_point(tmp_path).step == 3


def test_driver_state_of_another_step_is_refused(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 3)
    # intact files (the manifest verifies) under another step's name
    os.replace(ckpt.step_dir(tmp_path, 3), ckpt.step_dir(tmp_path, 4))
    (tmp_path / ckpt.LATEST).write_text("4")
    assert ckpt.resume_point(tmp_path).step == 1


def test_no_good_checkpoint_is_a_config_error_naming_the_file(tmp_path):
    save(tmp_path, 1)
    (ckpt.step_dir(tmp_path, 1) / ckpt.DRIVER_STATE).unlink()
    with pytest.raises(ConfigError, match=r"no usable checkpoint .*driver_state\.json: missing"
                                          r".*resume_mode=disable"):
        ckpt.resume_point(tmp_path)


def test_resume_from_path_verifies_and_does_not_fall_back(tmp_path):
    save(tmp_path, 1)
    d = save(tmp_path, 3)
    assert ckpt.resume_from(d).step == 3
    truncate(d / "actor/common.pt")
    with pytest.raises(ConfigError, match=r"trainer\.resume_from_path: .*common\.pt: "):
        ckpt.resume_from(d)
    with pytest.raises(ConfigError, match=r"trainer\.resume_from_path: .*nope: not a dir"):
        ckpt.resume_from(tmp_path / "nope")


def test_retention_keeps_the_newest_n(tmp_path):
    for s in (0, 1, 2, 3):
        save(tmp_path, s)
    assert ckpt.prune(tmp_path, 2) == [1, 0]
    assert ckpt.steps(tmp_path) == [3, 2]
    # through commit, as the driver calls it
    d = ckpt.begin(tmp_path, 4)
    (d / "actor").mkdir()
    (d / "actor/.metadata").write_bytes(b"m")
    ckpt.commit(tmp_path, 4, {"step": 4, "loader": {}, "rng": {}}, keep=2)
    assert ckpt.steps(tmp_path) == [4, 3]


def test_retention_never_deletes_the_last_good_checkpoint(tmp_path, caplog):
    for s in (0, 1, 2):
        save(tmp_path, s)
    flip(ckpt.step_dir(tmp_path, 2) / "actor/optim/rank_00000.pt")
    with caplog.at_level(logging.WARNING):
        assert ckpt.prune(tmp_path, 1) == [0]
    assert ckpt.steps(tmp_path) == [2, 1]
    assert "keeping" in caplog.text and "global_step_1" in caplog.text
    # and resume then finds it
    assert ckpt.resume_point(tmp_path).step == 1


def test_latest_naming_a_missing_step_dir_falls_back_or_refuses(tmp_path, caplog):
    save(tmp_path, 1)
    (tmp_path / ckpt.LATEST).write_text("7")
    with caplog.at_level(logging.WARNING):
        assert ckpt.resume_point(tmp_path).step == 1
    assert f"{ckpt.step_dir(tmp_path, 7)}: does not exist" in caplog.text
    shutil.rmtree(ckpt.step_dir(tmp_path, 1))
    with pytest.raises(ConfigError, match=r"global_step_7.*does not exist"):
        ckpt.resume_point(tmp_path)
