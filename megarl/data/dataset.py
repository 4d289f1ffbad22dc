"""Prompt datasets in the verl convention, read from jsonl and parquet files.

This module owns turning data files into tokenized ``Prompt`` items, and every check on a
row, so that a bad data set fails (or is cleaned) when it is loaded, before any training
step. A row is a JSON object (jsonl line, or parquet row) with:

- ``prompt`` (the key is ``data.prompt_key``): a list of chat messages ``{role, content}``,
  rendered with the tokenizer's chat template and a generation prompt; or a plain string,
  tokenized as is (a document, with the tokenizer's own special tokens such as BOS);
- ``data_source`` (the key is ``data.reward_fn_key``): a string naming the task (it picks
  the default reward function);
- ``reward_model``: an object with ``ground_truth`` (any non-null value) and optional ``style``;
- ``extra_info``: an optional object handed to the reward function.

Row numbers are 1-based in both formats (for jsonl they are line numbers; blank lines are
not rows but still counted, so numbers match an editor). Bad rows are reported as
``file:row: field: problem``. A file that cannot be read at all (missing, binary, a broken
parquet, empty, or with no usable row) is a ``ConfigError`` naming it, whatever
``data.bad_rows`` says. Every error is one line, so the CLI prints it without a traceback.
Chat prompts are templated here and nowhere else (the rollout, validation and the agent loop
all start from these token ids), so ``data.apply_chat_template_kwargs`` is honoured by
passing it to the one ``apply_chat_template`` call below.
Everything is loaded into memory: the sample buffer and the streaming of huge corpora are
deliberately left out.
"""
from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from omegaconf import DictConfig, ListConfig

from megarl.utils.errors import ConfigError

logger = logging.getLogger(__name__)

TRUNCATIONS = ("error", "left", "right")
BAD_ROWS = ("skip", "error")
# How many bad rows a log line or an error message spells out before summarising.
_SHOWN = 5
# Magic numbers of files that are sometimes given a .jsonl name by mistake.
_BINARY_MAGIC = {b"PAR1": "a parquet file", b"\x1f\x8b": "gzip data", b"PK\x03\x04": "a zip file",
                 b"\x28\xb5\x2f\xfd": "zstd data", b"BZh": "bzip2 data"}
# A problem text quotes values; a huge one must not flood the one-line message.
_MAX_PROBLEM = 200
# apply_chat_template arguments megarl sets itself: a user's value would change what the
# call returns (text, not ids; a dict; tensors) or what the prompt ends with.
_RESERVED_TEMPLATE_KWARGS = ("conversation", "add_generation_prompt", "tokenize", "return_dict",
                             "return_tensors", "continue_final_message")


@dataclass(frozen=True)
class Prompt:
    """One tokenized prompt; ``uid`` is stable across runs (``file_stem:row``).
    ``data_source`` is the row's ``data.reward_fn_key`` column (``data_source`` by default):
    the name the reward is chosen by, as verl's reward managers pass it."""

    index: int
    uid: str
    prompt_ids: list[int]
    raw_prompt: Any
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)


class BadRowError(ConfigError):
    """A data file has malformed rows (with ``data.bad_rows=error``) or none usable; the
    one-line message names file:row and field of the first, and where the others are."""


def _as_paths(files, key: str) -> list[Path]:
    if files is None or (isinstance(files, str) and not files.strip()):
        raise ConfigError(f"{key}: no data files given")
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    paths = []
    for f in files:
        if not isinstance(f, (str, os.PathLike)) or "\x00" in str(f):
            raise ConfigError(f"{key}: {f!r} is not a file path")
        paths.append(Path(f))
    if not paths:
        raise ConfigError(f"{key}: no data files given")
    for p in paths:
        try:
            _check_file(p, key)
        except OSError as err:  # a name too long, a loop of links: not a usable path
            raise ConfigError(f"{key}: {p}: {err.strerror or err}") from None
    return paths


def _check_file(p: Path, key: str) -> None:
    if p.is_dir():
        raise ConfigError(f"{key}: {p} is a directory, not a data file")
    if not p.exists():
        raise ConfigError(f"{key}: no such data file: {p}")
    if not stat.S_ISREG(p.stat().st_mode):
        raise ConfigError(f"{key}: {p} is not a regular file")
    if not os.access(p, os.R_OK):
        raise ConfigError(f"{key}: {p}: cannot read it (permission denied)")
    if p.suffix not in (".jsonl", ".json", ".parquet"):
        raise ConfigError(f"{key}: {p}: unknown format {p.suffix!r} "
                          f"(expected .jsonl or .parquet)")


def _read_rows(path: Path, key: str) -> Iterator[tuple[int, Any, Optional[str]]]:
    """Yield (row number, row, problem) for each row of one file; a problem makes the row bad.

    Raises ``ConfigError`` when the file as a whole is unreadable.
    """
    try:
        if path.suffix == ".parquet":
            yield from _read_parquet(path, key)
        else:
            yield from _read_jsonl(path, key)
    except OSError as err:  # removed or unreadable between the checks and the read
        raise ConfigError(f"{key}: {path}: cannot read it ({err.strerror or err})") from None


def _read_parquet(path: Path, key: str) -> Iterator[tuple[int, Any, Optional[str]]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as err:  # a corrupt file is not a bad row: nothing in it is usable
        reason = _first_line(err) or type(err).__name__
        raise ConfigError(f"{key}: {path}: not a readable parquet file ({reason})") from None
    for i, row in enumerate(rows):
        yield i + 1, row, None


def _read_jsonl(path: Path, key: str) -> Iterator[tuple[int, Any, Optional[str]]]:
    with open(path, "rb") as f:
        head = f.read(8192)
        kind = next((what for magic, what in _BINARY_MAGIC.items() if head.startswith(magic)),
                    "binary data" if b"\x00" in head else None)
        if kind:
            raise ConfigError(f"{key}: {path}: is {kind}, not JSON-lines text")
        f.seek(0)
        # Lines are decoded one by one (not by a text-mode reader), so a bad byte is reported
        # with its row, and only that row is bad.
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte-order mark, as some editors write
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield lineno, None, (f"not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                     f"{err.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line), None
            except json.JSONDecodeError as err:
                yield lineno, None, f"line is not valid JSON ({err.msg} at column {err.colno})"
            except RecursionError:
                yield lineno, None, "line is not usable JSON (nested too deeply)"
            except ValueError as err:  # e.g. an integer longer than Python converts
                yield lineno, None, f"line is not usable JSON ({_first_line(err)})"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:_MAX_PROBLEM] if text else ""


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
        if not _is_text(m["content"]):
            return f"message {j}: 'content' holds a lone surrogate (JSON \\ud8xx), not text"
    if not any(m["content"].strip() for m in msgs):
        return "every message is empty"
    return None


def _is_text(s: str) -> bool:
    # JSON may spell half a surrogate pair (\ud800); no tokenizer can encode the result.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_template_kwargs(kwargs: Any, key: str = "data.apply_chat_template_kwargs") -> dict:
    """``kwargs`` as a plain dict of extra ``apply_chat_template`` arguments, or a
    ``ConfigError`` naming ``key`` (not a mapping, a non-string name, a reserved argument)."""
    if kwargs is None:
        return {}
    if isinstance(kwargs, DictConfig):
        from omegaconf import OmegaConf
        kwargs = OmegaConf.to_container(kwargs, resolve=True)
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{key}: expected a mapping of apply_chat_template arguments "
                          f"(e.g. {{enable_thinking: false}}), got {type(kwargs).__name__} "
                          f"{repr(kwargs)[:_MAX_PROBLEM]}")
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            hint = (f" (to set {name.split(':')[0]}, write {{{name.split(':')[0]}: ...}} with a "
                    f"space after the colon, or {key}.{name.split(':')[0]}=...)"
                    if isinstance(name, str) and ":" in name else "")
            raise ConfigError(f"{key}: {name!r} is not a keyword argument name{hint}")
        if name in _RESERVED_TEMPLATE_KWARGS:
            raise ConfigError(f"{key}.{name}: megarl sets this argument itself (prompts are "
                              f"rendered with add_generation_prompt=True, then tokenized); "
                              f"remove it")
    return dict(kwargs)


def check_row(row: Any, prompt_key: str = "prompt",
              reward_fn_key: str = "data_source") -> Optional[tuple[str, str]]:
    """Return ``(field, problem)`` for a malformed row, or None when the row is usable."""
    if not isinstance(row, dict):
        return "<row>", f"is {type(row).__name__}, expected an object"
    if prompt_key not in row or row[prompt_key] is None:
        return prompt_key, "missing"
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            return prompt_key, "empty prompt"
        if not _is_text(prompt):
            return prompt_key, "holds a lone surrogate (JSON \\ud8xx), not text"
    elif isinstance(prompt, list):
        problem = _check_messages(prompt)
        if problem:
            return prompt_key, problem
    else:
        return prompt_key, f"is {type(prompt).__name__}, expected a string or a list of messages"
    ds = row.get(reward_fn_key)
    if not isinstance(ds, str) or not ds:
        problem = "missing" if ds is None else f"expected a non-empty string, got {ds!r}"
        return reward_fn_key, problem
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
                 reward_fn_key: str = "data_source", apply_chat_template_kwargs=None,
                 max_prompt_length: int = 256, filter_overlong_prompts: bool = True,
                 truncation: str = "error", bad_rows: str = "skip",
                 config_key: str = "data.train_files"):
        if truncation not in TRUNCATIONS:
            raise ConfigError(f"data.truncation: {truncation!r} is not one of {TRUNCATIONS}")
        if bad_rows not in BAD_ROWS:
            raise ConfigError(f"data.bad_rows: {bad_rows!r} is not one of {BAD_ROWS}")
        if max_prompt_length <= 0:
            raise ConfigError(f"data.max_prompt_length: must be positive, got {max_prompt_length}")
        self.template_kwargs = check_template_kwargs(apply_chat_template_kwargs)
        self.paths = _as_paths(files, config_key)
        self.config_key = config_key
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.reward_fn_key = reward_fn_key
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
        good, self.num_bad_rows = read_rows(self.paths, self.config_key, self.prompt_key,
                                            bad_rows, self.reward_fn_key)
        return good

    def _encode(self, rows: list[tuple[str, str, dict]]) -> list[list[int]]:
        # Batch the tokenizer calls per kind: fast tokenizers are much quicker on lists.
        chat = [i for i, (_, _, r) in enumerate(rows) if isinstance(r[self.prompt_key], list)]
        text = [i for i, (_, _, r) in enumerate(rows) if isinstance(r[self.prompt_key], str)]
        ids: list[Optional[list[int]]] = [None] * len(rows)
        if chat:
            rendered = [self._call(rows[i][1], self.tokenizer.apply_chat_template,
                                   rows[i][2][self.prompt_key], add_generation_prompt=True,
                                   tokenize=False, **self.template_kwargs) for i in chat]
            # The template already holds any BOS the model wants: add no more special tokens.
            for i, e in zip(chat, self._batch([rows[i][1] for i in chat], rendered, False)):
                ids[i] = e
        if text:
            prompts = [rows[i][2][self.prompt_key] for i in text]
            for i, e in zip(text, self._batch([rows[i][1] for i in text], prompts, True)):
                ids[i] = e
        return ids  # type: ignore[return-value]

    def _batch(self, wheres: list[str], texts: list[str], special: bool) -> list[list[int]]:
        try:
            return [list(e) for e in self.tokenizer(texts, add_special_tokens=special)["input_ids"]]
        except Exception:
            # Find the row the tokenizer refuses (a lone surrogate, say) and name it.
            return [list(self._call(w, self.tokenizer, t, add_special_tokens=special)["input_ids"])
                    for w, t in zip(wheres, texts)]

    def _call(self, where: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            raise ConfigError(f"{where}: {self.prompt_key}: the tokenizer cannot encode it "
                              f"({type(err).__name__}: {_first_line(err)})") from None

    def _tokenize(self, rows, filter_overlong: bool, truncation: str) -> list[Prompt]:
        items: list[Prompt] = []
        limit = self.max_prompt_length
        for (uid, where, row), ids in zip(rows, self._encode(rows)):
            if len(ids) > limit:
                if filter_overlong:
                    self.num_filtered += 1
                    continue
                if truncation == "error":
                    raise ConfigError(
                        f"{where}: {self.prompt_key}: prompt is {len(ids)} tokens, longer than "
                        f"data.max_prompt_length={limit} (set data.filter_overlong_prompts=True "
                        f"or data.truncation=left|right)")
                ids = ids[-limit:] if truncation == "left" else ids[:limit]
                self.num_truncated += 1
            rm = row["reward_model"]
            items.append(Prompt(index=len(items), uid=uid, prompt_ids=ids,
                                raw_prompt=row[self.prompt_key],
                                data_source=row[self.reward_fn_key],
                                ground_truth=rm["ground_truth"],
                                extra_info=dict(row.get("extra_info") or {})))
        if self.num_filtered:
            logger.warning("filtered %d prompt(s) longer than data.max_prompt_length=%d",
                           self.num_filtered, limit)
        return items


def read_rows(paths: Sequence[Path], config_key: str, prompt_key: str = "prompt",
              bad_rows: str = "skip",
              reward_fn_key: str = "data_source") -> tuple[list[tuple[str, str, dict]], int]:
    """((uid, where, row) for each good row of ``paths``, number of bad rows); bad rows are
    skipped or raised per ``bad_rows``. A file with no rows, or none usable, is an error
    either way."""
    good, bad = [], []
    for path, stem in zip(paths, _stems(paths)):
        n_rows, n_good, first_bad = 0, 0, None
        for rowno, row, read_err in _read_rows(path, config_key):
            n_rows += 1
            problem = ("<row>", read_err) if read_err else check_row(row, prompt_key, reward_fn_key)
            if problem:
                text = f"{path}:{rowno}: {problem[0]}: {problem[1][:_MAX_PROBLEM]}"
                bad.append((f"{path}:{rowno}", text))
                first_bad = first_bad or text
            else:
                n_good += 1
                good.append((f"{stem}:{rowno}", f"{path}:{rowno}", row))
        if n_rows == 0:
            raise ConfigError(f"{config_key}: {path}: the file has no rows")
        if n_good == 0:
            raise BadRowError(f"{first_bad} ({config_key}: none of the {n_rows} row(s) of "
                              f"{path} is usable)")
    if bad:
        if bad_rows == "error":
            others = [where for where, _ in bad[1:_SHOWN + 1]]
            more = f" and {len(bad) - 1 - len(others)} more" if len(bad) - 1 > len(others) else ""
            also = f"; also at {', '.join(others)}{more}" if others else ""
            raise BadRowError(f"{bad[0][1]} ({config_key}: {len(bad)} bad row(s), "
                              f"data.bad_rows=error{also})")
        shown = "\n  ".join(text for _, text in bad[:_SHOWN])
        more = f"\n  ... and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
        logger.warning("%s: skipped %d bad row(s) (data.bad_rows=skip):\n  %s%s",
                       config_key, len(bad), shown, more)
    return good, len(bad)


def _split_args(data_cfg, split: str) -> Optional[dict]:
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    key = f"{split}_files"

    def get(k):
        return data_cfg[k] if isinstance(data_cfg, dict) else getattr(data_cfg, k)

    files = get(key)
    if split == "val" and files is None:
        return None
    if isinstance(files, (list, tuple, ListConfig)):
        files = list(files)  # an omegaconf ListConfig
    elif files is not None and not isinstance(files, (str, os.PathLike)):
        what = "a mapping" if isinstance(files, (dict, DictConfig)) else repr(files)
        raise ConfigError(f"data.{key}: expected a path or a list of paths, got {what}")
    return dict(files=files, prompt_key=get("prompt_key"), reward_fn_key=get("reward_fn_key"),
                apply_chat_template_kwargs=get("apply_chat_template_kwargs"),
                max_prompt_length=get("max_prompt_length"),
                filter_overlong_prompts=get("filter_overlong_prompts"),
                truncation=get("truncation"), bad_rows=get("bad_rows"),
                config_key=f"data.{key}")


def scan_split(data_cfg, split: str = "train", sources: dict | None = None) -> int:
    """Read and check every row of the ``train`` or ``val`` files without tokenizing them;
    returns the number of usable rows (0 for ``val`` with no files). Raises what loading
    would raise, except for prompt lengths (which need the tokenizer). `sources`, if given,
    gets each ``data_source`` of the usable rows with where it is first seen (``file:row``)."""
    args = _split_args(data_cfg, split)
    if args is None:
        return 0
    paths = _as_paths(args["files"], args["config_key"])
    check_template_kwargs(args["apply_chat_template_kwargs"])
    rows = read_rows(paths, args["config_key"], args["prompt_key"], args["bad_rows"],
                     args["reward_fn_key"])[0]
    if sources is not None:
        for _, where, row in rows:
            sources.setdefault(row[args["reward_fn_key"]], where)
    return len(rows)


def load_split(data_cfg, tokenizer, split: str = "train") -> Optional[RLDataset]:
    """The ``train`` or ``val`` dataset described by the ``data`` config section.

    Returns None for ``val`` when ``data.val_files`` is null.
    """
    args = _split_args(data_cfg, split)
    if args is None:
        return None
    return RLDataset(args.pop("files"), tokenizer, **args)
