"""The quickstart's synthetic task: small additions, written as verl-convention jsonl.

Nothing can be downloaded where megarl is developed, so the quickstart makes its own data.
The task is chosen so that a randomly initialised 2-layer model learns *something* visible
in a few dozen GRPO steps: "What is A + B?" with single-digit operands (every digit is one
token of the tiny tokenizer, answers are one or two tokens), scored by the shaped reward of
``megarl.reward.quickstart`` (see there for the tiers). Validation pairs are disjoint from
training pairs while there are pairs left to keep apart.

A second task, ``last_digit``, is the one a random 2-layer model solves outright with RL (see
``configs/quickstart_solve.yaml``): "Repeat the last digit: 4 3 9" -> "9", scored by
``megarl.reward.last_digit`` (exact answer and a stop token). Its validation prompts are
never among the training prompts.
"""
from __future__ import annotations

import json
import logging
import os
import random
import tempfile
from pathlib import Path

from megarl.reward import last_digit, tool_lookup
from megarl.reward.quickstart import DATA_SOURCE

logger = logging.getLogger(__name__)


def _row(a: int, b: int, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def _write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    # Temp file in the same directory + rename: a crash never leaves a half-written file
    # that a later run would take for a finished one.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def quickstart_rows(n_train: int, n_val: int, seed: int = 0,
                    max_operand: int = 9) -> tuple[list[dict], list[dict]]:
    """(train rows, val rows); deterministic in ``seed``."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    rng.shuffle(pairs)
    # Keep validation pairs out of training, unless that would leave training nothing.
    n_held = min(n_val, len(pairs) - 1)
    val_pairs = [pairs[i % len(pairs)] for i in range(n_val)]
    train_pool = pairs[n_held:]
    train_pairs: list[tuple[int, int]] = []
    while len(train_pairs) < n_train:
        rng.shuffle(train_pool)
        train_pairs.extend(train_pool[: n_train - len(train_pairs)])
    train = [_row(a, b, "train", i) for i, (a, b) in enumerate(train_pairs)]
    val = [_row(a, b, "val", i) for i, (a, b) in enumerate(val_pairs)]
    return train, val


def last_digit_rows(n_train: int, n_val: int, seed: int = 0,
                    n_digits: int = 3) -> tuple[list[dict], list[dict]]:
    """(train rows, val rows) of the last-digit task; deterministic in ``seed``.

    Every prompt is a distinct digit string; validation strings are never trained on."""
    strings = [str(i).zfill(n_digits) for i in range(10 ** n_digits)]
    if n_train <= 0 or n_val < 0 or n_train + n_val > len(strings):
        raise ValueError(f"last_digit_rows: need 0 < n_train, 0 <= n_val, n_train + n_val <= "
                         f"{len(strings)} ({n_digits} digits); got {n_train}, {n_val}")
    random.Random(seed).shuffle(strings)

    def row(digits: str, split: str, index: int) -> dict:
        # A plain-text prompt, not a chat: the answer is then the token the prompt ends
        # with, which a random model's residual stream already carries to the next position.
        return {"data_source": last_digit.DATA_SOURCE,
                "prompt": f"Repeat the last digit: {' '.join(digits)}",
                "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": digits[-1]},
                "extra_info": {"split": split, "index": index, "digits": digits}}

    val = [row(d, "val", i) for i, d in enumerate(strings[:n_val])]
    train = [row(d, "train", i) for i, d in enumerate(strings[n_val:n_val + n_train])]
    return train, val


def tool_lookup_rows(n_train: int, n_val: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train rows, val rows) of the tool-use task (``megarl.reward.tool_lookup``): "Look up
    K", the answer in a table of ten digit keys drawn at random for each prompt, which only
    the ``lookup`` tool sees (``extra_info.tools_kwargs``)."""
    if n_train <= 0 or n_val < 0:
        raise ValueError(f"tool_lookup_rows: need n_train > 0, n_val >= 0; got {n_train}, "
                         f"{n_val}")
    rng = random.Random(seed)

    def row(split: str, index: int) -> dict:
        key = str(rng.randrange(10))
        table = {str(k): str(rng.randrange(10)) for k in range(10)}
        return {"data_source": tool_lookup.DATA_SOURCE,
                "prompt": f"Look up {key}",
                "ability": "tool_use",
                "reward_model": {"style": "rule", "ground_truth": table[key]},
                "extra_info": {"split": split, "index": index, "key": key,
                               "tools_kwargs": {"lookup": {"table": table}}}}

    return [row("train", i) for i in range(n_train)], [row("val", i) for i in range(n_val)]


# data.synthetic_task -> its rows maker
TASKS = {"quickstart": quickstart_rows, "last_digit": last_digit_rows,
         "tool_lookup": tool_lookup_rows}


def make_synthetic_task(task: str, out_dir: str | os.PathLike, n_train: int = 256,
                        n_val: int = 32, seed: int = 0, *, overwrite: bool = False,
                        train_file: str | os.PathLike | None = None,
                        val_file: str | os.PathLike | None = None,
                        **task_kwargs) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``val.jsonl`` of ``task`` under ``out_dir``; their paths.

    ``train_file`` / ``val_file`` name the files instead (e.g. ``data.train_files``). When
    both files already exist they are kept (and returned) unless ``overwrite``: a run calls
    this on every start and must not rewrite data under a resumed run. ``task_kwargs`` go to
    the task's rows maker (``max_operand`` for the arithmetic task).
    """
    if task not in TASKS:
        raise ValueError(f"synthetic task {task!r}: unknown; expected one of {sorted(TASKS)}")
    out = Path(out_dir)
    paths = {"train": Path(train_file) if train_file else out / "train.jsonl",
             "val": Path(val_file) if val_file else out / "val.jsonl"}
    if not overwrite and all(p.is_file() for p in paths.values()):
        logger.info("%s task: using existing %s and %s", task, paths["train"], paths["val"])
        return paths
    train, val = TASKS[task](n_train, n_val, seed, **task_kwargs)
    for p in paths.values():
        p.parent.mkdir(parents=True, exist_ok=True)
    _write_jsonl_atomic(paths["train"], train)
    _write_jsonl_atomic(paths["val"], val)
    logger.info("%s task: wrote %d train and %d val prompts to %s",
                task, len(train), len(val), paths["train"].parent)
    return paths


def make_quickstart_task(out_dir: str | os.PathLike, n_train: int = 256, n_val: int = 32,
                         seed: int = 0, *, max_operand: int = 9, overwrite: bool = False,
                         train_file: str | os.PathLike | None = None,
                         val_file: str | os.PathLike | None = None) -> dict[str, Path]:
    """The arithmetic task of ``configs/quickstart.yaml`` (see ``make_synthetic_task``)."""
    if n_train <= 0 or n_val < 0 or max_operand < 0:
        raise ValueError(f"make_quickstart_task: need n_train > 0, n_val >= 0, max_operand >= 0; "
                         f"got {n_train}, {n_val}, {max_operand}")
    return make_synthetic_task("quickstart", out_dir, n_train, n_val, seed,
                               overwrite=overwrite, train_file=train_file, val_file=val_file,
                               max_operand=max_operand)
