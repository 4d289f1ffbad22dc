"""PID 1 of one sandbox run (see ``megarl.reward.sandbox``); executed as a script, stdlib only.

Runs inside fresh PID, network, mount, IPC and UTS namespaces created by ``unshare`` (and a
user namespace when the caller is not root). Before the program starts it:

1. builds a minimal root on a tmpfs (read-only binds of ``/usr``, the library directories, the
   interpreter's own prefix and the few ``/etc`` files the dynamic loader and Python read; a
   fresh ``/proc``; ``/dev`` with null, zero, full, random and urandom only; private tmpfs
   ``/tmp`` and ``/dev/shm``), pivots into it and detaches the host's root, so the run
   directory, the data, checkpoints, home directories and every host Unix socket are not there
   to be named;
2. starts the program as an unprivileged uid: as root, a fresh uid of the host; otherwise a uid
   of a nested user namespace, so the program holds no capability over the namespaces this
   process set up (it cannot unmount them, or trace this process);
3. drops the capability bounding set, sets ``NO_NEW_PRIVS`` and applies a seccomp filter that
   refuses ptrace, mount and the new mount API, unshare/setns and namespace flags to clone,
   keyrings, bpf, perf, io_uring, module and kexec loading and other host-level calls.

It then enforces the wall-time limit and exits as soon as the program does: PID 1 exiting makes
the kernel SIGKILL everything left in the namespace, so a child that escaped its process group
(``setsid``) or a fork bomb cannot outlive the run. Its verdict goes to the status pipe as one
JSON line, because its exit code alone cannot tell a program's own exit status from a sandbox
failure. A step that cannot be applied fails the run (``setup_error``), unless the caller
allowed running without it (``allow_unhardened``: then it is named in ``weak``).

    _sandbox_init.py STATUS_FD CONFIG_JSON
"""
import ctypes
import json
import os
import platform
import resource
import signal
import struct
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
ST_RELATIME = 4096
MNT_DETACH = 2
CLONE_NEWUSER = 0x10000000
# every namespace flag: clone() with any of them would give the program a namespace it owns
CLONE_NS_FLAGS = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
                  | 0x40000000 | 0x00000080)
PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP = 4, 22, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38

# Host paths the program may read (when they exist): the interpreter, its libraries and the
# dynamic loader's configuration; nothing that holds a user's data.
ROOT_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
             "/etc/passwd", "/etc/group", "/etc/nsswitch.conf")
DEVICES = ("null", "zero", "full", "random", "urandom")
# The uid the program runs as inside its nested user namespace (a non-root caller's case).
INNER_UID = 1000

# x86_64 only: syscall numbers differ per architecture and an untested table would be a
# filter with holes. Elsewhere seccomp is reported missing (refused unless allowed).
SYSCALLS = {
    "x86_64": {
        "arch": 0xC000003E, "clone": 56, "clone3": 435, "pivot_root": 155,
        "deny": {
            "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
            "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
            "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
            "fsmount": 432, "fspick": 433, "mount_setattr": 442,
            "unshare": 272, "setns": 308,
            "keyctl": 250, "add_key": 248, "request_key": 249,
            "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
            "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
            "init_module": 175, "finit_module": 313, "delete_module": 176,
            "kexec_load": 246, "kexec_file_load": 320, "reboot": 169,
            "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179,
            "open_by_handle_at": 304, "name_to_handle_at": 303,
            "settimeofday": 164, "clock_settime": 227, "adjtimex": 159, "clock_adjtime": 305,
            "syslog": 103, "iopl": 172, "ioperm": 173, "vhangup": 153,
            "sethostname": 170, "setdomainname": 171, "lookup_dcookie": 212, "uselib": 134,
        },
    },
}
PIVOT_ROOT_NR = {"x86_64": 155, "aarch64": 41}


class SetupError(Exception):
    """A hardening step could not be applied."""


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def mount(src, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {fstype or src} on {target}")


def bind_readonly(src: str, dst: str) -> None:
    mount(src, dst, None, MS_BIND | MS_REC)
    # A remount inside a user namespace must keep the flags the host's mount is locked with.
    f = os.statvfs(src).f_flag
    keep = 0
    for st_bit, ms_bit in ((MS_NOSUID, MS_NOSUID), (MS_NODEV, MS_NODEV), (MS_NOEXEC, MS_NOEXEC),
                           (MS_NOATIME, MS_NOATIME), (MS_NODIRATIME, MS_NODIRATIME),
                           (ST_RELATIME, MS_RELATIME)):
        if f & st_bit:
            keep |= ms_bit
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def expose(path: str, root: str) -> None:
    """Make host ``path`` (symlink, directory or file) appear read-only at the same path."""
    if not os.path.lexists(path):
        return
    dst = root + path
    os.makedirs(os.path.dirname(dst), 0o755, exist_ok=True)
    if os.path.lexists(dst):
        return  # under a directory already bound (e.g. a prefix inside /usr)
    if os.path.islink(path) and os.path.dirname(path) == "/":
        os.symlink(os.readlink(path), dst)  # merged-/usr's /bin -> usr/bin: same link
        return
    if os.path.isdir(path):
        os.mkdir(dst, 0o755)
    else:
        open(dst, "wb").close()
    bind_readonly(path, dst)


def build_root(root: str, cfg: dict, program: bytes) -> str:
    """The program's whole filesystem under ``root`` (a tmpfs); returns its workdir there."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in ROOT_DIRS:
        expose(path, root)
    python = os.path.realpath(cfg["python"])
    if not python.startswith(tuple(p + "/" for p in ROOT_DIRS)):
        # an interpreter outside /usr (e.g. /opt/python3.11/bin/python3): its install prefix
        expose(os.path.dirname(os.path.dirname(python)), root)
    for path in ETC_FILES:
        expose(path, root)
    os.mkdir(root + "/dev", 0o755)
    for name in DEVICES:
        open(f"{root}/dev/{name}", "wb").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", f"{root}/dev/fd")
    scratch = f"size={int(cfg['tmpfs_mb'])}m,mode=1777"
    for d in ("/tmp", "/dev/shm"):
        os.makedirs(root + d, 0o755, exist_ok=True)
        mount("tmpfs", root + d, "tmpfs", MS_NOSUID | MS_NODEV, scratch)
    os.makedirs(root + "/var", 0o755)
    os.symlink("/tmp", root + "/var/tmp")
    os.mkdir(root + "/proc", 0o555)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    workdir = "/tmp/sandbox"
    os.mkdir(root + workdir, 0o700)
    with open(root + workdir + "/program.py", "wb") as f:
        f.write(program)
    if cfg["uid"] is not None:
        os.chown(root + workdir, cfg["uid"], cfg["uid"])
        os.chown(root + workdir + "/program.py", cfg["uid"], cfg["uid"])
    mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    # pivot_root(".", ".") stacks the old root under the new one; detaching it leaves nothing
    # of the host reachable (pivot_root(2), "the new root and put_old may be the same").
    os.chdir(root)
    nr = PIVOT_ROOT_NR.get(platform.machine())
    if nr is None:
        raise SetupError(f"pivot_root: no syscall number known for {platform.machine()}")
    _check(libc.syscall(ctypes.c_long(nr), b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")
    return workdir


def seccomp_filter() -> bytes:
    """A classic-BPF program over ``struct seccomp_data``: kill another ABI, refuse the listed
    calls (EPERM), clone3 (ENOSYS, so libc falls back to clone, whose flags can be read) and
    clone with a namespace flag; allow the rest."""
    table = SYSCALLS.get(platform.machine())
    if table is None:
        raise SetupError(f"seccomp: no syscall table for {platform.machine()}")
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    deny = sorted(set(table["deny"].values()))
    # labels are resolved after the layout is known: (code, jt-label, jf-label, k)
    prog: list = [(LD, None, None, 4),                       # seccomp_data.arch
                  (JEQ, None, "kill", table["arch"]),
                  (LD, None, None, 0),                       # seccomp_data.nr
                  (JGE, "eperm", None, 0x40000000)]          # x32 calls on x86_64
    prog += [(JEQ, "eperm", None, nr) for nr in deny]
    prog += [(JEQ, "enosys", None, table["clone3"]),
             (JEQ, None, "allow", table["clone"]),
             (LD, None, None, 16),                           # args[0], low word: the flags
             (JSET, "eperm", None, CLONE_NS_FLAGS)]
    labels = {"allow": len(prog), "eperm": len(prog) + 1, "enosys": len(prog) + 2,
              "kill": len(prog) + 3}
    prog += [(RET, None, None, SECCOMP_RET_ALLOW), (RET, None, None, SECCOMP_RET_ERRNO | EPERM),
             (RET, None, None, SECCOMP_RET_ERRNO | ENOSYS),
             (RET, None, None, SECCOMP_RET_KILL_PROCESS)]
    out = b""
    for i, (code, jt, jf, k) in enumerate(prog):
        off = (lambda label: 0 if label is None else labels[label] - i - 1)
        out += struct.pack("=HBBI", code, off(jt), off(jf), k)
    return out


def apply_seccomp(filt: bytes) -> None:
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = SockFprog(len(filt) // 8, filt)
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def enter_nested_userns() -> None:
    """As root of a user namespace: enter a new one inside it, mapping INNER_UID to this
    process's ids. That namespace owns none of the namespaces this process set up, so the
    capabilities held in it are worth nothing against them; they go at the setresuid."""
    _check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    # the only mapping an unprivileged writer may make: its own ids in the parent namespace
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(f"{INNER_UID} 0 1")


def drop_bounding_set() -> None:
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    if cap == 0:
        raise SetupError(f"drop the capability bounding set: {os.strerror(ctypes.get_errno())}")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)


def start_program(cfg: dict, workdir: str, filt, weak: list) -> tuple[int, int]:
    """Fork the program; returns (pid, read end of a close-on-exec pipe that carries the
    reason when a setup step fails in the child, and is closed empty by a successful exec)."""
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid:
        os.close(err_w)
        return pid, err_r
    os.close(err_r)
    allow = cfg["allow_unhardened"]

    def step(name, fn, *args) -> bool:
        """Apply one layer; False when it failed and the caller allows going on without."""
        try:
            fn(*args)
            return True
        except (SetupError, OSError) as err:
            if not allow:
                raise SetupError(f"{name}: {err}") from None
            weak.append(name)
            return False

    try:
        for name, value in cfg["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value, value))
        if cfg["uid"] is not None:
            step("bounding_set", drop_bounding_set)
            # groups and gid first: after setuid we could no longer change them
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        else:
            nested = step("nested_uid", enter_nested_userns)
            # a new user namespace starts with a full bounding set: drop it there
            step("bounding_set", drop_bounding_set)
            if nested:
                os.setresgid(INNER_UID, INNER_UID, INNER_UID)
                os.setresuid(INNER_UID, INNER_UID, INNER_UID)
        os.chdir(workdir)
        step("no_new_privs",
             lambda: _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs"))
        if filt is not None:
            step("seccomp", apply_seccomp, filt)
        if weak:
            os.write(err_w, ("weak:" + ",".join(weak)).encode())
        os.execve(cfg["python"], [cfg["python"], "-I", "program.py"], cfg["env"])
    except BaseException as err:  # noqa: BLE001 - anything here means the program never ran
        msg = str(err) if isinstance(err, SetupError) else f"cannot start {cfg['python']}: {err}"
        os.write(err_w, f"error:{msg}".encode())
    os._exit(127)


def main() -> None:
    status_fd, cfg = int(sys.argv[1]), json.loads(sys.argv[2])
    os.set_inheritable(status_fd, False)  # the program must not be able to forge a verdict

    def report(verdict: dict) -> None:
        try:
            os.kill(-1, signal.SIGKILL)  # as PID 1: every other process in the namespace
        except ProcessLookupError:
            pass
        os.write(status_fd, (json.dumps(verdict) + "\n").encode())
        os._exit(0)

    # The program runs with this process's uid when the caller is not root: it must not be
    # able to trace it or read its memory through /proc.
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    weak: list = []
    with open(cfg["program_path"], "rb") as f:  # read before the host's files are gone
        program = f.read()
    try:
        try:
            workdir = build_root(cfg["root_dir"], cfg, program)
        except (SetupError, OSError) as err:
            if not cfg["allow_unhardened"]:
                raise SetupError(f"minimal_root: {err}") from None
            weak.append("minimal_root")
            workdir = fallback_scratch(cfg, program)
        try:
            filt = seccomp_filter()
        except SetupError:
            if not cfg["allow_unhardened"]:
                raise
            weak.append("seccomp")
            filt = None
    except (SetupError, OSError) as err:
        report({"setup_error": str(err)})
        return
    t0 = time.monotonic()
    child, err_r = start_program(cfg, workdir, filt, weak)
    with os.fdopen(err_r, "rb") as f:
        said = f.read().decode(errors="replace")  # EOF at the program's exec, or its failure
    for part in said.split("error:", 1)[1:]:
        report({"setup_error": part})
    if said.startswith("weak:"):
        weak = said[5:].split(",")
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
    verdict["weak"] = weak
    report(verdict)


def fallback_scratch(cfg: dict, program: bytes) -> str:
    """Without a minimal root (allowed by the caller): private tmpfs scratch over the host's."""
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(d):
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(cfg['tmpfs_mb'])}m,mode=1777")
    workdir = "/tmp/sandbox"
    os.mkdir(workdir, 0o700)
    with open(workdir + "/program.py", "wb") as f:
        f.write(program)
    if cfg["uid"] is not None:
        os.chown(workdir, cfg["uid"], cfg["uid"])
        os.chown(workdir + "/program.py", cfg["uid"], cfg["uid"])
    return workdir


if __name__ == "__main__":
    main()
