"""Make sure the current process is part of a torch.distributed world of the size a tool needs.

Tools such as the checkpoint converters and benchmarks run as plain `python tools/x.py`: with
one rank they set up a single-process world themselves; with more they re-execute themselves
under `torch.distributed.run`, so the user never has to type torchrun.
"""
from __future__ import annotations

import logging
import os
import random
import socket
import sys

logger = logging.getLogger(__name__)


# Below the kernel's ephemeral range (where bind(0) and every outgoing connection take their
# ports) and above Ray's worker ports (10002-19999 by default).
_PORTS_FROM = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS starts at 49152


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` (an address of this machine) right now, for a listener that binds
    it a little later (a rendezvous, a server). It is taken below the ephemeral range: a port
    from bind(0) is an ephemeral one, and on a busy machine another process's outgoing
    connection was handed it in the gap before the listener's bind (EADDRINUSE, seen with two
    runs side by side)."""
    rng = random.SystemRandom()
    high = _ephemeral_low() - 1
    for _ in range(200 if high - _PORTS_FROM >= 1000 else 0):
        port = rng.randint(_PORTS_FROM, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # in use (or in TIME_WAIT) on this host
            return port
    with socket.socket() as s:  # no range of our own here: the kernel's choice
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
