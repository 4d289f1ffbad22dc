"""Verify mode (`rollout.verify_weight_sync`): do the engines hold what the trainer sent?

Owns what the trainer remembers of one version (`SentDigest`) and how an engine's
`/weights_checker` report is compared with it (`check_engine`). What a report can be compared
with depends on the engine, and each case has one stated meaning:

- megarl's embedded engine, and stock SGLang on a CPU with TP 1: every tensor the engine names
  as the trainer sent it, or as stock fuses it (`qkv_proj` = q, k, v and `gate_up_proj` =
  gate, up, concatenated on dim 0, so its bytes are the parts' bytes in order), is compared
  with the trainer's checksum of the same bytes: stock hashes CPU tensors with sha256 of the
  raw bytes (0.5.23 `managers/mm_utils.py` `tensor_hash`), as `tensor_checksum` does. A
  tensor whose dtype the engine changed on load (a bf16 server fed fp32), or whose rows it
  padded (stock pads the vocabulary of `embed_tokens`/`lm_head` to a multiple of 64,
  `layers/vocab_parallel_embedding.py`), is not comparable and is counted as skipped; buffers
  (rotary caches) were never sent.
- stock SGLang on a GPU, or with TP > 1: its checksums are Triton hashes (CUDA) of its own
  shards (TP), which nothing on the trainer computes. Such engines are compared with each
  other instead: engines of one layout serving one version must report the same checksums.
  With a single such engine nothing can be checked, and the log says so; verify mode never
  fails a version by construction.
"""
from __future__ import annotations

import hashlib
import re

import torch

from megarl.rollout.weights import tensor_checksum

FUSIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PART_OF = {part: fused for fused, parts in FUSIONS.items() for part in parts}
_PART = re.compile(r"^(.*)\.(" + "|".join(_PART_OF) + r")\.(weight|bias)$")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SentDigest:
    """Checksums (and dtypes) of the tensors of one version as the trainer sent them, plus
    those of stock SGLang's fused parameters, computed once all their parts went out."""

    def __init__(self):
        self.checksums: dict[str, str] = {}
        self.dtypes: dict[str, str] = {}
        self.rows: dict[str, int] = {}
        self._parts: dict[str, dict[str, torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self.checksums)

    def add(self, name: str, t: torch.Tensor) -> None:
        self.checksums[name] = tensor_checksum(t)
        self.dtypes[name] = dtype_name(t.dtype)
        self.rows[name] = int(t.shape[0]) if t.dim() else 1
        m = _PART.match(name)
        if m is None:
            return
        prefix, part, suffix = m.groups()
        fused = _PART_OF[part]
        key = f"{prefix}.{fused}.{suffix}"
        parts = self._parts.setdefault(key, {})
        parts[part] = t.detach().cpu().contiguous().clone()
        if len(parts) == len(FUSIONS[fused]):
            h = hashlib.sha256()
            dtypes = {p.dtype for p in parts.values()}
            for p in FUSIONS[fused]:
                h.update(memoryview(parts[p].reshape(-1).view(torch.uint8).numpy()))
            if len(dtypes) == 1:  # a concatenation of mixed dtypes is nothing stock holds
                self.checksums[key] = f"{int.from_bytes(h.digest()[:8], 'big'):016x}"
                self.dtypes[key] = dtype_name(dtypes.pop())
            del self._parts[key]


def direct(info: dict) -> bool:
    """Whether an engine's checksums can be compared with the trainer's (module docstring)."""
    if info.get("engine") == "megarl-embedded":
        return True
    return str(info.get("device", "cuda")) == "cpu" and int(info.get("tp_size", 1)) == 1


VOCAB_PADDING = 64
_VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")


def check_engine(sums: dict[str, str], digest: SentDigest, engine_dtype: str | None,
                 embedded: bool = False) -> tuple[int, int, list[str]]:
    """(compared, skipped, names that differ) for one directly comparable engine."""
    compared = skipped = 0
    bad = []
    for name, got in sums.items():
        want = digest.checksums.get(name)
        if want is None:
            continue  # a buffer, or a parameter under a name the trainer does not send
        if engine_dtype not in (None, "auto") and digest.dtypes[name] != engine_dtype:
            skipped += 1
            continue
        if (not embedded and name.endswith(_VOCAB_ROWS)
                and digest.rows.get(name, 0) % VOCAB_PADDING):
            skipped += 1
            continue
        compared += 1
        if got != want:
            bad.append(name)
    return compared, skipped, bad
