"""A launched server's whole process group ends when its launcher does, even a server that
ignores SIGTERM (stock SGLang drains requests on it, possibly for ever) and has forked a child
of its own (SGLang's scheduler and detokenizer): the group guard escalates to SIGKILL. And a
torchrun rank leaving without its orderly shutdown stops every server it started
(`stop_all_servers`, what `_leave` calls). Real processes, no SGLang: a stand-in that ignores
SIGTERM."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from megarl.backends.sglang import launcher

ROOT = Path(__file__).resolve().parents[3]

# ignores SIGTERM (inherited by its child across exec), forks one child, prints both pids
STUBBORN = ("import signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "print(__import__('os').getpid(), c.pid, flush=True)\n"
            "time.sleep(600)\n")

# a launcher: starts the stand-in as launch_server does (own group, PDEATHSIG, guard with a
# 0.5 s grace), says the pids (server, its child, the guard), then waits to be killed. It
# loads launcher.py alone: its package's __init__ imports torch (seconds on a loaded CI core)
LAUNCHER = ("import importlib.util, subprocess, sys, time\n"
            "spec = importlib.util.spec_from_file_location('launcher', sys.argv[2])\n"
            "launcher = sys.modules['launcher'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(launcher)\n"
            "proc, guard = launcher.spawn([sys.executable, '-c', sys.argv[1]], None,\n"
            "                             subprocess.PIPE, grace_s=0.5)\n"
            "print(proc.stdout.readline().decode().strip(), guard.pid, flush=True)\n"
            "time.sleep(600)\n")


def _gone(pids, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_the_server_group_is_killed_when_its_launcher_dies():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, STUBBORN, launcher.__file__],
                            env=env, stdout=subprocess.PIPE, text=True)
    server, child, guard = map(int, proc.stdout.readline().split())
    try:
        assert os.getpgid(child) == server and os.getpgid(guard) == guard
        time.sleep(0.3)  # alive while their launcher is
        assert all(psutil.pid_exists(p) for p in (server, child, guard))
        proc.kill()  # SIGKILL: nothing of the launcher runs after it
        proc.wait()
        # PDEATHSIG's SIGTERM is ignored; the guard's SIGKILL after 0.5 s is not
        assert _gone([server, child, guard], within_s=10), [
            psutil.Process(p).cmdline() for p in (server, child, guard) if psutil.pid_exists(p)]
    finally:
        for p in (server, child, guard):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_stop_all_servers_ends_every_group_this_process_started():
    proc, guard = launcher.spawn([sys.executable, "-c", STUBBORN], None, subprocess.PIPE,
                                 grace_s=0.5)
    server = launcher.ServerProcess(launcher.ServerArgs("m"), proc, None, guard)
    pid, child = map(int, proc.stdout.readline().split())
    try:
        assert pid == proc.pid
        launcher.stop_all_servers(grace_s=0.5)
        proc.wait(5)
        assert _gone([child], within_s=5)
        guard.wait(5)  # it leaves once the group is gone
        server.stop()  # already stopped: its pid is never signalled again
    finally:
        for p in (proc.pid, child, guard.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
