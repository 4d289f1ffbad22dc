"""Checks of a model's files, made in the launching process before any rank starts.

Owns what a conversion (and a training run) may assume about its inputs:

- config.json: a JSON object whose fields have the types and ranges `ModelArgs` needs;
- safetensors files: the 8-byte header length fits the file, the header parses, and every
  tensor's byte range lies inside the file and matches its dtype and shape;
- a megarl Megatron checkpoint: `megarl_meta.json`, the dist-checkpoint's `.metadata` (it
  unpickles) and every byte range it names inside the `.distcp` files (the files are long
  enough), `common.pt` and `metadata.json` readable;
- `check_layout`: the one rule set for splitting a model over TP×PP (and a mixture of
  experts' experts over EP×ETP), with config.json's reading (`read_model_args`), defined
  beside the Megatron backend that also needs them (`megarl/backends/megatron/hf/
  model_config.py`) and re-exported here.

Only headers and metadata are read, never tensor payloads: a flipped byte inside a tensor is
for checksums to find. Every problem is a `ConvertError` whose one-line message names the file
(and field or tensor) and what is wrong.
"""
from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import zipfile
from pathlib import Path

from megarl.backends.megatron.hf.model_config import (  # noqa: F401 (re-exported)
    _FIELDS, ConvertError, _field_problem, _one_line, check_layout, layout_error, model_args,
    read_json,
    read_model_args)
from megarl.backends.megatron.model import DTYPES, ModelArgs

META = "megarl_meta.json"  # same name as megarl.backends.megatron.checkpoint.META
SAFETENSORS_INDEX = "model.safetensors.index.json"
# The safetensors library refuses headers over 100 MB; so do we, before reading one.
MAX_SAFETENSORS_HEADER = 100_000_000
SAFETENSORS_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
                        "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                        "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}



# ------------------------------------------------------------------------- safetensors
def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of one safetensors file, its layout checked against the
    file size (what the library checks when it opens the file, as one-line messages)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConvertError(f"{path}: truncated ({size} bytes; a safetensors file "
                                   f"starts with an 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_SAFETENSORS_HEADER or 8 + n > size:
                raise ConvertError(f"{path}: header length {n} does not fit the file ({size} "
                                   f"bytes; the header must be 1..{MAX_SAFETENSORS_HEADER} bytes "
                                   f"inside it): truncated or not safetensors")
            raw = f.read(n)
    except OSError as err:
        raise ConvertError(f"{path}: cannot be read ({err.strerror or _one_line(err)})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ConvertError(f"{path}: header is not valid JSON ({_one_line(err)})") from None
    if not isinstance(header, dict):
        raise ConvertError(f"{path}: header must be a JSON object")
    data_bytes = size - 8 - n
    out, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise ConvertError(f"{where}: header entry must be an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in SAFETENSORS_ITEMSIZE:
            raise ConvertError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ConvertError(f"{where}: shape {shape!r} must be a list of sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise ConvertError(f"{where}: data_offsets {offsets!r} must be [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            raise ConvertError(f"{where}: data_offsets [{begin}, {end}] are not a range "
                               f"within the file's {data_bytes} data bytes (truncated or "
                               f"damaged)")
        want = math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]
        if end - begin != want:
            raise ConvertError(f"{where}: {end - begin} data bytes, but {dtype} {tuple(shape)} "
                               f"needs {want}")
        out[name] = (dtype, tuple(shape))
        spans.append((begin, end))
    # The library also insists the tensors tile the data area exactly (no gaps, no overlap).
    pos = 0
    for begin, end in sorted(spans):
        if begin != pos:
            raise ConvertError(f"{path}: tensor data is not contiguous (a gap or overlap at "
                               f"byte {pos} of the data area)")
        pos = end
    if pos != data_bytes:
        raise ConvertError(f"{path}: {data_bytes} data bytes after the header, but the tensors "
                           f"account for {pos}")
    return out


def hf_weights(model_dir: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """{HF tensor name: (file, dtype, shape)} of a model directory, every file checked."""
    index, single = model_dir / SAFETENSORS_INDEX, model_dir / "model.safetensors"
    if index.is_file():
        doc = read_json(index)
        wmap = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise ConvertError(f"{index}: weight_map must be an object of tensor name -> file")
        files = {}
        for fname in sorted(set(wmap.values())):
            path = model_dir / fname
            if Path(fname).name != fname or not path.is_file():
                raise ConvertError(f"{index}: weight_map names {fname!r}, which is not a file "
                                   f"in {model_dir}")
            files[fname] = safetensors_header(path)
        out = {}
        for name, fname in wmap.items():
            if name not in files[fname]:
                raise ConvertError(f"{index}: tensor {name!r} is mapped to {fname}, which does "
                                   f"not hold it")
            out[name] = (model_dir / fname, *files[fname][name])
        return out
    if single.is_file():
        return {k: (single, *v) for k, v in safetensors_header(single).items()}
    raise ConvertError(f"{model_dir}: no model.safetensors or {SAFETENSORS_INDEX} (no weights)")


def check_hf_dir(model_dir: str | os.PathLike, tp: int = 1, pp: int = 1,
                 what: str = "model directory") -> tuple[ModelArgs, dict]:
    """Everything a Megatron worker or hf2mcore reads from an HF model directory: config.json,
    the TP×PP layout, and every tensor config.json implies present with its shape.
    Returns (args, hf_weights)."""
    from .plan import hf_shapes  # plan imports this module

    model_dir = Path(model_dir)
    a = read_model_args(model_dir, what)
    check_layout(a, tp, pp, str(model_dir / "config.json"))
    weights = hf_weights(model_dir)
    want = hf_shapes(a)
    for name, (path, _, shape) in sorted(weights.items()):
        if name in want and shape != want[name]:
            raise ConvertError(f"{path}: tensor {name} has shape {shape}, config.json implies "
                               f"{want[name]}")
    missing = [n for n in want if n not in weights]
    if missing:
        raise ConvertError(f"{what} {model_dir}: {len(missing)} tensor(s) that config.json "
                           f"implies are missing, e.g. {missing[:3]}")
    return a, weights


# ------------------------------------------------------------------------- Megatron checkpoint
def read_meta(ckpt: Path) -> dict:
    """`megarl_meta.json` of a checkpoint, its layout fields checked."""
    f = ckpt / META
    if not ckpt.is_dir():
        raise ConvertError(f"--ckpt {ckpt}: no such directory (a megarl checkpoint with "
                           f"{META} expected)")
    if not f.is_file():
        raise ConvertError(f"--ckpt {ckpt}: not a megarl Megatron checkpoint (no {META})")
    meta = read_json(f)
    if not isinstance(meta, dict):
        raise ConvertError(f"{f}: must be a JSON object, got {type(meta).__name__}")
    # ep / etp: absent in checkpoints of a dense model or written before expert parallelism
    for key in ("tp", "pp", "ep", "etp", "world", "make_vocab_size_divisible_by"):
        if key in meta and _field_problem(meta[key], "int"):
            raise ConvertError(f"{f}: {key}={meta[key]!r} must be a positive integer")
    dtype = meta.get("params_dtype", "float32")
    if dtype not in DTYPES:
        raise ConvertError(f"{f}: params_dtype={dtype!r} is not one of {sorted(DTYPES)}")
    return meta


def dist_checkpoint_metadata(ckpt: Path):
    """The dist-checkpoint's `.metadata`, once every file it points into is long enough for
    the byte ranges it names (a truncated `.distcp` fails here, not inside a rank)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    path = ckpt / ".metadata"
    if not path.is_file():
        raise ConvertError(f"{path}: missing (not a dist-checkpoint?)")
    try:
        md = FileSystemReader(os.fspath(ckpt)).read_metadata()
    except Exception as err:  # noqa: BLE001 - an unpickler raises nearly anything on damage
        raise ConvertError(f"{path}: cannot be read, truncated or damaged "
                           f"({_one_line(err)})") from None
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise ConvertError(f"{path}: not dist-checkpoint metadata")
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or Path(rel).name != rel:
            raise ConvertError(f"{path}: names a storage file {rel!r} outside the checkpoint")
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(need.items()):
        f = ckpt / rel
        if not f.is_file():
            raise ConvertError(f"{f}: missing (named by {path})")
        size = f.stat().st_size
        if size < end:
            raise ConvertError(f"{f}: truncated ({size} bytes; {path.name} names data up to "
                               f"byte {end})")
    return md


def check_dist_checkpoint(ckpt: Path):
    """The dist-checkpoint's files: `.metadata` + `.distcp` sizes, `common.pt` and
    `metadata.json` (read_meta checks megarl's own file); returns the `.metadata`."""
    md = dist_checkpoint_metadata(ckpt)
    common = ckpt / "common.pt"
    if common.is_file():
        # torch.save writes a zip; a truncated one loses its central directory at the end.
        try:
            with zipfile.ZipFile(common) as z:
                z.namelist()
        except (zipfile.BadZipFile, OSError) as err:
            raise ConvertError(f"{common}: not a readable torch file, truncated or damaged "
                               f"({_one_line(err)})") from None
    if (ckpt / "metadata.json").is_file() and not isinstance(read_json(ckpt / "metadata.json"),
                                                            dict):
        raise ConvertError(f"{ckpt / 'metadata.json'}: must be a JSON object")
    return md


# ------------------------------------------------------------------------- output directory
def check_out_dir(out: Path, flag: str = "--out") -> None:
    """`out` can be written the way hf_io.atomic_dir writes it: a temp dir beside it, renamed.
    Probes by making (and at once removing) an empty temp dir where the first real one goes,
    since permission bits alone do not tell (root, read-only mounts, pseudo file systems)."""
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{flag} {out}: exists and is not a directory")
    base = out.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ConvertError(f"{flag} {out}: cannot be created ({base} is not a directory)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=base))
    except OSError as err:
        raise ConvertError(f"{flag} {out}: cannot be created in {base} "
                           f"({err.strerror or _one_line(err)})") from None
