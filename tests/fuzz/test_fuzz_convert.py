"""Fuzz `megarl convert` inputs: every damaged file is refused with one line naming it.

Each case damages one input (config.json, a safetensors file, megarl_meta.json, the
dist-checkpoint's `.metadata` / `.distcp` / `common.pt`, the output location) and runs the real
converter entry point without --dry-run, so a case that slipped through would go on to start
ranks. Each must exit 2 with a single `error:` line that names the damaged file and what is
wrong, before any rank starts (no torch.distributed world, no WORLD_SIZE set by
`ensure_world`) and without writing the output. The issue's listed cases come first, then
seeded corruptions (random.Random(17), a fixed count).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from megarl.convert.cli import hf_to_megatron_main, megatron_to_hf_main, reshard_main

ROOT = Path(__file__).resolve().parents[2]
ST = "model.safetensors"


# ----------------------------------------------------------------------------- file surgery
def _rewrite_json(path: Path, fn) -> None:
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def _set_config(**fields):
    def edit(d: Path) -> str:
        _rewrite_json(d / "config.json", lambda c: {**c, **fields})
        return "config.json"
    return edit


def _write_bytes(name: str, data: bytes):
    def edit(d: Path) -> str:
        (d / name).write_bytes(data)
        return name
    return edit


def _truncate(name: str, keep: int | None = None, frac: float | None = None):
    def edit(d: Path) -> str:
        raw = (d / name).read_bytes()
        (d / name).write_bytes(raw[:keep if keep is not None else int(len(raw) * frac)])
        return name
    return edit


def _split_st(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join_st(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _edit_header(fn):
    """Change the parsed safetensors header (fn(header) mutates it), keeping its length field
    consistent, so only the meaning of the header is wrong."""
    def edit(d: Path) -> str:
        header, data = _split_st((d / ST).read_bytes())
        fn(header)
        (d / ST).write_bytes(_join_st(header, data))
        return ST
    return edit


def _set_length_field(value: int):
    def edit(d: Path) -> str:
        raw = (d / ST).read_bytes()
        (d / ST).write_bytes(struct.pack("<Q", value) + raw[8:])
        return ST
    return edit


def _zero_header_json(d: Path) -> str:
    raw = (d / ST).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    (d / ST).write_bytes(raw[:8] + b"\0" * n + raw[8 + n:])
    return ST


def _index_edit(weight_map_fn):
    """Replace model.safetensors by an index whose weight_map is weight_map_fn(real map)."""
    def edit(d: Path) -> str:
        header, _ = _split_st((d / ST).read_bytes())
        real = {k: ST for k in header if k != "__metadata__"}
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map_fn(real)}))
        return "model.safetensors.index.json"
    return edit


def _out_under_a_file(d: Path) -> str:
    (d / "blocker").write_text("a file where a directory is needed")
    return "blocker"


# ----------------------------------------------------------------------------- the cases
# (id, side, edit(dir) -> name of the damaged file, expected words, extra argv)
# side "hf": edits a copy of the HF model; "ckpt": a copy of the converted checkpoint.
LISTED = [
    ("config-is-a-list", "hf", _write_bytes("config.json", b"[1, 2, 3]"),
     "must be a JSON object", []),
    ("hidden_size-a-string", "hf", _set_config(hidden_size="64"),
     "hidden_size='64' must be a positive integer", []),
    ("num_attention_heads-0", "hf", _set_config(num_attention_heads=0),
     "num_attention_heads=0 must be a positive integer", []),
    ("negative-layers-dry-run", "hf", _set_config(num_hidden_layers=-2),
     "num_hidden_layers=-2 must be a positive integer", ["--dry-run"]),
    ("safetensors-truncated", "hf", _truncate(ST, frac=0.5), "not a range within", []),
    ("safetensors-emptied", "hf", _write_bytes(ST, b""), "truncated (0 bytes", []),
    ("safetensors-length-zeroed", "hf", _set_length_field(0), "header length 0", []),
    ("safetensors-header-zeroed", "hf", _zero_header_json, "header is not valid JSON", []),
    ("safetensors-length-2**62", "hf", _set_length_field(2 ** 62),
     f"header length {2 ** 62} does not fit", []),
    ("meta-invalid-json", "ckpt", _write_bytes("megarl_meta.json", b'{"tp": 1,'),
     "not valid JSON", []),
    ("meta-a-list", "ckpt", _write_bytes("megarl_meta.json", b"[]"),
     "must be a JSON object", []),
    ("metadata-truncated", "ckpt", _truncate(".metadata", frac=0.5),
     "cannot be read, truncated or damaged", []),
    ("distcp-truncated", "ckpt", _truncate("__0_0.distcp", frac=0.5), "truncated", []),
    ("out-cannot-be-created", "hf", _out_under_a_file, "cannot be created", ["@out-under-file"]),
    ("three-layers-at-pp2", "hf", _set_config(num_hidden_layers=3),
     ("num_hidden_layers=3 is not divisible by PP=2 (every pipeline stage holds the same "
      "number of layers; uneven stages are not supported)"), ["--pp", "2"]),
]

MORE = [
    ("config-missing", "hf", lambda d: (d / "config.json").unlink() or ".",
     "no config.json", []),
    ("config-not-utf8", "hf", _write_bytes("config.json", b'{"a": "\xff\xfe"}'),
     "not UTF-8", []),
    ("config-not-json", "hf", _write_bytes("config.json", b"{vocab_size: 3"), "not valid JSON",
     []),
    ("config-deeply-nested", "hf", _write_bytes("config.json", b"[" * 100000 + b"]" * 100000),
     "config.json", []),
    ("architectures-a-string", "hf", _set_config(architectures="Qwen2ForCausalLM"),
     "architectures='Qwen2ForCausalLM' must be a list", []),
    ("architectures-unknown", "hf", _set_config(architectures=["GPT2LMHeadModel"]),
     "supported are", []),
    ("rope_scaling-a-list", "hf", _set_config(rope_scaling=[1, 2]),
     "rope_scaling=[1, 2] must be an object", []),
    ("rope-yarn", "hf", _set_config(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     "supported are plain RoPE and rope_type llama3", []),
    ("rope-llama3-other-band", "hf", _set_config(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 5e5}),
     "rope_scaling.low_freq_factor=2.0: Megatron-core's llama3 RoPE supports 1 only", []),
    ("rope-llama3-no-factor", "hf", _set_config(rope_parameters={"rope_type": "llama3"}),
     "rope_scaling.factor=None: llama3 RoPE needs a positive number", []),
    ("kv-heads-not-dividing-heads", "hf", _set_config(num_key_value_heads=3),
     "num_attention_heads=4 is not a multiple of num_key_value_heads=3", []),
    ("hidden-not-divisible-by-heads", "hf", _set_config(hidden_size=66),
     "hidden_size=66 is not divisible by num_attention_heads=4", []),
    ("tp-not-dividing-heads", "hf", lambda d: "config.json",
     "num_attention_heads=4 is not divisible by TP=3", ["--tp", "3"]),
    ("no-weights", "hf", lambda d: (d / ST).unlink() or ".",
     "no model.safetensors or model.safetensors.index.json", []),
    ("index-not-an-object", "hf", _write_bytes("model.safetensors.index.json", b"[]"),
     "weight_map must be an object", []),
    ("index-names-missing-file", "hf",
     _index_edit(lambda m: {**m, "model.norm.weight": "model-00009.safetensors"}),
     "model-00009.safetensors", []),
    ("index-maps-a-tensor-the-file-lacks", "hf",
     _index_edit(lambda m: {**m, "model.extra.weight": ST}), "does not hold it", []),
    ("out-on-a-pseudo-fs", "hf", lambda d: ".", "cannot be created", ["@out=/sys/megarl-out"]),
    ("out-is-a-file", "hf", lambda d: (d / "f").write_text("x") and "f", "not a directory",
     ["@out-is-file"]),
    ("meta-params_dtype", "ckpt", lambda d: _rewrite_json(
        d / "megarl_meta.json", lambda m: {**m, "params_dtype": "int4"}) or "megarl_meta.json",
     "params_dtype='int4' is not one of", []),
    ("meta-tp-a-string", "ckpt", lambda d: _rewrite_json(
        d / "megarl_meta.json", lambda m: {**m, "tp": "two"}) or "megarl_meta.json",
     "tp='two' must be a positive integer", []),
    ("meta-vocab-divisor-0", "ckpt", lambda d: _rewrite_json(
        d / "megarl_meta.json", lambda m: {**m, "make_vocab_size_divisible_by": 0})
     or "megarl_meta.json", "make_vocab_size_divisible_by=0 must be a positive integer", []),
    ("ckpt-config-a-list", "ckpt", _write_bytes("hf/config.json", b"[]"),
     "must be a JSON object", []),
    ("ckpt-config-missing", "ckpt", lambda d: (d / "hf" / "config.json").unlink() or "hf",
     "no config.json", []),
    ("metadata-missing", "ckpt", lambda d: (d / ".metadata").unlink() or ".metadata",
     "missing", []),
    ("metadata-garbage", "ckpt", _write_bytes(".metadata", b"not a pickle at all"),
     "cannot be read", []),
    ("distcp-missing", "ckpt", lambda d: (d / "__0_1.distcp").unlink() or "__0_1.distcp",
     "missing (named by", []),
    ("distcp-emptied", "ckpt", _write_bytes("__0_1.distcp", b""), "truncated (0 bytes", []),
    ("common-pt-truncated", "ckpt", _truncate("common.pt", frac=0.7),
     "not a readable torch file", []),
    ("megatron-metadata-json-a-list", "ckpt", _write_bytes("metadata.json", b"[]"),
     "must be a JSON object", []),
    ("ckpt-layout-pp3", "ckpt", lambda d: "hf/config.json",
     "num_hidden_layers=2 is not divisible by PP=3", ["--pp", "3"]),
]


def _generated() -> list:
    """Seeded corruptions: config.json field types and ranges, safetensors lengths, headers
    and truncations, checkpoint truncations at random offsets."""
    rng = random.Random(17)
    cases = []
    bad_values = {
        "int": ["64", -1, 0, 2.5, True, [], {}, float("nan"), -(2 ** 40)],
        "float": ["1e-6", -1.0, 0, True, [], {}, float("inf"), float("nan")],
        "bool": ["yes", 1, 0, [], "true"],
    }
    from megarl.convert.inputs import _FIELDS

    fields = sorted(_FIELDS)
    for i in range(36):
        field = fields[i % len(fields)]
        kind = _FIELDS[field][1]
        value = rng.choice(bad_values[kind])
        cases.append((f"gen-config-{i}-{field}", "hf", _set_config(**{field: value}),
                      f"{field}=", []))
    for i, field in enumerate(f for f in fields if _FIELDS[f][0]):
        cases.append((f"gen-config-drop-{field}", "hf",
                      lambda d, f=field: _rewrite_json(
                          d / "config.json",
                          lambda c: {k: v for k, v in c.items() if k != f}) or "config.json",
                      f"missing field {field!r}", []))
    for i in range(16):
        frac = rng.random()
        cases.append((f"gen-st-truncate-{i}-{frac:.3f}", "hf", _truncate(ST, frac=frac), ST, []))
    for i in range(8):
        keep = rng.randrange(0, 8)
        cases.append((f"gen-st-truncate-head-{i}-{keep}", "hf", _truncate(ST, keep=keep),
                      "truncated", []))
    for i in range(12):
        # A wrong header length: shorter cuts the JSON, longer swallows data bytes or
        # runs past the end.
        delta = rng.choice([-1, 1]) * rng.randrange(1, 4096)
        def wrong_length(d, delta=delta):
            raw = (d / ST).read_bytes()
            (n,) = struct.unpack("<Q", raw[:8])
            (d / ST).write_bytes(struct.pack("<Q", max(1, n + delta)) + raw[8:])
            return ST
        cases.append((f"gen-st-length-{i}-{delta:+d}", "hf", wrong_length, ST, []))
    for i in range(8):
        value = rng.randrange(2 ** 27, 2 ** 64)
        cases.append((f"gen-st-length-huge-{i}", "hf", _set_length_field(value),
                      "header length", []))

    def tensor_edit(kind: str, r: random.Random):
        def mutate(h: dict) -> None:
            name = r.choice(sorted(k for k in h if k != "__metadata__"))
            e = h[name]
            if kind == "shape-grow":
                e["shape"] = [*e["shape"][:-1], e["shape"][-1] + r.randrange(1, 9)]
            elif kind == "shape-negative":
                e["shape"] = [-1, *e["shape"]]
            elif kind == "shape-string":
                e["shape"] = "64"
            elif kind == "dtype-unknown":
                e["dtype"] = r.choice(["F33", "float32", "", None])
            elif kind == "dtype-narrower":
                e["dtype"] = "F16"
            elif kind == "offsets-past-end":
                b, end = e["data_offsets"]
                e["data_offsets"] = [b + 10 ** 9, end + 10 ** 9]
            elif kind == "offsets-swapped":
                b, end = e["data_offsets"]
                e["data_offsets"] = [end, b] if end != b else [b + 1, b]
            elif kind == "offsets-three":
                e["data_offsets"] = [*e["data_offsets"], 0]
            elif kind == "offsets-shifted":
                b, end = e["data_offsets"]
                e["data_offsets"] = [b + 4, end + 4]
            elif kind == "entry-a-list":
                h[name] = [1, 2]
            elif kind == "drop-offsets":
                del e["data_offsets"]
        return mutate

    kinds = ["shape-grow", "shape-negative", "shape-string", "dtype-unknown", "dtype-narrower",
             "offsets-past-end", "offsets-swapped", "offsets-three", "offsets-shifted",
             "entry-a-list", "drop-offsets"]
    for i in range(22):
        kind = kinds[i % len(kinds)]
        cases.append((f"gen-st-header-{i}-{kind}", "hf",
                      _edit_header(tensor_edit(kind, random.Random(rng.random()))), ST, []))
    for i in range(8):
        name = rng.choice(["__0_0.distcp", "__0_1.distcp"])
        frac = rng.random() * 0.999
        cases.append((f"gen-distcp-truncate-{i}-{name}-{frac:.3f}", "ckpt",
                      _truncate(name, frac=frac), "truncated", []))
    for i in range(8):
        frac = rng.random() * 0.999
        cases.append((f"gen-metadata-truncate-{i}-{frac:.3f}", "ckpt",
                      _truncate(".metadata", frac=frac), ".metadata", []))
    for i in range(6):
        cut = rng.randrange(1, 40)
        cases.append((f"gen-meta-cut-{i}-{cut}", "ckpt",
                      lambda d, cut=cut: _truncate("megarl_meta.json",
                                                   keep=max(0, (d / "megarl_meta.json").stat()
                                                            .st_size - cut))(d),
                      "megarl_meta.json", []))
    return cases


CASES = LISTED + MORE + _generated()


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpt(tiny_qwen2, tmp_path_factory) -> Path:
    """A real megarl Megatron checkpoint (hf2mcore at TP=1), made once for the module."""
    out = tmp_path_factory.mktemp("fuzz-convert") / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    subprocess.run([sys.executable, str(ROOT / "tools" / "convert_hf_to_megatron.py"),
                    "--hf-dir", str(tiny_qwen2), "--out", str(out)], env=env, check=True,
                   capture_output=True, timeout=300)
    return out


def _out_arg(tmp_path: Path, extra: list[str]) -> tuple[Path, list[str]]:
    argv, out = [], tmp_path / "out"
    for a in extra:
        if a == "@out-under-file":
            out = tmp_path / "src" / "blocker" / "out"
        elif a == "@out-is-file":
            out = tmp_path / "src" / "f"
        elif a.startswith("@out="):
            out = Path(a[len("@out="):])
        else:
            argv.append(a)
    return out, argv


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_damaged_input_is_refused_in_one_line(case, tiny_qwen2, ckpt, tmp_path, capsys,
                                              monkeypatch):
    cid, side, edit, needle, extra = case
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    src = tmp_path / "src"
    shutil.copytree(tiny_qwen2 if side == "hf" else ckpt, src)
    damaged = edit(src)
    out, argv = _out_arg(tmp_path, extra)
    if side == "hf":
        main, flags = hf_to_megatron_main, ["--hf-dir", str(src)]
    else:
        # Both checkpoint readers run the same checks; alternate between them.
        main, flags = (megatron_to_hf_main if len(cid) % 2 else reshard_main), \
            ["--ckpt", str(src)]
    before = set(out.parent.iterdir()) if out.parent.is_dir() else None
    assert main([*flags, "--out", str(out), *argv]) == 2, cid
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert needle in lines[0], (needle, lines[0])
    named = src if damaged == "." else src / damaged
    assert str(named) in lines[0] or str(out) in lines[0], (named, lines[0])
    # Stopped before any rank: no world, and ensure_world never ran.
    assert not dist.is_initialized() and "WORLD_SIZE" not in os.environ
    if out.parent.is_dir() and before is not None:
        assert set(out.parent.iterdir()) == before  # no output, no temp or probe left


def test_fuzz_covers_enough_cases():
    assert len(CASES) >= 50 and len({c[0] for c in CASES}) == len(CASES)


def test_the_real_command_exits_2_without_a_traceback(tiny_qwen2, tmp_path):
    """Through `python -m megarl.cli convert`, as a user types it: the listed
    ZeroDivisionError case ends as one line and exit status 2."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen2, bad)
    _rewrite_json(bad / "config.json", lambda c: {**c, "num_attention_heads": 0})
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "convert", "hf2mcore", "--hf-dir",
                           str(bad), "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"error: {bad / 'config.json'}: num_attention_heads=0 must "
                                   "be a positive integer")
    assert not (tmp_path / "out").exists()
