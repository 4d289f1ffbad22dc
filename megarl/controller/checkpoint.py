"""Run checkpoints: `<default_local_dir>/global_step_<k>/` holding the actor's Megatron
dist-checkpoint (model + per-rank optimizer state) and `driver_state.json` (step, weight
version, dataloader position, RNG). A step directory is written under a temp name and renamed
when complete; `latest_checkpointed_iteration.txt` (the verl convention) is replaced
atomically after it, so a run killed mid-save resumes from the previous complete checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

LATEST = "latest_checkpointed_iteration.txt"


def step_dir(root, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


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


def _write_json_atomic(path: Path, obj) -> None:
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


def begin(root, step: int) -> Path:
    """A fresh temp directory for step `step`'s checkpoint."""
    tmp = tmp_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(root, step: int, driver_state: dict) -> Path:
    """Write the driver state into the temp dir, rename it into place, then point LATEST."""
    root = Path(root)
    tmp = tmp_dir(root, step)
    _write_json_atomic(tmp / "driver_state.json", driver_state)
    dst = step_dir(root, step)
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    latest = root / LATEST
    ltmp = root / f".{LATEST}.tmp"
    ltmp.write_text(str(step))
    os.replace(ltmp, latest)
    logger.info("checkpoint of step %d saved to %s", step, dst)
    return dst


def latest(root) -> tuple[int, Path] | None:
    """The newest complete checkpoint under `root`, or None."""
    root = Path(root)
    f = root / LATEST
    if not f.is_file():
        return None
    step = int(f.read_text().strip())
    d = step_dir(root, step)
    if not (d / "driver_state.json").is_file():
        raise FileNotFoundError(f"{f} names step {step} but {d} is incomplete")
    return step, d


def read_driver_state(d) -> dict:
    with open(Path(d) / "driver_state.json") as f:
        return json.load(f)
