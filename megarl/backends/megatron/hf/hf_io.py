"""Read and write HF safetensors checkpoints (single file or sharded with an index).

Writing goes to a temp directory beside the destination and is renamed into place at the end,
so an interrupted conversion never leaves a half-written model where a model is expected.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch

# Files besides weights that make a model directory loadable by transformers.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


class HFReader:
    """Lazy tensor access by HF name over one or many safetensors files."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            with open(index) as f:
                self.where = {k: self.dir / v for k, v in json.load(f)["weight_map"].items()}
        elif single.is_file():
            from safetensors import safe_open
            with safe_open(single, "pt") as f:
                self.where = {k: single for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.dir}: no model.safetensors or "
                                    "model.safetensors.index.json")
        self._open: dict[Path, object] = {}

    def keys(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.where:
            raise KeyError(f"{self.dir}: tensor {name!r} not in the checkpoint")
        path = self.where[name]
        if path not in self._open:
            self._open[path] = safe_open(path, "pt")
        return self._open[path].get_tensor(name)


def atomic_dir(dst: str | os.PathLike) -> Path:
    """A fresh temp directory beside `dst` (same filesystem, so the final rename is atomic)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))


def commit_dir(tmp: Path, dst: str | os.PathLike) -> None:
    """Move a finished temp directory into place, replacing an older `dst`."""
    dst = Path(dst)
    os.chmod(tmp, 0o755)
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)


def save_hf(dst: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]],
            side_files_from: str | os.PathLike | None = None,
            shard_bytes: int = 4 << 30, config_edit=None) -> Path:
    """Write HF-named tensors as safetensors shards (streamed: one shard in memory at a time).

    `config_edit(config dict) -> dict` rewrites the copied config.json (a critic's)."""
    from safetensors.torch import save_file

    tmp = atomic_dir(dst)
    try:
        weight_map, shard, size, files = {}, {}, 0, []

        def flush():
            nonlocal shard, size
            if shard:
                fname = f"model-{len(files) + 1:05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                files.append(fname)
                weight_map.update({k: fname for k in shard})
                shard, size = {}, 0

        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            if shard and size + nbytes > shard_bytes:
                flush()
            shard[name] = t.detach().to("cpu").contiguous().clone()
            size += nbytes
        flush()
        if len(files) == 1:
            os.replace(tmp / files[0], tmp / "model.safetensors")
        else:
            total = sum((tmp / f).stat().st_size for f in files)
            with open(tmp / "model.safetensors.index.json", "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                          indent=2)
        if side_files_from is not None:
            for fname in SIDE_FILES:
                src = Path(side_files_from) / fname
                if src.is_file():
                    shutil.copy2(src, tmp / fname)
        if config_edit is not None and (tmp / "config.json").is_file():
            cfg = json.loads((tmp / "config.json").read_text())
            (tmp / "config.json").write_text(json.dumps(config_edit(cfg), indent=2))
        commit_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(dst)
