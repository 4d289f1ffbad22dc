"""Run untrusted Python (a model's answer to a coding task, the ``python`` tool) with hard
limits, no network and nothing of the host to see. Stdlib only.

One run = one ``python3 -I program.py`` under ``unshare`` in fresh PID, network, mount, IPC and
UTS namespaces (and a user namespace when the caller is not root); ``_sandbox_init.py`` is the
namespace's PID 1 and sets the program up. What holds, as root and not:

- **filesystem**: the program's root is a read-only tmpfs holding read-only binds of ``/usr``,
  the library directories and the loader's few ``/etc`` files, a fresh ``/proc``, a minimal
  ``/dev``, and private tmpfs ``/tmp`` and ``/dev/shm`` of ``tmpfs_mb`` each (gone with the
  namespace); the host's root is detached. The run directory, the data with its ground truth,
  checkpoints, home directories and host Unix sockets (Ray's, SGLang's) are not there.
- **privileges**: the program never runs as root of anything that matters. As root it gets a
  fresh unprivileged host uid (one per run, so ``RLIMIT_NPROC`` bounds a fork bomb to
  ``max_processes`` without starving a second sandbox); otherwise a uid of a nested user
  namespace that owns none of the sandbox's namespaces, so it cannot unmount them or trace
  PID 1 (which is also not dumpable). Its capability bounding set is empty and
  ``NO_NEW_PRIVS`` is set.
- **system calls** (x86_64): a seccomp filter refuses ptrace, mount/umount and the new mount
  API, pivot_root/chroot, unshare/setns and clone with namespace flags, keyrings, bpf, perf,
  userfaultfd, io_uring, module and kexec loading, and clock, swap, quota and reboot calls.
- **time**: PID 1 kills the program at ``time_limit_s`` of wall time; ``RLIMIT_CPU`` backs it
  up, and the caller kills the whole process group if even PID 1 hangs. When PID 1 exits the
  kernel kills every process left in the namespace (``setsid`` does not escape it). If the
  caller itself dies (a reward worker killed by its pool), the kernel kills the sandbox too
  (``setpriv --pdeathsig``), and ``sweep_scratch`` removes the host directories it left.
- **memory**: ``RLIMIT_AS`` per process (so the total is at most
  ``max_processes × memory_limit_mb``); a Python ``MemoryError`` is reported as ``memory``.
- **network**: a new network namespace holds only a loopback device that is down.
- **limits a task asks for** are capped by ``reward.sandbox.max_time_limit_s`` and
  ``max_memory_limit_mb`` (``configure``), so data cannot grant itself minutes or gigabytes.

What it needs from the host: util-linux ``unshare`` (and ``setpriv``) and either root
(containers need CAP_SYS_ADMIN, as Docker's default profile lacks: use ``--privileged`` or a
seccomp/apparmor profile allowing ``unshare``) or unprivileged user namespaces. A layer the host
cannot give fails the run with ``SandboxUnavailableError`` naming it, before any model code
runs, unless ``reward.sandbox.allow_unhardened`` says to go on without it (``weak`` in the
result names what was missing). There is deliberately no fallback to running model code
unisolated. Not a defence against kernel exploits; run rewards on machines whose compromise
you can afford (docs/security.md).
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
SCRATCH_PREFIX = "megarl-sandbox-"
# The caps a task's own limits (extra_info, a tool call's arguments) are held to; the run's
# config sets them for its processes through the environment (configure), which the reward and
# tool pools' workers inherit.
DEFAULT_MAX_TIME_LIMIT_S = 30.0
DEFAULT_MAX_MEMORY_LIMIT_MB = 4096
_ENV_MAX_TIME = "MEGARL_SANDBOX_MAX_TIME_S"
_ENV_MAX_MEMORY = "MEGARL_SANDBOX_MAX_MEMORY_MB"
_ENV_ALLOW_UNHARDENED = "MEGARL_SANDBOX_ALLOW_UNHARDENED"
_warned: set = set()


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
    weak: tuple = ()  # hardening layers the host could not give (allowed by the caller)

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


def configure(max_time_limit_s: float = DEFAULT_MAX_TIME_LIMIT_S,
              max_memory_limit_mb: int = DEFAULT_MAX_MEMORY_LIMIT_MB,
              allow_unhardened: bool = False) -> None:
    """Set this process's (and its future children's) caps and hardening policy."""
    if not max_time_limit_s > 0:
        raise ValueError(f"reward.sandbox.max_time_limit_s must be > 0, got {max_time_limit_s!r}")
    if not (isinstance(max_memory_limit_mb, int) and max_memory_limit_mb > 0):
        raise ValueError(f"reward.sandbox.max_memory_limit_mb must be an integer > 0, "
                         f"got {max_memory_limit_mb!r}")
    os.environ[_ENV_MAX_TIME] = repr(float(max_time_limit_s))
    os.environ[_ENV_MAX_MEMORY] = str(int(max_memory_limit_mb))
    os.environ[_ENV_ALLOW_UNHARDENED] = "1" if allow_unhardened else "0"


def _capped(name: str, value, env: str, default):
    cap = type(default)(os.environ.get(env, default))
    if value <= cap:
        return value
    if (name, value) not in _warned:
        _warned.add((name, value))
        logger.warning("sandbox: %s=%s asked for is above the cap %s "
                       "(reward.sandbox.max_%s); the run gets the cap", name, value, cap, name)
    return cap


def sweep_scratch(tmp_dir: Optional[str] = None) -> int:
    """Remove the host scratch directories of sandbox runs whose caller is gone (a reward
    worker killed mid-call leaves its run's directory); returns how many went."""
    tmp = Path(tmp_dir or tempfile.gettempdir())
    removed = 0
    for entry in tmp.glob(SCRATCH_PREFIX + "*-*"):
        pid = entry.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            if entry.stat().st_uid != os.geteuid():
                continue
            os.kill(int(pid), 0)
            continue  # its caller still runs (or the pid was reused: kept, to be safe)
        except ProcessLookupError:
            pass
        except (FileNotFoundError, PermissionError):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed += 1
    if removed:
        logger.info("sandbox: removed %d scratch directories left by killed callers", removed)
    return removed


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
                python: Optional[str] = None,
                allow_unhardened: Optional[bool] = None) -> SandboxResult:
    """Run ``code`` as a Python program fed ``stdin``; see the module doc for the guarantees.
    ``allow_unhardened`` None: as ``configure`` set it (default: refuse)."""
    for name, value in (("time_limit_s", time_limit_s), ("memory_limit_mb", memory_limit_mb),
                        ("max_processes", max_processes), ("max_output_bytes", max_output_bytes),
                        ("tmpfs_mb", tmpfs_mb)):
        if not value > 0:
            raise ValueError(f"run_program: {name} must be > 0, got {value!r}")
    time_limit_s = _capped("time_limit_s", float(time_limit_s), _ENV_MAX_TIME,
                           DEFAULT_MAX_TIME_LIMIT_S)
    memory_limit_mb = _capped("memory_limit_mb", int(memory_limit_mb), _ENV_MAX_MEMORY,
                              DEFAULT_MAX_MEMORY_LIMIT_MB)
    if allow_unhardened is None:
        allow_unhardened = os.environ.get(_ENV_ALLOW_UNHARDENED, "0") == "1"
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    if not os.path.exists(unshare):
        raise SandboxUnavailableError("sandbox needs util-linux 'unshare' on PATH")
    # The kernel kills the sandbox when its caller dies (a pool's killed worker), not at the
    # program's time limit, and not never if something stalls PID 1.
    setpriv = shutil.which("setpriv")
    prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
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
    # 0700, the caller's only; named by the caller's pid, for sweep_scratch
    host_dir = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
    read_fd, write_fd = os.pipe()
    try:
        (host_dir / "program.py").write_text(code)
        (host_dir / "stdin").write_text(stdin)
        (host_dir / "root").mkdir()
        cfg = {"program_path": str(host_dir / "program.py"), "uid": uid, "python": python,
               "env": env, "rlimits": rlimits, "time_limit_s": float(time_limit_s),
               "tmpfs_mb": int(tmpfs_mb), "root_dir": str(host_dir / "root"),
               "allow_unhardened": bool(allow_unhardened)}
        argv = [*prefix, unshare, *ns, sys.executable, "-I", "-S", _INIT, str(write_fd),
                json.dumps(cfg)]
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
    if "setup_error" in verdict:
        raise SandboxUnavailableError(
            f"sandbox could not apply {verdict['setup_error']} (nothing was run; "
            f"reward.sandbox.allow_unhardened=true runs model code without what is missing)")
    wall = verdict.get("wall_s", wall)
    weak = tuple(verdict.get("weak", ()))
    if weak and ("weak", weak) not in _warned:
        _warned.add(("weak", weak))
        logger.warning("sandbox: running model code without %s (reward.sandbox."
                       "allow_unhardened=true); see docs/security.md", ", ".join(weak))
    if verdict.get("timeout"):
        return SandboxResult("timeout", stdout, stderr, None, wall, uid, weak)
    rc = verdict["exit"]
    return SandboxResult(_classify(rc, stderr, out_size, max_output_bytes), stdout, stderr,
                         rc, wall, uid, weak)


def check(allow_unhardened: Optional[bool] = None) -> tuple:
    """Start-up check for a run that will execute model code: a trivial program must run with
    every layer, or with what the caller allows; returns the missing layers (empty: all held).
    Raises SandboxUnavailableError naming what the host cannot give."""
    result = run_program("pass", time_limit_s=10.0, allow_unhardened=allow_unhardened)
    if not result.ok:
        raise SandboxUnavailableError(f"sandbox self-check: a trivial program ended "
                                      f"{result.status}: {result.stderr.strip()[-500:]}")
    return result.weak


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
