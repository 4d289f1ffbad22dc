"""Run checkpoints: `<default_local_dir>/global_step_<k>/`, the state after k completed
training steps (verl's convention: `save_freq: 20` over 40 steps writes global_step_20 and
global_step_40; resuming from global_step_k runs steps k+1.. in 1-based terms, 0-based step
index k on), holding the actor's Megatron dist-checkpoint (model + per-rank optimizer state),
the critic's beside it (`critic/`, gae runs only), `driver_state.json` (step, weight version,
dataloader position, RNG) and `manifest.json` (every file's size and CRC32).

Writing: a step directory is filled under a temp name; once every rank's files are complete
(the driver commits only after the actor group's save has returned on all ranks) the driver
state and then the manifest are written, the directory is renamed into place, and
`latest_checkpointed_iteration.txt` (the verl convention) is replaced atomically after it. A
run killed mid-save therefore resumes from the previous complete checkpoint.

Naming: checkpoint format 3 (`checkpoint_format` in driver_state.json) names a directory,
its `step` and `latest_checkpointed_iteration.txt` by completed steps. Formats <= 2 (and
checkpoints without the key, which predate manifests) used the 0-based index of the last
step trained: their global_step_k holds k+1 completed steps. Both are read; `completed_steps`
gives the number a resume continues after, whatever the format, and an old-style one is used
with a warning.

Resuming: `resume_point` verifies the checkpoint it picks against its manifest before any
worker or Ray starts; a damaged one is named (which file, what is wrong) and the newest good
one older than it is used instead. Checkpoints written before manifests existed are used with a
warning after a structural check (see docs/checkpoints.md). Retention (`prune`) never deletes
the newest checkpoint that verifies.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from megarl.config import ConfigError

logger = logging.getLogger(__name__)

LATEST = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
DRIVER_STATE = "driver_state.json"
MANIFEST_FORMAT = "megarl-checkpoint-manifest-v1"
# Written into driver_state.json by `commit`: a checkpoint that says it has a manifest but has
# none is damaged, one without the key predates manifests. Format 3 names directories by
# completed steps (global_step_k after k steps, as verl); formats <= 2 (and none) by the
# 0-based index of the last step trained (global_step_k after k+1 steps).
FORMAT_KEY = "checkpoint_format"
FORMAT = 3
OLD_NAMING_FORMAT = 2  # the newest format that names by 0-based step index
# Files every training checkpoint has, whatever its layout: checked on pre-manifest ones.
_REQUIRED = ("actor/.metadata", "actor/common.pt", "actor/megarl_meta.json")
_STEP_DIR = re.compile(r"global_step_(\d+)")
_CHUNK = 8 << 20


def step_dir(root, step: int) -> Path:
    """The directory of checkpoint `step`: the number in its name (completed steps for a
    format-3 checkpoint, the 0-based index of its last step for an older one)."""
    return Path(root) / f"global_step_{step}"


def checkpoint_format(state: dict) -> int | None:
    """The format a driver state was written in; None before manifests (format 1)."""
    return state.get(FORMAT_KEY)


def old_naming(state: dict) -> bool:
    """Whether the checkpoint is named by the 0-based index of its last step (megarl before
    format 3): its global_step_k holds k+1 completed steps."""
    fmt = checkpoint_format(state)
    return fmt is None or fmt <= OLD_NAMING_FORMAT


def completed_steps(state: dict) -> int:
    """Training steps done when the checkpoint was written, whatever its format: a resume
    runs 0-based step index `completed_steps` next (1-based step completed_steps + 1)."""
    return state["step"] + 1 if old_naming(state) else state["step"]


def tmp_dir(root, step: int) -> Path:
    return Path(root) / f".global_step_{step}.tmp"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def write_json_atomic(path: Path, obj) -> None:
    """`obj` as JSON at `path`, via a temp file and a rename: a reader never sees half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=_jsonable)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _jsonable(o):
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (np.integer,)):
        return int(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")


# ------------------------------------------------------------------ manifest
def _crc32(path: Path) -> str:
    # CRC32 because the manifest guards against accidental damage (truncation, flipped or
    # zeroed blocks), not tampering: it catches every burst error up to 32 bits and misses
    # random damage with odds 2**-32, and zlib's is the fastest checksum in the standard
    # library (3.3 GB/s here against 1.4 for sha256 and 0.7 for blake2b). Checkpoints of
    # large models are tens of GB and are read whole on every save and resume. zlib releases
    # the GIL on large buffers, so `_checksums` hashes files in parallel threads.
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _checksums(d: Path, rels: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(rels, pool.map(lambda r: _crc32(d / r), rels)))


def _files(d: Path) -> list[str]:
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def write_manifest(d, step: int) -> dict:
    """Record every file under `d` (its size and CRC32) in `d/manifest.json`. Call it last,
    once nothing else will be written into `d`."""
    d = Path(d)
    rels = _files(d)
    crcs = _checksums(d, rels)
    manifest = {"format": MANIFEST_FORMAT, "step": step, "checksum": "crc32",
                "files": {r: {"size": (d / r).stat().st_size, "crc32": crcs[r]} for r in rels}}
    write_json_atomic(d / MANIFEST, manifest)
    return manifest


def _read_json(path: Path, what: str):
    """The parsed file, or a ValueError naming it (missing, half-written, not JSON)."""
    if not path.is_file():
        raise ValueError(f"{path}: missing ({what})")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: unreadable {what} (half-written?): {err}") from None


def _check_manifest(d: Path) -> None:
    m = _read_json(d / MANIFEST, "checkpoint manifest")
    files = m.get("files") if isinstance(m, dict) else None
    if not isinstance(files, dict) or m.get("format") != MANIFEST_FORMAT or not all(
            isinstance(w, dict) and isinstance(w.get("size"), int)
            and isinstance(w.get("crc32"), str) for w in files.values()):
        raise ValueError(f"{d / MANIFEST}: not a {MANIFEST_FORMAT} manifest")
    for rel, want in files.items():
        f = d / rel
        if not f.is_file():
            raise ValueError(f"{f}: missing (listed in {MANIFEST})")
        size = f.stat().st_size
        if size != want["size"]:
            raise ValueError(f"{f}: {size} bytes, {MANIFEST} says {want['size']} (truncated "
                             "or overwritten)")
    # Sizes first (cheap, and catch truncation); checksums only once every size matches.
    got = _checksums(d, list(files))
    for rel, want in files.items():
        if got[rel] != want["crc32"]:
            raise ValueError(f"{d / rel}: checksum {got[rel]} differs from {MANIFEST}'s "
                             f"{want['crc32']} (damaged contents)")


def _check_legacy(d: Path) -> None:
    for rel in _REQUIRED:
        f = d / rel
        if not f.is_file() or f.stat().st_size == 0:
            raise ValueError(f"{f}: missing or empty")
    logger.warning("%s: written before checkpoints had manifests; only its structure is "
                   "checked, not its sizes or checksums", d)


def _check_state(d: Path, state) -> None:
    if not isinstance(state, dict) or not {"step", "loader", "rng"} <= state.keys():
        raise ValueError(f"{d / DRIVER_STATE}: not a driver state (needs step, loader, rng)")
    if type(state["step"]) is not int or state["step"] < 0:
        raise ValueError(f"{d / DRIVER_STATE}: step {state['step']!r} is not an integer >= 0")
    fmt = state.get(FORMAT_KEY)
    if fmt is not None and (type(fmt) is not int or fmt < 1):
        raise ValueError(f"{d / DRIVER_STATE}: {FORMAT_KEY} {fmt!r} is not a format number")
    if fmt is not None and fmt > FORMAT:
        raise ValueError(f"{d / DRIVER_STATE}: {FORMAT_KEY} {fmt} is newer than this megarl "
                         f"reads (up to {FORMAT}); resume it with the megarl that wrote it")


def verify(d) -> dict:
    """Check step directory `d`; return its driver state. Raises ValueError with one line
    naming the damaged file. With a manifest every listed file's size and checksum must
    match; without one the checkpoint must predate manifests (its driver state says so)."""
    d = Path(d)
    if not d.is_dir():
        raise ValueError(f"{d}: not a directory")
    state_file, has_manifest = d / DRIVER_STATE, (d / MANIFEST).is_file()
    if has_manifest:
        _check_manifest(d)
    state = _read_json(state_file, "driver state")
    _check_state(d, state)
    if not has_manifest:
        if state.get(FORMAT_KEY) is not None:
            raise ValueError(f"{d / MANIFEST}: missing (the checkpoint was written with one)")
        _check_legacy(d)
    elif not (d / "actor" / ".metadata").is_file():
        raise ValueError(f"{d / 'actor' / '.metadata'}: missing (not a training checkpoint)")
    return state


# ------------------------------------------------------------------ save
def begin(root, step: int) -> Path:
    """A fresh temp directory for step `step`'s checkpoint."""
    tmp = tmp_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(root, step: int, driver_state: dict, keep: int | None = None) -> Path:
    """Write the driver state and then the manifest into the temp dir, rename it into place,
    point LATEST at it, then apply retention (`keep` newest; None keeps all). `step` is the
    number of completed training steps (global_step_<step>; driver_state's `step` says the
    same). Every rank's actor files must be complete: call it after the group's save has
    returned."""
    root = Path(root)
    tmp = tmp_dir(root, step)
    write_json_atomic(tmp / DRIVER_STATE, {**driver_state, FORMAT_KEY: FORMAT})
    write_manifest(tmp, step)
    dst = step_dir(root, step)
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    latest = root / LATEST
    ltmp = root / f".{LATEST}.tmp"
    ltmp.write_text(str(step))
    os.replace(ltmp, latest)
    logger.info("checkpoint after step %d saved to %s", step, dst)
    if keep:
        prune(root, keep)
    return dst


def steps(root) -> list[int]:
    """Steps with a (renamed, so once complete) step directory under `root`, newest first.
    The numbers in the names: where a run resumed from an old-style checkpoint (global_step_k
    after k+1 steps) wrote new ones beside it, the new ones are named k+2 and up, so the
    order by name is still the order in which they were written."""
    root = Path(root)
    found = [int(m.group(1)) for p in root.iterdir() if p.is_dir()
             and (m := _STEP_DIR.fullmatch(p.name))] if root.is_dir() else []
    return sorted(found, reverse=True)


def prune(root, keep: int) -> list[int]:
    """Delete step directories beyond the newest `keep`, except the newest one that verifies:
    when every kept one is damaged, the last good checkpoint stays. Returns the deleted steps."""
    root = Path(root)
    all_steps = steps(root)
    kept = set(all_steps[:keep])
    for s in all_steps:  # newest first: usually the one just written, still in page cache
        try:
            verify(step_dir(root, s))
        except (ValueError, OSError) as err:
            logger.warning("retention: %s", err)
            continue
        if s not in kept:
            logger.warning("retention: the %d newest checkpoints are damaged; keeping %s, the "
                           "newest good one", keep, step_dir(root, s))
        kept.add(s)
        break
    gone = [s for s in all_steps if s not in kept]
    for s in gone:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)
        logger.info("retention: deleted %s (trainer.max_actor_ckpt_to_keep=%d)",
                    step_dir(root, s), keep)
    return gone


# ------------------------------------------------------------------ resume
@dataclasses.dataclass
class ResumePoint:
    step: int     # the number in the directory's name (global_step_<step>)
    path: Path
    state: dict   # its driver_state.json

    @property
    def completed_steps(self) -> int:
        """Training steps done: the resumed run starts at this 0-based step index (1-based
        step completed_steps + 1), whatever the checkpoint's naming."""
        return completed_steps(self.state)

    @property
    def old_naming(self) -> bool:
        return old_naming(self.state)


def _found(s: int, d: Path, state: dict) -> ResumePoint:
    """The ResumePoint of checkpoint `d`; an old-style one (named by 0-based step index) with
    a warning saying what it holds."""
    rp = ResumePoint(s, d, state)
    if rp.old_naming:
        logger.warning("%s: an old-style checkpoint (format %s), named by the 0-based index of "
                       "its last step: it holds %d completed steps, so training resumes after "
                       "step %d (1-based). New checkpoints are named by completed steps "
                       "(global_step_<k> after k steps, as verl)", d,
                       checkpoint_format(state) or 1, rp.completed_steps, rp.completed_steps)
    return rp


def _latest_step(root: Path) -> int | None:
    """The step LATEST names; None (with a warning naming the file) when it is unreadable."""
    f = root / LATEST
    try:
        text = f.read_text().strip()
        return int(text)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError):
        logger.warning("%s: not a step number; looking for the newest good checkpoint among "
                       "the step directories instead", f)
        return None


def resume_point(root) -> ResumePoint | None:
    """The newest checkpoint under `root` that verifies, or None when there is none at all.

    Starts at the step LATEST names (or, when it is missing or unreadable, the newest step
    directory) and walks back; one warning names each damaged checkpoint, the file that is
    wrong in it, and the checkpoint used instead. Raises ConfigError when checkpoints exist
    (or LATEST names one) but none is good: starting over silently would overwrite them."""
    root = Path(root)
    named = _latest_step(root)
    candidates = [s for s in steps(root) if named is None or s <= named]
    damaged: list[tuple[Path, str]] = []
    if named is not None and named not in candidates:
        d = step_dir(root, named)
        damaged.append((d, f"{d}: does not exist ({root / LATEST} names it)"))
    for s in candidates:
        d = step_dir(root, s)
        try:
            state = verify(d)
            if state["step"] != s:
                raise ValueError(f"{d / DRIVER_STATE}: says step {state['step']}, the "
                                 f"directory is step {s}")
        except (ValueError, OSError) as err:
            damaged.append((d, str(err)))
            continue
        if damaged:
            logger.warning("%s; resuming from %s, the newest good checkpoint, instead",
                           "; ".join(f"checkpoint {p} is damaged: {e}" for p, e in damaged), d)
        return _found(s, d, state)
    if damaged:
        raise ConfigError(f"{root}: no usable checkpoint to resume from ({len(damaged)} "
                          f"damaged; the newest: {damaged[0][1]}). Set "
                          "trainer.resume_mode=disable or another trainer.experiment_name to "
                          "start over")
    return None


def resume_from(path) -> ResumePoint:
    """The checkpoint `trainer.resume_from_path` names, verified; no fallback (it was chosen)."""
    d = Path(path)
    try:
        state = verify(d)
    except (ValueError, OSError) as err:
        raise ConfigError(f"trainer.resume_from_path: {err}") from None
    return _found(state["step"], d, state)
