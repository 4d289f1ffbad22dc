"""Fuzz: bad files given to `megarl train` / `megarl validate` (issue 17, item 2, file half).

Every case runs the real CLI entry point in-process against real files (a real tiny model and
tokenizer, real jsonl and parquet) with the controller replaced by a module that fails the
test if it is ever reached: the error must come from the checks made before Ray or any
worker starts. Each case asserts exit status 2 and one stderr line that names the file (and
the row, where there is one), with no traceback. A few cases run `python -m megarl.cli` in a
subprocess to show the same from outside: a quick exit 2 and no Ray temp directory.

The cases listed in the issue come first; the rest are drawn from ``random.Random(SEED)``
(corrupted and truncated jsonl and parquet, bad rows of many kinds, broken paths), so the
set is fixed from run to run.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from megarl.cli import main

SEED = 17
ROOT = Path(__file__).resolve().parents[2]
GOOD_CONTENT = "What is 2 + 3?"


# ------------------------------------------------------------------ files
def good_row(i: int = 0, text: bool = False) -> dict:
    prompt = f"What is {i % 10} + 1?"
    return {"data_source": "megarl/quickstart",
            "prompt": prompt if text else [{"role": "user", "content": prompt}],
            "reward_model": {"style": "rule", "ground_truth": str(i % 10 + 1)},
            "extra_info": {"i": i}}


def jsonl_bytes(rows) -> bytes:
    """Rows as jsonl; a row given as bytes or str is written verbatim (a malformed line)."""
    out = b""
    for r in rows:
        if isinstance(r, bytes):
            out += r
        elif isinstance(r, str):
            out += r.encode("utf-8", "surrogatepass")
        else:
            out += json.dumps(r).encode()
        out += b"\n"
    return out


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def write_parquet(path: Path, rows) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def good_jsonl(path: Path, n: int = 4) -> Path:
    return write(path, jsonl_bytes(good_row(i) for i in range(n)))


# ------------------------------------------------------------------ cases
# A case builds its files under `tmp` and returns (argv after the subcommand, substrings the
# error line must hold). `model` is a good tiny model directory with its tokenizer.
CASES: dict[str, object] = {}


def case(name: str):
    def register(fn):
        assert name not in CASES, name
        CASES[name] = fn
        return fn
    return register


def args(tmp: Path, model: Path, train=None, val=None, *extra) -> list[str]:
    train = train if train is not None else good_jsonl(tmp / "good_train.jsonl")
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files={train}",
            f"data.val_files={val if val is not None else 'null'}",
            f"trainer.default_local_dir={tmp / 'runs'}", "data.train_batch_size=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1", *extra]


# --- the cases listed in the issue
@case("issue-unwritable-default_local_dir")
def _(tmp, model):
    # /proc takes no new directories, even from root (chmod would not stop root).
    return args(tmp, model, None, None, "trainer.default_local_dir=/proc/megarl-fuzz/runs"), \
        ["trainer.default_local_dir", "/proc/megarl-fuzz/runs"]


@case("issue-default_local_dir-under-a-file")
def _(tmp, model):
    blocker = write(tmp / "blocker", b"not a directory")
    return args(tmp, model, None, None, f"trainer.default_local_dir={blocker}/ckpt"), \
        ["trainer.default_local_dir", f"{blocker} is a file"]


@case("issue-missing-tokenizer_path")
def _(tmp, model):
    return args(tmp, model, None, None,
                f"actor_rollout_ref.model.tokenizer_path={tmp / 'no-tokenizer'}"), \
        ["actor_rollout_ref.model.tokenizer_path", "no such tokenizer directory",
         str(tmp / "no-tokenizer")]


@case("issue-missing-resume_from_path")
def _(tmp, model):
    return args(tmp, model, None, None, "trainer.resume_mode=resume_path",
                f"trainer.resume_from_path={tmp / 'runs' / 'global_step_9'}"), \
        ["trainer.resume_from_path", "no such checkpoint directory", "global_step_9"]


@case("issue-non-utf8-bytes-in-jsonl")
def _(tmp, model):
    rows = [good_row(0), good_row(1), b'{"prompt": "caf\xe9 au lait"}', good_row(3)]
    f = write(tmp / "latin1.jsonl", jsonl_bytes(rows))
    return args(tmp, model, f, None, "data.bad_rows=error"), \
        [f"{f}:3:", "not UTF-8 text (byte 0xe9"]


@case("issue-non-utf8-only-rows-skip-mode")
def _(tmp, model):
    f = write(tmp / "cp1252.jsonl", "\n".join(["caf\u00e9"] * 3).encode("cp1252"))
    return args(tmp, model, f), [f"{f}:1:", "not UTF-8", "none of the 3 row(s)"]


@case("issue-binary-jsonl")
def _(tmp, model):
    f = write(tmp / "blob.jsonl", bytes(range(256)) * 8)
    return args(tmp, model, f), [str(f), "binary data, not JSON-lines text"]


@case("issue-parquet-named-jsonl")
def _(tmp, model):
    src = write_parquet(tmp / "real.parquet", [good_row(i) for i in range(3)])
    f = write(tmp / "mislabelled.jsonl", src.read_bytes())
    return args(tmp, model, f), [str(f), "is a parquet file, not JSON-lines text"]


@case("issue-fake-parquet")
def _(tmp, model):
    f = good_jsonl(tmp / "fake.parquet")
    return args(tmp, model, f), [str(f), "not a readable parquet file"]


@case("issue-truncated-parquet")
def _(tmp, model):
    data = write_parquet(tmp / "whole.parquet", [good_row(i) for i in range(8)]).read_bytes()
    f = write(tmp / "cut.parquet", data[: len(data) // 2])
    return args(tmp, model, f), [str(f), "not a readable parquet file"]


@case("issue-overlong-prompt-truncation-error")
def _(tmp, model):
    long_row = good_row(5, text=True)
    long_row["prompt"] = "What is 1 + 2? " * 40
    f = write(tmp / "long.jsonl", jsonl_bytes([good_row(0), good_row(1), long_row]))
    return args(tmp, model, f, None, "data.max_prompt_length=64", "data.truncation=error",
                "data.filter_overlong_prompts=False"), \
        [f"{f}:3:", "longer than data.max_prompt_length=64"]


@case("issue-bad-rows-error")
def _(tmp, model):
    bad = good_row(2)
    del bad["reward_model"]
    rows = [good_row(0), good_row(1), bad, "{oops", good_row(4)]
    f = write(tmp / "rows.jsonl", jsonl_bytes(rows))
    return args(tmp, model, f, None, "data.bad_rows=error"), \
        [f"{f}:3: reward_model: missing", "2 bad row(s)", f"also at {f}:4"]


# --- more paths and files, each once
@case("val-file-missing-validate")
def _(tmp, model):
    return ["validate", *args(tmp, model, None, tmp / "val" / "gone.jsonl")], \
        ["megarl validate:", "data.val_files", "no such data file", "gone.jsonl"]


@case("train-file-is-a-directory")
def _(tmp, model):
    (tmp / "adir.jsonl").mkdir()
    return args(tmp, model, tmp / "adir.jsonl"), ["data.train_files", "adir.jsonl is a directory"]


@case("train-file-unknown-format")
def _(tmp, model):
    f = write(tmp / "train.csv", b"prompt,answer\n1+1,2\n")
    return args(tmp, model, f), ["data.train_files", "train.csv", "unknown format '.csv'"]


@case("train-file-empty")
def _(tmp, model):
    f = write(tmp / "empty.jsonl", b"")
    return args(tmp, model, f), [str(f), "the file has no rows"]


@case("train-file-only-blank-lines")
def _(tmp, model):
    f = write(tmp / "blank.jsonl", b"\n  \n\t\n")
    return args(tmp, model, f), [str(f), "the file has no rows"]


@case("train-file-fifo")
def _(tmp, model):
    os.mkfifo(tmp / "pipe.jsonl")
    return args(tmp, model, tmp / "pipe.jsonl"), ["pipe.jsonl is not a regular file"]


@case("train-file-symlink-loop")
def _(tmp, model):
    os.symlink(tmp / "loop.jsonl", tmp / "loop.jsonl")
    return args(tmp, model, tmp / "loop.jsonl"), ["data.train_files", "loop.jsonl"]


@case("train-file-name-with-nul")
def _(tmp, model):
    return args(tmp, model, '"a\\0b.jsonl"'), ["data.train_files", "holds a NUL byte"]


@case("train-files-a-mapping")
def _(tmp, model):
    return args(tmp, model, "{a: b}"), ["data.train_files", "got a mapping"]


@case("train-files-a-number")
def _(tmp, model):
    return args(tmp, model, "5"), ["data.train_files", "expected a path or a list of paths"]


@case("val-files-numbers")
def _(tmp, model):
    return args(tmp, model, None, "[1, 2]"), ["data.val_files", "1 is not a file path"]


@case("train-files-empty-list")
def _(tmp, model):
    return args(tmp, model, "[]"), ["data.train_files", "no data files given"]


for _key in ("trainer.default_local_dir", "actor_rollout_ref.model.path",
             "actor_rollout_ref.model.tokenizer_path", "trainer.resume_from_path"):
    def _nul(tmp, model, key=_key):
        # YAML's "\0" escape: the override puts a real NUL byte into the path.
        extra = [f'{key}="{tmp}/a\\0b"']
        if key == "trainer.resume_from_path":
            extra.append("trainer.resume_mode=resume_path")
        return args(tmp, model, None, None, *extra), [key, "holds a NUL byte"]
    case(f"nul-byte-in-{_key}")(_nul)


@case("second-of-two-train-files-missing")
def _(tmp, model):
    a = good_jsonl(tmp / "a.jsonl")
    return args(tmp, model, f"[{a},{tmp / 'b.jsonl'}]"), ["no such data file", "b.jsonl"]


@case("all-rows-bad-skip-mode")
def _(tmp, model):
    f = write(tmp / "allbad.jsonl", jsonl_bytes([{"prompt": None}] * 4))
    return args(tmp, model, f), [f"{f}:1: prompt: missing", "none of the 4 row(s)"]


@case("batch-larger-than-usable-rows")
def _(tmp, model):
    f = write(tmp / "few.jsonl", jsonl_bytes([good_row(0), "{", good_row(2)]))
    return args(tmp, model, f, None, "data.train_batch_size=3"), \
        ["data.train_batch_size", "2 usable prompt(s)"]


@case("lone-surrogate-in-content")
def _(tmp, model):
    f = write(tmp / "sur.jsonl", jsonl_bytes(
        [good_row(0), '{"data_source": "d", "prompt": [{"role": "user", "content": "x\\ud800"}],'
                      ' "reward_model": {"ground_truth": "1"}}', good_row(2)]))
    return args(tmp, model, f, None, "data.bad_rows=error"), [f"{f}:2: prompt:", "surrogate"]


@case("deeply-nested-json-row")
def _(tmp, model):
    f = write(tmp / "deep.jsonl", jsonl_bytes([good_row(0), "[" * 100_000 + "]" * 100_000]))
    return args(tmp, model, f, None, "data.bad_rows=error"), [f"{f}:2: <row>", "nested too deeply"]


@case("five-thousand-digit-integer-row")
def _(tmp, model):
    f = write(tmp / "bigint.jsonl", jsonl_bytes([good_row(0), '{"prompt": ' + "9" * 5000 + "}"]))
    return args(tmp, model, f, None, "data.bad_rows=error"), [f"{f}:2: <row>", "not usable JSON"]


@case("model-path-missing")
def _(tmp, model):
    return args(tmp, model, None, None, f"actor_rollout_ref.model.path={tmp / 'nomodel'}"), \
        ["actor_rollout_ref.model.path", "no such model directory", "nomodel"]


@case("model-path-is-a-file")
def _(tmp, model):
    f = write(tmp / "model.bin", b"\0" * 16)
    return args(tmp, model, None, None, f"actor_rollout_ref.model.path={f}"), \
        ["actor_rollout_ref.model.path", f"{f} is a file"]


@case("tokenizer_path-is-a-file")
def _(tmp, model):
    return args(tmp, model, None, None,
                f"actor_rollout_ref.model.tokenizer_path={model / 'tokenizer.json'}"), \
        ["actor_rollout_ref.model.tokenizer_path", "tokenizer.json is a file"]


@case("tokenizer_path-without-tokenizer-files")
def _(tmp, model):
    (tmp / "emptytok").mkdir()
    tok = f"actor_rollout_ref.model.tokenizer_path={tmp / 'emptytok'}"
    return args(tmp, model, None, None, tok), \
        ["actor_rollout_ref.model.tokenizer_path", "emptytok holds no tokenizer"]


@case("tokenizer-json-corrupt")
def _(tmp, model):
    tok = tmp / "badtok"
    tok.mkdir()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (model / name).exists():
            (tok / name).write_bytes((model / name).read_bytes())
    write(tok / "tokenizer.json", (model / "tokenizer.json").read_bytes()[:200])
    return args(tmp, model, None, None, f"actor_rollout_ref.model.tokenizer_path={tok}"), \
        ["actor_rollout_ref.model.tokenizer_path", "cannot load the tokenizer", str(tok)]


@case("resume_from_path-is-a-file")
def _(tmp, model):
    f = write(tmp / "ckpt.pt", b"x")
    return args(tmp, model, None, None, "trainer.resume_mode=resume_path",
                f"trainer.resume_from_path={f}"), ["trainer.resume_from_path", "ckpt.pt is a file"]


@case("resume_from_path-without-driver-state")
def _(tmp, model):
    (tmp / "global_step_3").mkdir()
    return args(tmp, model, None, None, "trainer.resume_mode=resume_path",
                f"trainer.resume_from_path={tmp / 'global_step_3'}"), \
        ["trainer.resume_from_path", "global_step_3 has no driver_state.json"]


@case("resume_from_path-driver-state-half-written")
def _(tmp, model):
    d = tmp / "global_step_4"
    write(d / "driver_state.json", b'{"step": 4, "loader": {"ep')
    return args(tmp, model, None, None, "trainer.resume_mode=resume_path",
                f"trainer.resume_from_path={d}"), \
        ["trainer.resume_from_path", f"{d / 'driver_state.json'}: not readable JSON"]


@case("resume_from_path-driver-state-a-list")
def _(tmp, model):
    d = tmp / "global_step_5"
    write(d / "driver_state.json", b"[4]")
    return args(tmp, model, None, None, "trainer.resume_mode=resume_path",
                f"trainer.resume_from_path={d}"), ["driver_state.json", "integer `step`"]


@case("synthetic-data-dir-under-a-file")
def _(tmp, model):
    blocker = write(tmp / "datafile", b"x")
    return args(tmp, model, blocker / "data" / "train.jsonl", None,
                "data.synthetic_task=quickstart"), ["data.train_files", f"{blocker} is a file"]


@case("torchrun-launcher-bad-val-parquet")
def _(tmp, model):
    f = write(tmp / "val.parquet", b"PAR1" + b"\x07" * 64 + b"PAR1")
    return args(tmp, model, None, f, "trainer.launcher=torchrun"), \
        ["data.val_files", str(f), "not a readable parquet file"]


# --- generated cases
def _bad_row_kinds() -> list[tuple[str, object, str, bool]]:
    """(name, row as written, field the error names, writable as parquet)."""
    def without(key):
        r = good_row(7)
        del r[key]
        return r

    def with_(**kw):
        r = good_row(7)
        r.update(kw)
        return r
    return [
        ("json-cut", '{"prompt": ', "<row>", False),
        ("json-array", "[1, 2]", "<row>", False),
        ("json-string", '"hello"', "<row>", False),
        ("json-null", "null", "<row>", False),
        ("json-number", "42", "<row>", False),
        ("json-trailing-comma", '{"prompt": "a",}', "<row>", False),
        ("json-two-objects", '{"a": 1} {"b": 2}', "<row>", False),
        ("json-bad-escape", '{"prompt": "\\q"}', "<row>", False),
        ("latin1-byte", b'{"prompt": "\xe9"}', "<row>", False),
        ("lone-continuation-byte", b'{"prompt": "\x80abc"}', "<row>", False),
        ("prompt-missing", without("prompt"), "prompt", False),
        ("prompt-null", with_(prompt=None), "prompt", True),
        ("prompt-number", with_(prompt=42), "prompt", False),
        ("prompt-object", with_(prompt={"role": "user"}), "prompt", False),
        ("prompt-blank", with_(prompt="   "), "prompt", False),
        ("prompt-no-messages", with_(prompt=[]), "prompt", True),
        ("message-not-object", with_(prompt=["hi"]), "prompt", False),
        ("message-no-role", with_(prompt=[{"content": "hi"}]), "prompt", False),
        ("message-role-int", with_(prompt=[{"role": 1, "content": "hi"}]), "prompt", False),
        ("message-no-content", with_(prompt=[{"role": "user"}]), "prompt", False),
        ("message-content-list", with_(prompt=[{"role": "user", "content": ["x"]}]),
         "prompt", False),
        ("messages-all-empty", with_(prompt=[{"role": "user", "content": " "}]), "prompt", True),
        ("data_source-missing", without("data_source"), "data_source", False),
        ("data_source-null", with_(data_source=None), "data_source", True),
        ("data_source-empty", with_(data_source=""), "data_source", True),
        ("data_source-number", with_(data_source=3), "data_source", False),
        ("reward_model-missing", without("reward_model"), "reward_model", False),
        ("reward_model-null", with_(reward_model=None), "reward_model", True),
        ("reward_model-string", with_(reward_model="7"), "reward_model", False),
        ("ground_truth-missing", with_(reward_model={"style": "rule"}),
         "reward_model.ground_truth", False),
        ("ground_truth-null", with_(reward_model={"style": "rule", "ground_truth": None}),
         "reward_model.ground_truth", True),
        ("style-number", with_(reward_model={"ground_truth": "1", "style": 5}),
         "reward_model.style", False),
        ("extra_info-list", with_(extra_info=[1]), "extra_info", False),
        ("extra_info-string", with_(extra_info="x"), "extra_info", False),
    ]


def _gen_bad_rows(rng: random.Random, count: int) -> None:
    kinds = _bad_row_kinds()
    for i in range(count):
        # Every kind once, then kinds drawn at random.
        name, bad, field, parquet_ok = kinds[i] if i < len(kinds) else rng.choice(kinds)
        n = rng.randint(1, 7)
        k = rng.randint(1, n)  # 1-based row of the bad row
        as_parquet = parquet_ok and rng.random() < 0.5
        # With skip, a bad row among good ones is dropped with a warning (not an error); a
        # file with no good row is an error in both modes.
        bad_rows = "error" if n > 1 else rng.choice(["error", "skip"])

        def build(tmp, model, name=name, bad=bad, field=field, n=n, k=k,
                  as_parquet=as_parquet, bad_rows=bad_rows):
            rows = [good_row(i) for i in range(n)]
            rows[k - 1] = bad
            if as_parquet:
                f = write_parquet(tmp / f"{name}.parquet", rows)
            else:
                f = write(tmp / f"{name}.jsonl", jsonl_bytes(rows))
            return args(tmp, model, f, None, f"data.bad_rows={bad_rows}",
                        "data.train_batch_size=1"), [f"{f}:{k}: {field}:"]
        fmt = "parquet" if as_parquet else "jsonl"
        case(f"gen-bad-row-{i:02d}-{name}-{fmt}-row{k}of{n}-{bad_rows}")(build)


def _gen_jsonl_corruption(rng: random.Random, count: int) -> None:
    kinds = ["bad-utf8", "truncate", "drop-structural", "nul", "random-blob", "gzip-magic"]
    for i in range(count):
        kind = kinds[i % len(kinds)]
        n = rng.randint(2, 8)
        k = rng.randint(1, n)
        seed = rng.randrange(2**32)

        def build(tmp, model, kind=kind, n=n, k=k, seed=seed):
            r = random.Random(seed)
            lines = [json.dumps(good_row(j)).encode() for j in range(n)]
            f = tmp / f"corrupt-{kind}.jsonl"
            line = lines[k - 1]
            if kind == "bad-utf8":
                pos = r.randrange(len(line) + 1)
                lines[k - 1] = line[:pos] + bytes([r.choice([0x80, 0xbf, 0xc3, 0xff, 0xfe])]) \
                    + line[pos:]
            elif kind == "truncate":
                # Cut inside row k: no proper prefix of a JSON object is valid JSON.
                lines = lines[:k - 1] + [line[:r.randrange(1, len(line))]]
            elif kind == "drop-structural":
                spots = [j for j, c in enumerate(line) if c in b'{}:"']
                j = r.choice(spots)
                lines[k - 1] = line[:j] + line[j + 1:]
            if kind in ("bad-utf8", "truncate", "drop-structural"):
                write(f, b"\n".join(lines) + b"\n")
                return args(tmp, model, f, None, "data.bad_rows=error",
                            "data.train_batch_size=1"), [f"{f}:{k}: <row>:"]
            if kind == "nul":
                data = bytearray(b"\n".join(lines))
                data.insert(r.randrange(len(data)), 0)
                write(f, bytes(data))
            elif kind == "random-blob":
                write(f, r.randbytes(r.randint(64, 4096)) + b"\x00")
            else:
                write(f, b"\x1f\x8b\x08\x00" + r.randbytes(200))
            return args(tmp, model, f), [str(f), "not JSON-lines text"]
        case(f"gen-jsonl-{i:02d}-{kind}-row{k}of{n}")(build)


def _gen_parquet_corruption(rng: random.Random, count: int) -> None:
    kinds = ["truncate", "footer-length", "random-bytes", "magic-only", "zero-bytes",
             "tail-magic-gone"]
    for i in range(count):
        kind = kinds[i % len(kinds)]
        seed = rng.randrange(2**32)
        split = rng.choice(["train", "val"])

        def build(tmp, model, kind=kind, seed=seed, split=split):
            r = random.Random(seed)
            data = write_parquet(tmp / "whole.parquet",
                                 [good_row(j) for j in range(r.randint(2, 20))]).read_bytes()
            f = tmp / f"{kind}.parquet"
            if kind == "truncate":
                write(f, data[:r.randrange(1, len(data))])
            elif kind == "footer-length":  # the 4 bytes before the closing magic
                write(f, data[:-8] + r.randbytes(4) + b"PAR1")
            elif kind == "random-bytes":
                write(f, r.randbytes(r.randint(1, 2048)))
            elif kind == "magic-only":
                write(f, b"PAR1" * r.randint(1, 3))
            elif kind == "zero-bytes":
                write(f, b"")
            else:
                write(f, data[:-4] + r.randbytes(4))
            what = "not a readable parquet file"
            if split == "train":
                return args(tmp, model, f), ["data.train_files", str(f), what]
            return args(tmp, model, None, f), ["data.val_files", str(f), what]
        case(f"gen-parquet-{i:02d}-{kind}-{split}")(build)


def _gen_paths(rng: random.Random, count: int) -> None:
    keys = ["data.train_files", "data.val_files", "trainer.default_local_dir",
            "actor_rollout_ref.model.tokenizer_path", "actor_rollout_ref.model.path",
            "trainer.resume_from_path"]
    for i in range(count):
        key = keys[i % len(keys)]
        shape = rng.choice(["missing", "wrong-kind"])
        name = "".join(rng.choice("abcxyz_-0123") for _ in range(rng.randint(1, 12)))

        def build(tmp, model, key=key, shape=shape, name=name):
            wants_dir = key not in ("data.train_files", "data.val_files")
            p = tmp / "p" / (name if wants_dir else f"{name}.jsonl")
            p.parent.mkdir(exist_ok=True)
            value = p
            if shape == "wrong-kind":  # a file where a directory is expected, and vice versa
                if wants_dir:
                    write(p, b"{}")
                    if key == "trainer.default_local_dir":
                        value = p / "sub"  # the run would have to make a dir under a file
                else:
                    p.mkdir()
            elif key == "trainer.default_local_dir":
                # A missing output dir is simply made; one under a file cannot be.
                p = write(tmp / "p" / "file", b"")
                value = p / name
            extra = [f"{key}={value}"]
            if key == "trainer.resume_from_path":
                extra.append("trainer.resume_mode=resume_path")
            return args(tmp, model, None, None, *extra), [key, str(p)]
        case(f"gen-path-{i:02d}-{key}-{shape}")(build)


_rng = random.Random(SEED)
_gen_bad_rows(_rng, 40)
_gen_jsonl_corruption(_rng, 18)
_gen_parquet_corruption(_rng, 12)
_gen_paths(_rng, 12)


# ------------------------------------------------------------------ the checks
@pytest.fixture()
def no_driver(monkeypatch):
    """The controller and the torchrun launcher, replaced by modules that fail the test if a
    bad input ever gets as far as starting a run."""
    reached = []

    def refuse(*a, **k):
        reached.append(a)
        raise AssertionError("the run started: the bad input was not caught before Ray")
    driver = types.ModuleType("megarl.controller.driver")
    driver.run = refuse
    torchrun = types.ModuleType("megarl.cluster.torchrun")
    torchrun.main = refuse
    monkeypatch.setitem(sys.modules, "megarl.controller.driver", driver)
    monkeypatch.setitem(sys.modules, "megarl.cluster.torchrun", torchrun)
    import megarl.cluster
    monkeypatch.setattr(megarl.cluster, "torchrun", torchrun, raising=False)
    return reached


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_before_ray(name, tmp_path, qwen_dir, no_driver, capsys,
                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)  # any relative default (outputs/...) lands in the sandbox
    argv, expected = CASES[name](tmp_path, Path(qwen_dir))
    if argv[0] != "validate":
        argv = ["train", *argv]
    ray_before = "ray" in sys.modules
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert not no_driver
    if not ray_before:
        assert "ray" not in sys.modules, "ray was imported by the checks"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"megarl {argv[0]}: ")
    for text in expected:
        assert text in lines[0], (text, lines[0])


def test_the_suite_is_large_and_holds_every_listed_case():
    assert len(CASES) >= 50
    listed = ["unwritable-default_local_dir", "missing-tokenizer_path", "missing-resume_from_path",
              "non-utf8-bytes-in-jsonl", "binary-jsonl", "fake-parquet", "truncated-parquet",
              "overlong-prompt-truncation-error", "bad-rows-error"]
    assert [f"issue-{x}" for x in listed if f"issue-{x}" not in CASES] == []


# ------------------------------------------------------------------ from outside
@pytest.mark.parametrize("name", ["issue-missing-tokenizer_path", "issue-truncated-parquet",
                                  "issue-overlong-prompt-truncation-error"])
def test_cli_subprocess_fails_fast_without_ray(name, tmp_path, qwen_dir):
    argv, expected = CASES[name](tmp_path, Path(qwen_dir))
    ray_tmp = tmp_path / "ray-tmp"
    env = dict(os.environ, RAY_TMPDIR=str(ray_tmp), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "megarl.cli", "train", *argv], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("megarl train: ") and all(t in last for t in expected), last
    assert not ray_tmp.exists(), "Ray was started"
    # Generous: CI shares two cores; a run that got as far as Ray would take far longer.
    assert elapsed < 60, f"took {elapsed:.1f} s to refuse a bad input"
