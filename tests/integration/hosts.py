"""Several "hosts" on one machine: Linux network namespaces joined by veth pairs to a bridge.

Each host is a namespace with loopback up and one interface on a private subnet; the bridge
lives in a namespace of its own (the "switch"), so nothing in the machine's own namespace is
touched and no traffic can leave the namespaces made here. Processes run inside a host with
`ip netns exec` and see only that host's addresses, so a process that binds or advertises the
wrong address (127.0.0.1 on a cross-host path) fails as it would on a real cluster.

    with Hosts(2) as hs:
        p = hs.popen(0, ["python", "-m", "http.server", "--bind", hs.addr(0)])
        hs.run(1, ["curl", f"http://{hs.addr(0)}:8000"])

Teardown (also on failure and Ctrl-C) kills every process left in a host's namespace, then
deletes the namespaces; `Hosts.cleanup_stale()` removes those of an earlier run that was
killed before it could.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

# A private /24 (RFC 1918) used only inside the namespaces made here.
SUBNET = "10.213.77"


def unavailable() -> str | None:
    """Why hosts cannot be made here (a pytest skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"mrlprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot make a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


class Hosts:
    PREFIX = "mrl"  # every namespace and interface made here starts with this

    def __init__(self, n: int):
        assert 1 <= n <= 8
        self.n = n
        # The creating process's pid is in every name, so a cleanup removes only what a dead
        # test run left behind, never the hosts of a run still going beside it.
        base = f"{self.PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:5]}"
        self.switch = f"{base}-sw"
        self.names = [f"{base}-h{i}" for i in range(n)]
        self._procs: list[subprocess.Popen] = []

    # -- set up and tear down ------------------------------------------------------------------
    def __enter__(self) -> "Hosts":
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("link", "set", "lo", "up", ns=self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for i, name in enumerate(self.names):
            _ip("netns", "add", name)
            _ip("link", "set", "lo", "up", ns=name)
            # Both ends are made inside the switch; one end then moves into the host and is
            # renamed eth0 there, as a real host's interface would be.
            _ip("link", "add", f"p{i}", "type", "veth", "peer", "name", f"e{i}", ns=self.switch)
            _ip("link", "set", f"e{i}", "netns", name, ns=self.switch)
            _ip("link", "set", f"p{i}", "master", "br0", ns=self.switch)
            _ip("link", "set", f"p{i}", "up", ns=self.switch)
            _ip("link", "set", f"e{i}", "name", "eth0", ns=name)
            _ip("addr", "add", f"{self.addr(i)}/24", "dev", "eth0", ns=name)
            _ip("link", "set", "eth0", "up", ns=name)
        # The bridge forwards once its ports have left the listening state (STP is off, so at
        # once on most kernels); wait until each host reaches the others.
        deadline = time.time() + 20
        for i in range(1, self.n):
            while not self.reaches(0, i):
                if time.time() > deadline:
                    raise RuntimeError(f"host 0 cannot reach host {i} ({self.addr(i)})")
                time.sleep(0.2)

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for name in [*self.names, self.switch]:
            self._kill_inside(name)
            _ip("netns", "del", name, check=False)
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    @staticmethod
    def _kill_inside(name: str) -> None:
        r = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in r.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    @classmethod
    def cleanup_stale(cls) -> None:
        """Remove the namespaces of earlier test runs that were killed before their teardown
        (ours by name, and only those whose creating process is gone)."""
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            parts = (line.split() or [""])[0].split("-")
            if len(parts) != 4 or parts[0] != cls.PREFIX or not parts[1].isdigit():
                continue
            try:
                os.kill(int(parts[1]), 0)
                continue  # its run is still going
            except ProcessLookupError:
                pass
            name = "-".join(parts)
            cls._kill_inside(name)
            _ip("netns", "del", name, check=False)

    # -- use -----------------------------------------------------------------------------------
    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def wrap(self, i: int, cmd: list[str]) -> list[str]:
        # nsenter, not `ip netns exec`: that one also remounts /sys for the namespace, which
        # hides /sys/fs/cgroup from daemons that need it (slurmd); only the network differs.
        return ["nsenter", f"--net=/run/netns/{self.names[i]}", "--", *cmd]

    def popen(self, i: int, cmd: list[str], **kw) -> subprocess.Popen:
        """Start `cmd` in host i, in a session of its own (so teardown can kill its tree)."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.wrap(i, cmd), **kw)
        self._procs.append(p)
        return p

    def run(self, i: int, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.wrap(i, cmd), **kw)

    def reaches(self, i: int, j: int, timeout: float = 1.0) -> bool:
        """Whether host i gets an answer from host j: a TCP connect to a closed port is
        refused by a reachable host and times out (or is unreachable) otherwise."""
        probe = ("import socket,sys\n"
                 "try: socket.create_connection((sys.argv[1], 9), float(sys.argv[2]))\n"
                 "except ConnectionRefusedError: sys.exit(0)\n"
                 "except OSError: sys.exit(1)\n")
        return self.run(i, [sys.executable, "-c", probe, self.addr(j), str(timeout)],
                        timeout=timeout + 10).returncode == 0

    def link(self, i: int, up: bool) -> None:
        """Host i's network up or down (its cable pulled: the interface on the switch side)."""
        _ip("link", "set", f"p{i}", "up" if up else "down", ns=self.switch)

    def processes(self, i: int) -> list[str]:
        """The command lines of the processes running in host i."""
        r = subprocess.run(["ip", "netns", "pids", self.names[i]], capture_output=True,
                           text=True)
        out = []
        for pid in r.stdout.split():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out.append(f.read().replace(b"\0", b" ").decode(errors="replace").strip())
            except OSError:
                pass  # ended meanwhile
        return out

    def where(self, marker: str) -> dict[int, int]:
        """host -> how many of its processes have `marker` in their command line."""
        counts = {i: sum(marker in c for c in self.processes(i)) for i in range(self.n)}
        return {i: c for i, c in counts.items() if c}

    def listening(self, i: int) -> list[tuple[str, int, str]]:
        """(address, port, process) of every TCP socket listening in host i."""
        r = self.run(i, ["ss", "-Hltnp"])
        out = []
        for line in r.stdout.splitlines():
            cols = line.split()
            if len(cols) < 4:
                continue
            host, _, port = cols[3].rpartition(":")
            proc = cols[5] if len(cols) > 5 else ""
            out.append((host.strip("[]"), int(port), proc))
        return out
