"""End a launched server's whole process group when the process that launched it dies.

A rollout server runs in a process group of its own (`start_new_session`): stock SGLang forks
scheduler and detokenizer processes into it. Its launcher asks the kernel for a SIGTERM when
it dies (PR_SET_PDEATHSIG), but SGLang takes SIGTERM as "drain the requests, then stop", and
with the trainer gone it can drain for ever: a server holding GPUs with parent pid 1. (The
kernel's notice also fires when the launcher's *thread* that forked the server ends, not its
process.) The guard is a small process of its own session beside each server: once its
parent process (the launcher) is gone, it sends the server's group SIGTERM, waits `grace_s`
for the group to empty, then SIGKILLs what is left; it leaves by itself when the group has
ended first. It watches `getppid()`, which changes only when the launcher's whole process is
gone, from whatever thread it was started.

`terminate_groups` is the same escalation for callers that stop servers themselves. This file
runs as a script (`python -I group_guard.py LAUNCHER_PID PGID GRACE_S`) without importing
megarl, so it imports nothing beyond the standard library.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.2


def group_alive(pgid: int) -> bool:
    """Whether any process is left in group `pgid` (a not yet reaped zombie counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # members we may not signal: they are there
        return True
    return True


def terminate_groups(pgids, grace_s: float) -> None:
    """SIGTERM to each process group of `pgids`, up to `grace_s` for them to empty, then
    SIGKILL to what is left."""
    pgids = [g for g in pgids if _signal(g, signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    while pgids and time.monotonic() < deadline:
        time.sleep(POLL_S / 4)
        pgids = [g for g in pgids if group_alive(g)]
    for g in pgids:
        _signal(g, signal.SIGKILL)


def _signal(pgid: int, sig: int) -> bool:
    """`sig` to group `pgid`; False when the group is gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # members we may not signal: they are there
        pass
    return True


def start(pgid: int, grace_s: float) -> subprocess.Popen:
    """The guard of group `pgid`, watching this process. In a session of its own, so that
    signals meant for the launcher's group (a terminal's Ctrl-C, torchrun's agent stopping a
    rank) do not end it before it has done its work."""
    return subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()),
                             str(pgid), repr(float(grace_s))],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def main(argv: list[str]) -> int:
    launcher, pgid, grace_s = int(argv[0]), int(argv[1]), float(argv[2])
    while os.getppid() == launcher:  # reparented (to init or a subreaper): the launcher died
        if not group_alive(pgid):
            return 0
        time.sleep(POLL_S)
    terminate_groups([pgid], grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
