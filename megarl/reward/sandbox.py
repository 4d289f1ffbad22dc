"""Run untrusted Python (a model's answer to a coding task) with hard limits and no network.

One run = one ``python3 -I program.py`` under ``unshare`` in fresh PID, network, mount, IPC and
UTS namespaces. What that buys, and why each piece is there:

- **time**: the namespace's PID 1 (``_sandbox_init.py``) kills the program at ``time_limit_s``
  of wall time; ``RLIMIT_CPU`` backs it up, and the caller kills the whole process group if
  even PID 1 hangs. When PID 1 exits the kernel kills every process left in the namespace, so
  children that called ``setsid`` or were orphaned die too.
- **processes**: as root the program runs under a fresh unprivileged uid (random, unused, one per
  run) so ``RLIMIT_NPROC`` — which never applies to root — bounds a fork bomb to
  ``max_processes``, and a second sandbox running at the same time is not starved by it.
- **memory**: ``RLIMIT_AS`` per process (so the total is at most
  ``max_processes × memory_limit_mb``); a Python ``MemoryError`` is reported as ``memory``.
- **network**: a new network namespace holds only a loopback device that is down; connects to
  127.0.0.1 and to public addresses fail with "Network is unreachable".
- **files**: ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are replaced by private tmpfs mounts of
  ``tmpfs_mb`` each (gone with the namespace); the program's cwd is ``/tmp/sandbox``. As an
  unprivileged uid it cannot write anywhere else that is not world-writable, and
  ``RLIMIT_FSIZE`` caps every file it writes, stdout included (``output_limit``).

What it needs from the host: util-linux ``unshare`` and either root (containers need
CAP_SYS_ADMIN, as Docker's default profile lacks: use ``--privileged`` or a seccomp/apparmor
profile allowing ``unshare``) or unprivileged user namespaces. Without root it runs as the
caller's uid mapped to root inside a user namespace: namespaces, time, memory and network limits
hold, but ``RLIMIT_NPROC`` then counts the caller's own processes too. If no namespaces can be
created it fails closed with ``SandboxUnavailableError`` — there is deliberately no fallback to
running model code unisolated. Not a defence against kernel exploits; run rewards on machines
whose compromise you can afford.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

_INIT = str(Path(__file__).with_name("_sandbox_init.py"))
# Unused uids for sandboxed programs: far above any distro's range for real users.
_UID_RANGE = (1_500_000_000, 2_000_000_000)
# Slack for the caller's own watchdog over the program's limit: two interpreter start-ups.
_WATCHDOG_SLACK_S = 10.0

STATUSES = ("ok", "timeout", "memory", "runtime_error", "output_limit", "killed")


class SandboxUnavailableError(RuntimeError):
    """The host cannot create the namespaces the sandbox needs; nothing was run."""


@dataclasses.dataclass
class SandboxResult:
    status: str             # one of STATUSES
    stdout: str
    stderr: str
    returncode: Optional[int]  # the program's exit code (negative: killed by that signal)
    wall_s: float
    uid: Optional[int] = None  # the uid the program ran as (None: the caller's, user namespace)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def default_python() -> str:
    """A python3 the unprivileged sandbox uid may execute (a venv under /root is not one)."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3"),
                 os.path.realpath(sys.executable)):
        if cand and os.path.isfile(cand) and os.stat(cand).st_mode & stat.S_IXOTH:
            return cand
    raise SandboxUnavailableError("no world-executable python3 found for the sandbox "
                                  "(looked in /usr/bin, /usr/local/bin, PATH, sys.executable)")


def _uid_procs(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
            except FileNotFoundError:
                pass
    return pids


def _wait_uid_gone(uid: int, timeout_s: float = 5.0) -> None:
    """Block until no process of ``uid`` is left (namespace teardown is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while _uid_procs(uid):
        if time.monotonic() > deadline:
            for pid in _uid_procs(uid):  # last resort; these are the sandbox's own processes
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            logger.warning("sandbox: processes of uid %d outlived their namespace; killed", uid)
            return
        time.sleep(0.01)


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def run_program(code: str, stdin: str = "", *, time_limit_s: float = 5.0,
                memory_limit_mb: int = 256, max_processes: int = 16,
                max_output_bytes: int = 1 << 20, tmpfs_mb: int = 64,
                python: Optional[str] = None) -> SandboxResult:
    """Run ``code`` as a Python program fed ``stdin``; see the module doc for the guarantees."""
    for name, value in (("time_limit_s", time_limit_s), ("memory_limit_mb", memory_limit_mb),
                        ("max_processes", max_processes), ("max_output_bytes", max_output_bytes),
                        ("tmpfs_mb", tmpfs_mb)):
        if not value > 0:
            raise ValueError(f"run_program: {name} must be > 0, got {value!r}")
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    if not os.path.exists(unshare):
        raise SandboxUnavailableError("sandbox needs util-linux 'unshare' on PATH")
    as_root = os.geteuid() == 0
    uid = random.SystemRandom().randrange(*_UID_RANGE) if as_root else None
    python = python or default_python()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "HOME": "/tmp/sandbox"}
    mib = 1 << 20
    rlimits = {"RLIMIT_AS": memory_limit_mb * mib, "RLIMIT_CPU": math.ceil(time_limit_s) + 1,
               "RLIMIT_FSIZE": max_output_bytes, "RLIMIT_NPROC": max_processes,
               "RLIMIT_NOFILE": 256, "RLIMIT_CORE": 0}
    ns = ["--pid", "--fork", "--kill-child", "--net", "--mount", "--mount-proc", "--ipc", "--uts"]
    if not as_root:
        ns = ["--user", "--map-root-user"] + ns
    host_dir = Path(tempfile.mkdtemp(prefix="megarl-sandbox-"))  # 0700, the caller's only
    read_fd, write_fd = os.pipe()
    try:
        (host_dir / "program.py").write_text(code)
        (host_dir / "stdin").write_text(stdin)
        cfg = {"program_path": str(host_dir / "program.py"), "uid": uid, "python": python,
               "env": env, "rlimits": rlimits, "time_limit_s": float(time_limit_s),
               "tmpfs_mb": int(tmpfs_mb)}
        argv = [unshare, *ns, sys.executable, "-I", "-S", _INIT, str(write_fd), json.dumps(cfg)]
        t0 = time.monotonic()
        with open(host_dir / "stdin", "rb") as fin, open(host_dir / "stdout", "wb") as fout, \
                open(host_dir / "stderr", "wb") as ferr:
            proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr,
                                    pass_fds=(write_fd,), start_new_session=True, env=env)
        os.close(write_fd)
        write_fd = -1
        watchdog_fired = False
        try:
            proc.wait(timeout=time_limit_s + _WATCHDOG_SLACK_S)
        except subprocess.TimeoutExpired:
            watchdog_fired = True
            os.killpg(proc.pid, signal.SIGKILL)  # --kill-child takes PID 1 and so the namespace
            proc.wait()
        wall = time.monotonic() - t0
        with os.fdopen(read_fd, "rb") as f:
            read_fd = -1
            line = f.read().decode(errors="replace").strip()
        if uid is not None:
            _wait_uid_gone(uid)
        stdout = _read(host_dir / "stdout", max_output_bytes)
        stderr = _read(host_dir / "stderr", max_output_bytes)
        out_size = (host_dir / "stdout").stat().st_size
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(host_dir, ignore_errors=True)
    if not line:
        if watchdog_fired:
            return SandboxResult("timeout", stdout, stderr, None, wall, uid)
        if "unshare" in stderr or "mount tmpfs" in stderr:
            raise SandboxUnavailableError(
                f"sandbox could not create its namespaces (needs root with CAP_SYS_ADMIN or "
                f"unprivileged user namespaces): {stderr.strip()[-500:]}")
        return SandboxResult("killed", stdout, stderr, proc.returncode, wall, uid)
    verdict = json.loads(line)
    wall = verdict.get("wall_s", wall)
    if verdict.get("timeout"):
        return SandboxResult("timeout", stdout, stderr, None, wall, uid)
    rc = verdict["exit"]
    return SandboxResult(_classify(rc, stderr, out_size, max_output_bytes), stdout, stderr,
                         rc, wall, uid)


def _classify(rc: int, stderr: str, out_size: int, max_output_bytes: int) -> str:
    if out_size >= max_output_bytes or rc == -signal.SIGXFSZ:
        return "output_limit"
    if rc == 0:
        return "ok"
    if rc == -signal.SIGXCPU:
        return "timeout"
    if "MemoryError" in stderr[-2000:]:
        return "memory"
    if rc < 0:
        return "killed"
    return "runtime_error"
