"""Conversion progress on rank 0: a tqdm bar on a terminal, a log line per 10% elsewhere.

A bar redraws with carriage returns, which turns CI and Slurm logs into noise, so it is drawn
only when stderr is a TTY or the user asks for it (`--progress`). Otherwise the same progress
goes to the log every tenth of the bytes. Other ranks stay silent: they do the same work.
"""
from __future__ import annotations

import logging
import os
import sys

from .plan import human

logger = logging.getLogger(__name__)


def _is_rank0() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


class Progress:
    """Counts tensors and bytes toward known totals. `bar`: True forces a bar, None = if TTY."""

    def __init__(self, desc: str, total_tensors: int, total_bytes: int,
                 bar: bool | None = None):
        self.desc, self.total, self.total_bytes = desc, total_tensors, max(total_bytes, 1)
        self.count, self.bytes, self._decile = 0, 0, 0
        self.mode = None
        if _is_rank0():
            self.mode = "bar" if (bar or (bar is None and sys.stderr.isatty())) else "log"
        self._bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True,
                             unit_divisor=1024, file=sys.stderr, dynamic_ncols=True)

    def update(self, nbytes: int) -> None:
        self.count += 1
        self.bytes += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
            self._bar.set_postfix_str(f"{self.count}/{self.total} tensors", refresh=False)
        elif self.mode == "log":
            decile = min(10, self.bytes * 10 // self.total_bytes)
            if decile > self._decile:
                self._decile = decile
                logger.info("%s: %d%% (%d/%d tensors, %s/%s)", self.desc, decile * 10,
                            self.count, self.total, human(self.bytes), human(self.total_bytes))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
