"""PID 1 of one sandbox run (see ``megarl.reward.sandbox``); executed as a script, stdlib only.

Runs inside fresh PID, network and mount namespaces created by ``unshare``. It hides the host's
scratch directories behind private tmpfs mounts, starts the program as an unprivileged uid with
resource limits, enforces the wall-time limit, and exits as soon as the program does: PID 1
exiting makes the kernel SIGKILL everything left in the namespace, so a child that escaped its
process group (``setsid``) or a fork bomb cannot outlive the run. Its verdict goes to the
status pipe as one JSON line, because its exit code alone cannot tell a program's own exit
status from a sandbox failure.

    _sandbox_init.py STATUS_FD CONFIG_JSON
"""
import ctypes
import json
import os
import resource
import signal
import sys
import time

MS_NOSUID, MS_NODEV = 2, 4
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


def mount_tmpfs(target: str, size_mb: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"size={size_mb}m,mode=1777".encode()
    if libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {target}: {os.strerror(err)}")


def start_program(cfg: dict, workdir: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        for name, value in cfg["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value, value))
        if cfg["uid"] is not None:
            # groups and gid first: after setuid we could no longer change them
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        os.chdir(workdir)
        os.execve(cfg["python"], [cfg["python"], "-I", "program.py"], cfg["env"])
    except BaseException as err:  # noqa: BLE001 - anything here means the program never ran
        os.write(2, f"sandbox: cannot start {cfg['python']}: {err}\n".encode())
    os._exit(127)


def main() -> None:
    status_fd, cfg = int(sys.argv[1]), json.loads(sys.argv[2])
    with open(cfg["program_path"], "rb") as f:  # read before /tmp is covered
        program = f.read()
    for d in SCRATCH_DIRS:
        if os.path.isdir(d):
            mount_tmpfs(d, cfg["tmpfs_mb"])
    workdir = "/tmp/sandbox"
    os.mkdir(workdir, 0o700)
    with open(os.path.join(workdir, "program.py"), "wb") as f:
        f.write(program)
    if cfg["uid"] is not None:
        os.chown(workdir, cfg["uid"], cfg["uid"])
        os.chown(os.path.join(workdir, "program.py"), cfg["uid"], cfg["uid"])
    os.set_inheritable(status_fd, False)  # the program must not be able to forge a verdict
    t0 = time.monotonic()
    child = start_program(cfg, workdir)
    deadline = t0 + cfg["time_limit_s"]
    verdict = None
    while verdict is None:
        # Reap everything: orphans of the program are re-parented to us, and unreaped zombies
        # would keep counting against RLIMIT_NPROC.
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
            if pid == child:
                verdict = {"exit": os.waitstatus_to_exitcode(status)}
                break
        if verdict is None and time.monotonic() >= deadline:
            verdict = {"timeout": True}
        if verdict is None:
            time.sleep(0.005)
    verdict["wall_s"] = time.monotonic() - t0
    try:
        os.kill(-1, signal.SIGKILL)  # as PID 1: every other process in the namespace
    except ProcessLookupError:
        pass
    os.write(status_fd, (json.dumps(verdict) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
