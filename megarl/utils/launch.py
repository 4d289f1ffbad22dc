"""Make sure the current process is part of a torch.distributed world of the size a tool needs.

Tools such as the checkpoint converters and benchmarks run as plain `python tools/x.py`: with
one rank they set up a single-process world themselves; with more they re-execute themselves
under `torch.distributed.run`, so the user never has to type torchrun.
"""
from __future__ import annotations

import logging
import os
import socket
import sys

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` (an address of this machine) right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ensure_world(nproc: int) -> None:
    """Return in a world of `nproc` ranks, re-launching this script under torchrun if needed."""
    if "WORLD_SIZE" in os.environ:
        have = int(os.environ["WORLD_SIZE"])
        if have != nproc:
            raise SystemExit(f"launched with WORLD_SIZE={have}, but TP×PP needs {nproc} ranks")
        return
    if nproc == 1:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", sys.argv[0], *sys.argv[1:]]
    logger.info("re-launching under torchrun with %d ranks", nproc)
    sys.stdout.flush()
    os.execv(sys.executable, cmd)
