"""Turn GSM8K and MATH, in their own file formats, into verl-format parquet
(``tools/prepare_data.py``).

The rows written are those of verl's ``examples/data_preprocess/gsm8k.py`` and
``math_dataset.py``, so verl's data and megarl's built-in rewards agree on them:

- ``data_source``: ``openai/gsm8k`` or ``DigitalLearningGmbH/MATH-lighteval``;
- ``prompt``: one user message, the question and verl's instruction after a space;
- ``ability``: ``math``;
- ``reward_model``: ``{style: rule, ground_truth}``, the number after GSM8K's ``#### ``
  (commas dropped), or the inside of the last ``\\boxed{}`` of a MATH solution;
- ``extra_info``: ``{split, index}`` (GSM8K also keeps ``answer`` and ``question``);
- any other field of an input row (MATH's ``level`` and ``type``) kept, as verl's
  ``datasets.map`` keeps it.

Inputs are the datasets' own files: GSM8K as jsonl (openai/grade-school-math's
``train.jsonl``/``test.jsonl``) or parquet (the hub's ``main/train-*.parquet``), rows
``{question, answer}``; MATH as Hendrycks' per-problem JSON files (``MATH/train/<type>/<n>.json``,
``{problem, level, type, solution}``) or the hub's parquet of the same fields. A file's split is
told by its name or a directory above it (``train``/``test``, or a hub shard
``train-00000-of-00001``); other files (GSM8K's socratic variant, model solutions, READMEs) are
skipped and counted. ``index`` is the row's place in its split, files in name order, so it is
verl's for the hub's files. Without ``--input`` the hub is read through ``datasets`` where that
library is installed; offline, local files are the way.

A bad input row stops the tool (as verl's scripts do) with ``file:row: field: problem``;
nothing is written then. Both outputs are written to temporary files beside them and renamed
into place, so a reader never sees half a file.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from megarl.reward.math_hendrycks import last_boxed_only_string, remove_boxed
from megarl.utils.errors import ConfigError

logger = logging.getLogger(__name__)

SPLITS = ("train", "test")
_FORMATS = (".jsonl", ".json", ".parquet")
# GSM8K's final answer, as verl's gsm8k.py reads it (the first one, commas dropped).
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


class PrepareError(ConfigError):
    """Input the tool cannot turn into rows; the message names the file, row and field."""


@dataclass(frozen=True)
class Recipe:
    """One dataset: its verl name, where the hub keeps it, its fields, how a row is made."""

    data_source: str
    hub: tuple[str, Optional[str]]     # (repo id, config name) for datasets.load_dataset
    question: str                      # the input field holding the question
    answer: str                        # the input field holding the worked answer
    instruction: str                   # verl's text after the question
    ground_truth: Callable[[str], Optional[str]]  # the answer's final value, None if none
    no_answer: str                     # what is missing when ground_truth gives None
    keep_in_extra: bool                # GSM8K keeps answer and question in extra_info
    skip: tuple[str, ...] = ()         # path parts of other variants in the same download


def _gsm8k_answer(text: str) -> Optional[str]:
    m = _GSM8K_ANSWER.search(text)
    return None if m is None else m.group(1).replace(",", "")


def _math_answer(text: str) -> Optional[str]:
    boxed = last_boxed_only_string(text)
    if boxed is None:
        return None
    try:
        return remove_boxed(boxed)
    except AssertionError:  # a last \fbox{}: verl's script stops on it too
        return None


RECIPES: dict[str, Recipe] = {
    "gsm8k": Recipe(
        data_source="openai/gsm8k", hub=("openai/gsm8k", "main"),
        question="question", answer="answer",
        instruction='Let\'s think step by step and output the final answer after "####".',
        ground_truth=_gsm8k_answer, no_answer="no final answer '#### <number>'",
        keep_in_extra=True, skip=("socratic",)),
    "math": Recipe(
        # lighteval/MATH left the hub; verl names the mirror it reads
        data_source="DigitalLearningGmbH/MATH-lighteval",
        hub=("DigitalLearningGmbH/MATH-lighteval", None),
        question="problem", answer="solution",
        instruction="Let's think step by step and output the final answer within \\boxed{}.",
        ground_truth=_math_answer, no_answer="no \\boxed{...} answer", keep_in_extra=False),
}


def make_row(recipe: Recipe, example: dict, split: str, index: int, where: str) -> dict:
    """verl's row for one input ``example`` (``where``: ``file:row``, for errors)."""
    if not isinstance(example, dict):
        raise PrepareError(f"{where}: is {type(example).__name__}, expected an object with "
                           f"{recipe.question!r} and {recipe.answer!r}")
    rest = dict(example)
    texts = {}
    for name in (recipe.question, recipe.answer):
        value = rest.pop(name, None)
        if not isinstance(value, str) or not value.strip():
            problem = "missing" if value is None else f"expected text, got {value!r:.80}"
            raise PrepareError(f"{where}: {name}: {problem}")
        texts[name] = value
    question, answer = texts[recipe.question], texts[recipe.answer]
    truth = recipe.ground_truth(answer)
    if truth is None:
        raise PrepareError(f"{where}: {recipe.answer}: {recipe.no_answer} "
                           f"(ends {answer[-80:]!r})")
    extra: dict[str, Any] = {"split": split, "index": index}
    if recipe.keep_in_extra:
        extra.update(answer=answer, question=question)
    return {**rest, "data_source": recipe.data_source,
            "prompt": [{"role": "user", "content": f"{question} {recipe.instruction}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": extra}


def split_of(path: Path, root: Path) -> Optional[str]:
    """``train``/``test`` by the file's name, else by the nearest directory below ``root``
    named so; None for any other file."""
    stem = path.name[:-len(path.suffix)] if path.suffix else path.name
    for part in [stem, *reversed(path.relative_to(root).parts[:-1])]:
        for split in SPLITS:
            if part == split or part.startswith(f"{split}-"):  # a hub shard: train-00000-of-1
                return split
    return None


def find_files(inputs: Sequence[Path], recipe: Recipe) -> tuple[dict[str, list[Path]], int]:
    """({split: its files in name order}, number of files skipped) under ``inputs``."""
    found: dict[str, list[Path]] = {s: [] for s in SPLITS}
    skipped = 0
    for root in inputs:
        if not root.exists():
            raise PrepareError(f"--input: no such file or directory: {root}")
        files = ([root] if root.is_file() else
                 sorted(p for p in root.rglob("*") if p.is_file()
                        and not any(part.startswith(".") for part in p.relative_to(root).parts)))
        for f in files:
            base = root if root.is_dir() else f
            split = split_of(f, base)
            other_variant = any(s in part for s in recipe.skip
                                for part in (f.relative_to(base).parts or (f.name,)))
            if f.suffix not in _FORMATS or split is None or other_variant:
                if root.is_file():
                    raise PrepareError(f"--input: {f}: not a train or test file "
                                       f"(name it train*/test*, .jsonl, .json or .parquet)")
                skipped += 1
                continue
            found[split].append(f)
    for split in SPLITS:
        # numbered files (MATH's 1.json ... 10.json) in number order within their directory
        found[split].sort(key=lambda p: (str(p.parent), int(p.stem) if p.stem.isdigit() else -1,
                                         p.name))
    return found, skipped


def read_examples(path: Path) -> Iterator[tuple[str, Any]]:
    """(``file:row``, example) for each row of a jsonl, json or parquet file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # a corrupt file: nothing in it is usable
            raise PrepareError(f"{path}: not a readable parquet file ({err})") from None
        for i, r in enumerate(rows):
            yield f"{path}:{i + 1}", r
        return
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise PrepareError(f"{path}: cannot read it as UTF-8 text ({err})") from None
    if path.suffix == ".json":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise PrepareError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
        for i, r in enumerate(value if isinstance(value, list) else [value]):
            yield f"{path}:{i + 1}", r
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as err:
            raise PrepareError(f"{path}:{lineno}: not valid JSON ({err.msg} at column "
                               f"{err.colno})") from None


def rows_from_files(recipe: Recipe, files: dict[str, list[Path]]) -> dict[str, list[dict]]:
    out = {}
    for split in SPLITS:
        if not files[split]:
            raise PrepareError(f"--input: no {split} files found (expected files or "
                               f"directories named {split}, or hub shards {split}-*)")
        rows: list[dict] = []
        for path in files[split]:
            for where, example in read_examples(path):
                rows.append(make_row(recipe, example, split, len(rows), where))
        if not rows:
            raise PrepareError(f"--input: the {split} files hold no rows: "
                               f"{', '.join(map(str, files[split]))}")
        out[split] = rows
    return out


def rows_from_hub(recipe: Recipe) -> dict[str, list[dict]]:
    try:
        import datasets
    except ImportError:
        raise PrepareError("--input: not given, and the hub cannot be read without the "
                           "`datasets` library (pip install datasets); or download the "
                           "dataset's files and pass --input") from None
    name, config = recipe.hub
    logger.info("reading %s from the hub", name)
    ds = datasets.load_dataset(name, config) if config else datasets.load_dataset(name)
    return {split: [make_row(recipe, dict(ex), split, i, f"{name}[{split}]:{i + 1}")
                    for i, ex in enumerate(ds[split])] for split in SPLITS}


def write_parquet(rows_by_split: dict[str, list[dict]], out_dir: Path) -> dict[str, Path]:
    """Write ``<split>.parquet`` for each split: every file to a temporary name first, then
    all renamed, so a failure leaves the old outputs (or none), never a partial file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if out_dir.exists() and not out_dir.is_dir():
        raise PrepareError(f"--output: {out_dir} is a file, not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, tuple[Path, Path]] = {}
    try:
        for split, rows in rows_by_split.items():
            tmp = out_dir / f".{split}.parquet.tmp-{os.getpid()}"
            written[split] = (tmp, out_dir / f"{split}.parquet")
            pq.write_table(pa.Table.from_pylist(rows), tmp)
        for tmp, final in written.values():
            os.replace(tmp, final)
    finally:
        for tmp, _ in written.values():
            tmp.unlink(missing_ok=True)  # left only when a write failed
    return {split: final for split, (_, final) in written.items()}


def prepare(name: str, inputs: Sequence[os.PathLike | str], out_dir: os.PathLike | str
            ) -> tuple[dict[str, int], int]:
    """Write ``train.parquet`` and ``test.parquet`` of dataset ``name`` into ``out_dir``;
    returns ({split: rows}, input files skipped)."""
    if name not in RECIPES:
        raise PrepareError(f"dataset: {name!r} is not one of {sorted(RECIPES)}")
    recipe = RECIPES[name]
    skipped = 0
    if inputs:
        files, skipped = find_files([Path(p) for p in inputs], recipe)
        rows = rows_from_files(recipe, files)
    else:
        rows = rows_from_hub(recipe)
    write_parquet(rows, Path(out_dir))
    return {s: len(r) for s, r in rows.items()}, skipped
