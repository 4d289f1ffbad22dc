"""The sandbox against a program that tries to get out, run by a root caller and by an
unprivileged one (``setpriv`` to uid 65534, as on a cluster where the trainer is not root and
the sandbox stands on a user namespace): every probe must be refused in both."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import megarl.reward.sandbox as sandbox_mod
from megarl.reward.sandbox import SandboxUnavailableError, run_program, sweep_scratch

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"

# One program runs every probe and prints what each got: a sandbox run is ~0.1 s, but a test
# per probe would pay the caller's start-up each time as the unprivileged user.
PROBES = textwrap.dedent(r'''
    import ctypes, json, os, socket, sys
    host = json.loads(sys.stdin.read())
    libc = ctypes.CDLL(None, use_errno=True)
    out = {}

    def errno_of(rc):
        return 0 if rc == 0 else ctypes.get_errno()

    def attempt(name, fn):
        try:
            fn()
            out[name] = "done"
        except OSError as err:
            out[name] = type(err).__name__ + ":" + str(err.errno)

    attempt("read_proc1_environ", lambda: open("/proc/1/environ", "rb").read())
    attempt("read_proc1_mem", lambda: open("/proc/1/mem", "rb").read(1))
    attempt("read_data", lambda: open(host["data"]).read())
    attempt("write_outside", lambda: open(host["outdir"] + "/pwned", "w").write("x"))
    attempt("write_root", lambda: open("/pwned", "w").write("x"))
    attempt("write_usr", lambda: open("/usr/pwned", "w").write("x"))

    def unix(path):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(2)
        s.connect(path)
    attempt("unix_socket", lambda: unix(host["sock"]))
    attempt("abstract_socket", lambda: unix("\0" + host["abstract"]))
    attempt("list_home", lambda: os.listdir("/root"))
    attempt("list_work", lambda: os.listdir(host["repo"]))
    try:  # (an earlier probe that got through may have unmounted /proc)
        status = dict(line.split(":\t", 1)
                      for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
    except OSError:
        status = {}
    for key, name in (("CapEff", "cap_eff"), ("CapBnd", "cap_bnd"),
                      ("NoNewPrivs", "no_new_privs"), ("Seccomp", "seccomp")):
        out[name] = status.get(key, "?").strip()
    # last: an umount or chroot that got through would change what the probes above see
    out["umount_tmp"] = errno_of(libc.umount2(b"/tmp", 2))
    out["umount_root"] = errno_of(libc.umount2(b"/", 2))
    out["mount_tmpfs"] = errno_of(libc.mount(b"t", b"/tmp", b"tmpfs", 0, None))
    out["ptrace_seize_1"] = errno_of(libc.ptrace(0x4206, 1, None, None))
    out["ptrace_attach_1"] = errno_of(libc.ptrace(16, 1, None, None))
    out["unshare_user"] = errno_of(libc.unshare(0x10000000))
    out["unshare_net"] = errno_of(libc.unshare(0x40000000))
    out["chroot"] = errno_of(libc.chroot(b"/tmp"))
    out["io_uring_setup"] = errno_of(libc.syscall(425, 1, ctypes.create_string_buffer(120)))
    out["bpf"] = errno_of(libc.syscall(321, 0, None, 0))
    out["keyctl"] = errno_of(libc.syscall(250, 0, 0, 0, 0, 0))
    out["perf_event_open"] = errno_of(libc.syscall(298, None, 0, -1, -1, 0))
    out["uid"] = os.getuid()
    out["root_entries"] = sorted(os.listdir("/"))
    print(json.dumps(out))
''')

REFUSED = ("umount_tmp", "umount_root", "mount_tmpfs", "ptrace_seize_1", "ptrace_attach_1",
           "unshare_user", "unshare_net", "chroot", "io_uring_setup", "bpf", "keyctl",
           "perf_event_open")
NOT_THERE = ("read_proc1_environ", "read_proc1_mem", "read_data", "write_outside", "write_root",
             "write_usr", "unix_socket", "abstract_socket", "list_home", "list_work")


def _available(as_nobody: bool) -> str:
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return "the seccomp layer is built for x86_64 Linux only"
    if as_nobody and os.geteuid() != 0:
        return "the unprivileged-caller probes switch uid with setpriv, which needs root"
    if as_nobody and not (shutil.which("setpriv") and os.access(SYSTEM_PYTHON, os.X_OK)):
        return "needs util-linux setpriv and /usr/bin/python3"
    try:
        run_program("pass", time_limit_s=5)
    except SandboxUnavailableError as err:
        return f"host cannot create the sandbox's namespaces: {err}"
    return ""


@pytest.fixture
def host():
    """Host things a program must not reach, all open to every uid so only the sandbox
    stands in the way: a data file, a writable directory, a Unix socket, an abstract one.
    Under /run (where services keep their sockets), not /tmp: a private /tmp alone hides
    /tmp, and the probes must show that nothing else of the host is there either."""
    base = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
    d = Path(tempfile.mkdtemp(prefix="megarl-hostile-", dir=base))
    d.chmod(0o755)
    (d / "data.jsonl").write_text('{"ground_truth": "42"}\n')
    (d / "data.jsonl").chmod(0o644)
    (d / "out").mkdir(mode=0o777)
    (d / "out").chmod(0o777)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(d / "sock"))
    (d / "sock").chmod(0o777)
    sock.listen(4)
    sock.settimeout(0.1)
    abstract = f"megarl-hostile-{os.getpid()}-{time.monotonic_ns()}"
    asock = socket.socket(socket.AF_UNIX)
    asock.bind("\0" + abstract)
    asock.listen(4)
    asock.settimeout(0.1)
    info = {"data": str(d / "data.jsonl"), "outdir": str(d / "out"), "sock": str(d / "sock"),
            "abstract": abstract, "repo": str(Path(sandbox_mod.__file__).parents[2]), "dir": d}
    yield info
    for s in (sock, asock):
        try:
            s.accept()
            info["accepted"] = True
        except OSError:
            pass
        s.close()
    shutil.rmtree(d, ignore_errors=True)


def _standalone_copy() -> Path:
    """The sandbox's two files (stdlib only) where an unprivileged uid can run them: a CI
    checkout under a 0700 directory is out of its reach."""
    d = Path(tempfile.mkdtemp(prefix="megarl-sandbox-code-", dir="/tmp"))
    d.chmod(0o755)
    for name in ("sandbox.py", "_sandbox_init.py"):
        shutil.copy(Path(sandbox_mod.__file__).with_name(name), d / name)
        (d / name).chmod(0o644)
    return d


def _as_nobody(code_dir: Path, script: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
         SYSTEM_PYTHON, "-I", "-c", f"import sys; sys.path.insert(0, {str(code_dir)!r})\n" + script],
        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp"}, cwd="/tmp", **popen)


def _run_probes(as_nobody: bool, host: dict) -> dict:
    stdin = json.dumps({k: v for k, v in host.items() if k != "dir"})
    if not as_nobody:
        r = run_program(PROBES, stdin, time_limit_s=20)
        assert r.status == "ok", r.stderr
        return json.loads(r.stdout)
    code_dir = _standalone_copy()
    try:
        script = (f"import json, sandbox\n"
                  f"r = sandbox.run_program({PROBES!r}, {stdin!r}, time_limit_s=20)\n"
                  f"print(json.dumps([r.status, r.stdout, r.stderr, r.uid]))\n")
        p = _as_nobody(code_dir, script, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        status, stdout, stderr, uid = json.loads(out)
        assert status == "ok" and uid is None, stderr
        return json.loads(stdout)
    finally:
        shutil.rmtree(code_dir, ignore_errors=True)


@pytest.mark.parametrize("caller", ["root", "unprivileged"])
def test_every_probe_is_refused(caller, host):
    as_nobody = caller == "unprivileged"
    why = _available(as_nobody)
    if why:
        pytest.skip(why)
    if not as_nobody and os.geteuid() != 0:
        pytest.skip("the root-caller probes need root")
    got = _run_probes(as_nobody, host)
    for name in REFUSED:
        assert got[name] != 0, f"{name} succeeded: {got}"
    for name in NOT_THERE:
        assert got[name] != "done", f"{name} succeeded: {got}"
    assert got["read_data"].startswith("FileNotFoundError")  # not there at all, not denied
    assert got["unix_socket"].startswith("FileNotFoundError")
    assert int(got["cap_eff"], 16) == 0 and int(got["cap_bnd"], 16) == 0, got
    assert got["no_new_privs"] == "1" and got["seccomp"] == "2", got
    assert got["uid"] != 0
    assert got["root_entries"] == sorted(["bin", "dev", "etc", "lib", "lib64", "proc", "sbin",
                                          "tmp", "usr", "var"]) or "home" not in got["root_entries"]
    assert not (host["dir"] / "out" / "pwned").exists() and not Path("/pwned").exists()
    assert "accepted" not in host


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                ppid = int(Path(f"/proc/{e}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(e))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.parametrize("caller", ["root", "unprivileged"])
def test_a_killed_caller_takes_its_sandbox_and_leaves_no_scratch(caller):
    """A reward worker killed by its pool mid-call: the sandbox dies with it (not at its time
    limit), and the scratch directory it left is swept."""
    as_nobody = caller == "unprivileged"
    why = _available(as_nobody)
    if why:
        pytest.skip(why)
    program = ("import os, time\n"
               "if os.fork() == 0:\n    os.setsid()\n    time.sleep(120)\n"
               "time.sleep(120)\n")
    script = (f"import sandbox, sys\nprint('calling', flush=True)\n"
              f"sandbox.run_program({program!r}, time_limit_s=60)\n")
    code_dir = _standalone_copy()
    try:
        if as_nobody:
            caller_proc = _as_nobody(code_dir, script, stdout=subprocess.PIPE, text=True)
        else:
            caller_proc = subprocess.Popen(
                [sys.executable, "-I", "-c",
                 f"import sys; sys.path.insert(0, {str(code_dir)!r})\n" + script],
                stdout=subprocess.PIPE, text=True)
        assert caller_proc.stdout.readline() == "calling\n"
        deadline = time.monotonic() + 20
        tree: set[int] = set()
        while time.monotonic() < deadline:  # the caller, setpriv/unshare, PID 1, two sleepers
            tree = _descendants(caller_proc.pid)
            if len(tree) >= 4:
                break
            time.sleep(0.1)
        assert len(tree) >= 4, tree
        left = [p for p in Path("/tmp").glob(f"megarl-sandbox-{caller_proc.pid}-*")]
        assert len(left) == 1
        caller_proc.send_signal(signal.SIGKILL)
        caller_proc.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in tree if _alive(p)], "sandbox processes outlived their caller"
        assert left[0].exists()  # what the killed caller could not clean up
        if as_nobody:
            sweeper = _as_nobody(code_dir, "import sandbox; print(sandbox.sweep_scratch())",
                                 stdout=subprocess.PIPE, text=True)
            assert sweeper.communicate(timeout=30)[0].strip() != "0"
        else:
            assert sweep_scratch() >= 1
        assert not left[0].exists()
    finally:
        shutil.rmtree(code_dir, ignore_errors=True)


def test_task_limits_are_capped(monkeypatch):
    why = _available(False)
    if why:
        pytest.skip(why)
    monkeypatch.setenv("MEGARL_SANDBOX_MAX_TIME_S", "1.0")
    monkeypatch.setenv("MEGARL_SANDBOX_MAX_MEMORY_MB", "128")
    t0 = time.monotonic()
    r = run_program("while True:\n    pass", time_limit_s=600)  # a task asking for 10 minutes
    assert r.status == "timeout" and time.monotonic() - t0 < 5
    r = run_program("x = bytearray(200 * 1024 * 1024)", memory_limit_mb=8192)
    assert r.status == "memory"
