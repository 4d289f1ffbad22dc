"""The code sandbox against hostile programs: each limit is exercised for real."""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

import megarl
from megarl.reward.sandbox import SandboxUnavailableError, run_program


def _probe() -> str:
    try:
        run_program("pass", time_limit_s=5)
    except SandboxUnavailableError as err:
        return str(err)
    return ""


_UNAVAILABLE = _probe()
pytestmark = pytest.mark.skipif(
    bool(_UNAVAILABLE), reason=f"host cannot create PID/net/mount namespaces (needs root with "
                               f"CAP_SYS_ADMIN or user namespaces): {_UNAVAILABLE}")


def n_procs() -> int:
    return sum(e.isdigit() for e in os.listdir("/proc"))


def uid_procs(uid) -> list[str]:
    out = []
    for e in os.listdir("/proc"):
        try:
            if e.isdigit() and os.stat(f"/proc/{e}").st_uid == uid:
                out.append(e)
        except FileNotFoundError:
            pass
    return out


def test_runs_program_on_stdin():
    r = run_program("import sys\nprint(sum(map(int, sys.stdin.read().split())))", "2 3\n")
    assert r.status == "ok" and r.stdout == "5\n" and r.returncode == 0
    r = run_program("raise SystemExit(3)")
    assert r.status == "runtime_error" and r.returncode == 3
    if os.geteuid() == 0:
        assert r.uid is not None and r.uid != 0


def test_infinite_loop_killed_near_time_limit():
    t0 = time.monotonic()
    r = run_program("while True:\n    pass", time_limit_s=1.0)
    assert r.status == "timeout"
    assert 0.9 <= r.wall_s < 1.5 and time.monotonic() - t0 < 3.0


def test_fork_bomb_contained():
    before = n_procs()
    t0 = time.monotonic()
    # keeps forking even when fork fails, so only the time limit ends it
    r = run_program("import os\nwhile True:\n    try:\n        os.fork()\n"
                    "    except OSError:\n        pass", time_limit_s=2.0, max_processes=16)
    assert r.status == "timeout" and time.monotonic() - t0 < 5.0
    # the plain bomb dies on the first failed fork
    r2 = run_program("import os\nwhile True: os.fork()", time_limit_s=2.0, max_processes=16)
    assert r2.status == "runtime_error" and "Resource temporarily unavailable" in r2.stderr
    if r.uid is not None:
        assert uid_procs(r.uid) == [] and uid_procs(r2.uid) == []
    assert n_procs() <= before + 5  # nothing left behind on the host


def test_escaped_grandchild_dies_with_the_run():
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"            # leaves the process group a group kill would hit
            "    time.sleep(1000)\n"
            "print('done', flush=True)\n")
    r = run_program(code, time_limit_s=5.0)
    assert r.status == "ok" and r.stdout == "done\n"
    if r.uid is not None:
        assert uid_procs(r.uid) == []


def test_memory_hog_fails():
    r = run_program("x = bytearray(2 * 1024 ** 3)\nprint(len(x))", memory_limit_mb=256)
    assert r.status == "memory" and r.stdout == ""


def test_no_network():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []

    def accept():
        server.settimeout(3.0)
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    th = threading.Thread(target=accept)
    th.start()
    code = ("import socket, sys\n"
            "for addr in [('127.0.0.1', int(input())), ('1.1.1.1', 80)]:\n"
            "    try:\n"
            "        socket.create_connection(addr, timeout=2).close()\n"
            "        print('connected', addr)\n"
            "    except OSError as e:\n"
            "        print('refused', addr[0], e.errno)\n")
    r = run_program(code, f"{port}\n", time_limit_s=10)
    th.join()
    server.close()
    assert r.status == "ok", r.stderr
    assert "connected" not in r.stdout and r.stdout.count("refused") == 2
    assert accepted == []


def test_writes_outside_workdir_do_not_reach_host():
    marker = f"megarl-sandbox-marker-{uuid.uuid4().hex}"
    pkg_dir = Path(megarl.__file__).parent
    code = (f"import os\n"
            f"open('/tmp/{marker}', 'w').write('x')\n"   # private tmpfs: vanishes
            f"open('scratch.txt', 'w').write('y')\n"      # its own cwd: allowed
            f"print(os.getcwd())\n"
            f"open({str(pkg_dir / marker)!r}, 'w').write('z')\n")
    r = run_program(code)
    assert not (Path("/tmp") / marker).exists() and not (pkg_dir / marker).exists()
    # the package's directory is not in the sandbox's root at all
    assert r.status == "runtime_error" and "FileNotFoundError" in r.stderr, r.stderr
    assert r.stdout == "/tmp/sandbox\n"


def test_output_limit():
    r = run_program("print('x' * 10_000_000)", max_output_bytes=4096)
    assert r.status == "output_limit" and len(r.stdout) <= 4096


def test_bad_limits_rejected():
    with pytest.raises(ValueError, match="time_limit_s"):
        run_program("pass", time_limit_s=0)
    with pytest.raises(ValueError, match="max_processes"):
        run_program("pass", max_processes=0)


def test_a_setup_step_that_fails_runs_nothing_and_says_so(tmp_path):
    """The program's interpreter missing from the sandbox's root: a setup failure, reported as
    the sandbox being unavailable (with the reason), not as the program's own error."""
    marker = tmp_path / "ran"
    with pytest.raises(SandboxUnavailableError, match="cannot start /nonexistent/python3"):
        run_program(f"open({str(marker)!r}, 'w')", python="/nonexistent/python3")
    assert not marker.exists()
