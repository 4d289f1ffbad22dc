"""Prompt datasets in the verl convention, read from jsonl and parquet files.

This module owns turning data files into tokenized ``Prompt`` items, and every check on a
row, so that a bad data set fails (or is cleaned) when it is loaded, before any training
step. A row is a JSON object (jsonl line, or parquet row) with:

- ``prompt`` (the key is ``data.prompt_key``): a list of chat messages ``{role, content}``,
  rendered with the tokenizer's chat template and a generation prompt; or a plain string,
  tokenized as is (a document, with the tokenizer's own special tokens such as BOS);
- ``data_source``: a string naming the task (it picks the default reward function);
- ``reward_model``: an object with ``ground_truth`` (any non-null value) and optional ``style``;
- ``extra_info``: an optional object handed to the reward function.

Row numbers are 1-based in both formats (for jsonl they are line numbers; blank lines are
not rows but still counted, so numbers match an editor). Bad rows are reported as
``file:row: field: problem``. Everything is loaded into memory: the sample buffer and the
streaming of huge corpora are deliberately left out.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from megarl.config.errors import ConfigError

logger = logging.getLogger(__name__)

TRUNCATIONS = ("error", "left", "right")
BAD_ROWS = ("skip", "error")
# How many bad rows a log line or an error message spells out before summarising.
_SHOWN = 5


@dataclass(frozen=True)
class Prompt:
    """One tokenized prompt; ``uid`` is stable across runs (``file_stem:row``)."""

    index: int
    uid: str
    prompt_ids: list[int]
    raw_prompt: Any
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)


class BadRowError(ValueError):
    """A data file has malformed rows; the message names file:row and field of each."""


def _as_paths(files, key: str) -> list[Path]:
    if files is None or (isinstance(files, str) and not files.strip()):
        raise ConfigError(f"{key}: no data files given")
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    paths = [Path(f) for f in files]
    if not paths:
        raise ConfigError(f"{key}: no data files given")
    for p in paths:
        if not p.is_file():
            raise ConfigError(f"{key}: no such data file: {p}")
        if p.suffix not in (".jsonl", ".json", ".parquet"):
            raise ConfigError(f"{key}: {p}: unknown format {p.suffix!r} "
                              f"(expected .jsonl or .parquet)")
    return paths


def _read_rows(path: Path) -> Iterator[tuple[int, Any, Optional[str]]]:
    """Yield (row number, row, JSON error) for each row of one file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:  # a corrupt file is not a bad row: nothing in it is usable
            raise ValueError(f"{path}: cannot read parquet file: {err}") from err
        for i, row in enumerate(table.to_pylist()):
            yield i + 1, row, None
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line), None
            except json.JSONDecodeError as err:
                yield lineno, None, f"line is not valid JSON ({err.msg} at column {err.colno})"


def _check_messages(msgs: list) -> Optional[str]:
    if not msgs:
        return "empty list of messages"
    for j, m in enumerate(msgs):
        if not isinstance(m, dict):
            return f"message {j} is {type(m).__name__}, expected an object with role and content"
        if not isinstance(m.get("role"), str) or not m["role"]:
            return f"message {j} has no string 'role'"
        if not isinstance(m.get("content"), str):
            return f"message {j} has no string 'content'"
    if not any(m["content"].strip() for m in msgs):
        return "every message is empty"
    return None


def check_row(row: Any, prompt_key: str = "prompt") -> Optional[tuple[str, str]]:
    """Return ``(field, problem)`` for a malformed row, or None when the row is usable."""
    if not isinstance(row, dict):
        return "<row>", f"is {type(row).__name__}, expected an object"
    if prompt_key not in row or row[prompt_key] is None:
        return prompt_key, "missing"
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            return prompt_key, "empty prompt"
    elif isinstance(prompt, list):
        problem = _check_messages(prompt)
        if problem:
            return prompt_key, problem
    else:
        return prompt_key, f"is {type(prompt).__name__}, expected a string or a list of messages"
    ds = row.get("data_source")
    if not isinstance(ds, str) or not ds:
        problem = "missing" if ds is None else f"expected a non-empty string, got {ds!r}"
        return "data_source", problem
    rm = row.get("reward_model")
    if not isinstance(rm, dict):
        problem = "missing" if rm is None else f"is {type(rm).__name__}, expected an object"
        return "reward_model", problem
    if rm.get("ground_truth") is None:
        return "reward_model.ground_truth", "missing"
    if rm.get("style") is not None and not isinstance(rm["style"], str):
        return "reward_model.style", f"is {type(rm['style']).__name__}, expected a string"
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        return "extra_info", f"is {type(extra).__name__}, expected an object"
    return None


def _stems(paths: Sequence[Path]) -> list[str]:
    # Two files may share a stem (a/train.jsonl, b/train.jsonl); number them so uids stay unique.
    stems = [p.stem for p in paths]
    return [s if stems.count(s) == 1 else f"{s}#{i}" for i, s in enumerate(stems)]


class RLDataset:
    """All usable prompts of some data files, tokenized, in file then row order.

    ``config_key`` only names the setting in error messages (``data.train_files`` or
    ``data.val_files``). Loading is eager: by the time the constructor returns, every row has
    been checked and every prompt's length is within ``max_prompt_length``.
    """

    def __init__(self, files, tokenizer, *, prompt_key: str = "prompt",
                 max_prompt_length: int = 256, filter_overlong_prompts: bool = True,
                 truncation: str = "error", bad_rows: str = "skip",
                 config_key: str = "data.train_files"):
        if truncation not in TRUNCATIONS:
            raise ConfigError(f"data.truncation: {truncation!r} is not one of {TRUNCATIONS}")
        if bad_rows not in BAD_ROWS:
            raise ConfigError(f"data.bad_rows: {bad_rows!r} is not one of {BAD_ROWS}")
        if max_prompt_length <= 0:
            raise ConfigError(f"data.max_prompt_length: must be positive, got {max_prompt_length}")
        self.paths = _as_paths(files, config_key)
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.num_bad_rows = 0
        self.num_filtered = 0
        self.num_truncated = 0
        rows = self._load_rows(bad_rows)
        self.items: list[Prompt] = self._tokenize(rows, filter_overlong_prompts, truncation)
        logger.info("%s: %d prompts from %d file(s) (%d bad rows skipped, %d overlong filtered, "
                    "%d truncated)", config_key, len(self.items), len(self.paths),
                    self.num_bad_rows, self.num_filtered, self.num_truncated)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Prompt:
        return self.items[i]

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.items)

    def _load_rows(self, bad_rows: str) -> list[tuple[str, str, dict]]:
        """(uid, where, row) for each good row; bad rows skipped or raised per ``bad_rows``."""
        good, bad = [], []
        for path, stem in zip(self.paths, _stems(self.paths)):
            for rowno, row, json_err in _read_rows(path):
                problem = ("<row>", json_err) if json_err else check_row(row, self.prompt_key)
                if problem:
                    bad.append(f"{path}:{rowno}: {problem[0]}: {problem[1]}")
                else:
                    good.append((f"{stem}:{rowno}", f"{path}:{rowno}", row))
        if bad:
            shown = "\n  ".join(bad[:_SHOWN])
            more = f"\n  ... and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
            if bad_rows == "error":
                raise BadRowError(f"{len(bad)} bad row(s) (data.bad_rows=error):\n  {shown}{more}")
            logger.warning("skipped %d bad row(s) (data.bad_rows=skip):\n  %s%s",
                           len(bad), shown, more)
        self.num_bad_rows = len(bad)
        return good

    def _encode(self, rows: list[tuple[str, str, dict]]) -> list[list[int]]:
        # Batch the tokenizer calls per kind: fast tokenizers are much quicker on lists.
        chat = [i for i, (_, _, r) in enumerate(rows) if isinstance(r[self.prompt_key], list)]
        text = [i for i, (_, _, r) in enumerate(rows) if isinstance(r[self.prompt_key], str)]
        ids: list[Optional[list[int]]] = [None] * len(rows)
        if chat:
            rendered = [self.tokenizer.apply_chat_template(
                rows[i][2][self.prompt_key], add_generation_prompt=True, tokenize=False)
                for i in chat]
            # The template already holds any BOS the model wants: add no more special tokens.
            enc = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
            for i, e in zip(chat, enc):
                ids[i] = list(e)
        if text:
            enc = self.tokenizer([rows[i][2][self.prompt_key] for i in text],
                                 add_special_tokens=True)["input_ids"]
            for i, e in zip(text, enc):
                ids[i] = list(e)
        return ids  # type: ignore[return-value]

    def _tokenize(self, rows, filter_overlong: bool, truncation: str) -> list[Prompt]:
        items: list[Prompt] = []
        limit = self.max_prompt_length
        for (uid, where, row), ids in zip(rows, self._encode(rows)):
            if len(ids) > limit:
                if filter_overlong:
                    self.num_filtered += 1
                    continue
                if truncation == "error":
                    raise ValueError(
                        f"{where}: {self.prompt_key}: prompt is {len(ids)} tokens, longer than "
                        f"data.max_prompt_length={limit} (set data.filter_overlong_prompts=True "
                        f"or data.truncation=left|right)")
                ids = ids[-limit:] if truncation == "left" else ids[:limit]
                self.num_truncated += 1
            rm = row["reward_model"]
            items.append(Prompt(index=len(items), uid=uid, prompt_ids=ids,
                                raw_prompt=row[self.prompt_key], data_source=row["data_source"],
                                ground_truth=rm["ground_truth"],
                                extra_info=dict(row.get("extra_info") or {})))
        if self.num_filtered:
            logger.warning("filtered %d prompt(s) longer than data.max_prompt_length=%d",
                           self.num_filtered, limit)
        return items


def load_split(data_cfg, tokenizer, split: str = "train") -> Optional[RLDataset]:
    """The ``train`` or ``val`` dataset described by the ``data`` config section.

    Returns None for ``val`` when ``data.val_files`` is null.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    key = f"{split}_files"

    def get(k):
        return data_cfg[k] if isinstance(data_cfg, dict) else getattr(data_cfg, k)

    files = get(key)
    if split == "val" and files is None:
        return None
    if files is not None and not isinstance(files, (str, os.PathLike)):
        files = list(files)  # an omegaconf ListConfig
    return RLDataset(files, tokenizer, prompt_key=get("prompt_key"),
                     max_prompt_length=get("max_prompt_length"),
                     filter_overlong_prompts=get("filter_overlong_prompts"),
                     truncation=get("truncation"), bad_rows=get("bad_rows"),
                     config_key=f"data.{key}")
