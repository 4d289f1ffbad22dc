"""megarl across hosts: network namespaces as machines (tests/integration/hosts.py).

Every process runs inside a "host" that has only its own address on a private subnet and its
own loopback, so a process that binds or advertises 127.0.0.1 on a path between hosts fails
here as it would on a cluster. The addresses are asserted from inside the hosts.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hosts import Hosts, unavailable
from launch_helpers import CONTROL_SECRET, ROOT, munged_command, slurm_conf

pytestmark = [pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
              pytest.mark.multihost]

SCRIPT = ROOT / "launch" / "torchrun.sh"
NO_RAY = {"RAY_ADDRESS": "127.0.0.1:9"}  # any ray.init would fail: Ray plays no part


@pytest.fixture(autouse=True)
def _no_leftovers():
    Hosts.cleanup_stale()


@pytest.fixture
def short_tmp():
    """A directory with a short path: Ray's and munge's Unix sockets live under it (108-byte
    limit), and pytest's tmp_path can be longer than that leaves room for."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="mrl-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _overrides(assets, run_dir, steps, *extra):
    return [f"actor_rollout_ref.model.path={assets / 'tiny'}",
            f"data.train_files={assets / 'data' / 'train.jsonl'}",
            f"data.val_files={assets / 'data' / 'val.jsonl'}",
            f"trainer.default_local_dir={run_dir}", "trainer.experiment_name=t",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
            "trainer.val_before_train=False", "trainer.logger=[console,tensorboard]",
            "trainer.separated_node_tasks=[[logp,actor-train,ref_logp],[generate]]",
            "trainer.separated_node_ratios=[0.5,0.5]", *extra]


def _torchrun(hs: Hosts, nodes: int, assets, run_dir, steps, *extra, tag="", **env_extra):
    """`launch/torchrun.sh` once per host, one device each, rendezvous on host 0."""
    procs = []
    for node in range(nodes):
        env = dict(os.environ, NNODES=str(nodes), NODE_RANK=str(node), MASTER_ADDR=hs.addr(0),
                   MASTER_PORT="29500", NPROC_PER_NODE="1", OMP_NUM_THREADS="1",
                   PYTHON=sys.executable, **NO_RAY, **CONTROL_SECRET, **env_extra)
        with open(run_dir / f"node{node}{tag}.log", "w") as log:
            procs.append(hs.popen(node, ["bash", str(SCRIPT),
                                         str(ROOT / "configs" / "quickstart.yaml"),
                                         *_overrides(assets, run_dir, steps, *extra)],
                                  env=env, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir))
    return procs


def _log(run_dir, node, tag=""):
    return (run_dir / f"node{node}{tag}.log").read_text()


def _trained_steps(run_dir):
    f = run_dir / "megarl" / "t" / "trained_prompts.jsonl"
    return sorted({json.loads(x)["step"] for x in f.read_text().splitlines()})


def _servers(text: str) -> list[tuple[str, int]]:
    m = re.search(r"rollout servers: (.*) \(", text)
    assert m, text[-3000:]
    return [(u.split("//")[1].rsplit(":", 1)[0], int(u.rsplit(":", 1)[1]))
            for u in m.group(1).split(", ")]


def test_torchrun_on_four_hosts_trains_with_weights_synced_across_them(quickstart_assets,
                                                                       tmp_path):
    """Four hosts, one device each: the trainer on hosts 0 and 1 (its data-parallel group
    spans them), one rollout engine on each of hosts 2 and 3, the weight-update group from
    host 0 to both."""
    with Hosts(4) as hs:
        procs = _torchrun(hs, 4, quickstart_assets, tmp_path, 3, "trainer.save_freq=-1")
        # While the run lives: each engine listens on its own host's address, nowhere else.
        bound, deadline = {}, time.time() + 240
        while len(bound) < 2 and time.time() < deadline and procs[0].poll() is None:
            if "rollout servers:" in _log(tmp_path, 0):
                for host, port in _servers(_log(tmp_path, 0)):
                    i = [hs.addr(j) for j in range(4)].index(host)
                    bound[i] = [a for a, p, _ in hs.listening(i) if p == port]
            time.sleep(0.2)
        codes = [p.wait(timeout=300) for p in procs]
        logs = [_log(tmp_path, n) for n in range(4)]
    assert codes == [0, 0, 0, 0], "\n".join(f"--- node {n}\n{x[-3000:]}"
                                            for n, x in enumerate(logs))
    assert bound == {2: [hs.addr(2)], 3: [hs.addr(3)]}, bound
    assert [h for h, _ in _servers(logs[0])] == [hs.addr(2), hs.addr(3)]
    # Ranks advertise their host's address, and the trainer's process groups (DP across
    # hosts 0 and 1) use the interface toward host 0, not the hostname's loopback address.
    for n in range(4):
        assert f"serving (node {hs.addr(n)}, life 0)" in logs[n] or n == 0
    for n in (0, 1):
        assert f"process groups on interface eth0 (toward {hs.addr(0)})" in logs[n], logs[n]
    assert re.search(r"actor model: 2 process\(es\) on group \S+ \(devices \[0, 1\]\), DP=2",
                     logs[0]), logs[0][-3000:]
    # Both engines joined the update group at host 0's address and took every version.
    for n in (2, 3):
        assert re.search(rf"joined weight-update group .* \(gloo, {re.escape(hs.addr(0))}:\d+\)",
                         logs[n]), logs[n][-3000:]
        for v in range(3):
            assert f"version {v} -> {v + 1}" in logs[n], logs[n][-3000:]
    assert "127.0.0.1" not in "".join(logs[1:])
    assert _trained_steps(tmp_path) == [0, 1, 2]


BOUND_S = 60  # from the link going down to the run noticing the loss (docs/launch.md)


def test_a_host_cut_off_restarts_the_run_which_waits_for_it_and_finishes(quickstart_assets,
                                                                         tmp_path):
    """Two hosts, `trainer.max_restarts=1`: the trainer on host 0, the engine on host 1. Host
    1's link goes down once a checkpoint exists: the run must notice within BOUND_S, naming
    host 1 and what it was doing, not hang; its next life waits for host 1's rank (the
    placement is static), which its node's torchrun restarts once the link is back; the run
    resumes from the checkpoint and finishes every step, both launches exiting 0."""
    steps = 12
    extra = ("trainer.save_freq=4", "trainer.max_restarts=1", "trainer.restart_backoff_s=1",
             "actor_rollout_ref.rollout.engine_health_interval_s=1",
             "actor_rollout_ref.rollout.engine_health_timeout_s=5")
    beat = {"MEGARL_TORCHRUN_HEARTBEAT_S": "5"}
    latest = tmp_path / "megarl" / "t" / "latest_checkpointed_iteration.txt"
    with Hosts(2) as hs:
        procs = _torchrun(hs, 2, quickstart_assets, tmp_path, steps, *extra, **beat)
        deadline = time.time() + 240
        while not latest.exists() and time.time() < deadline and procs[0].poll() is None:
            time.sleep(0.05)
        assert latest.exists(), _log(tmp_path, 0)[-3000:]
        hs.link(1, up=False)
        cut = time.time()
        while "rank 0: the run failed" not in _log(tmp_path, 0) and \
                time.time() - cut < BOUND_S + 60 and procs[0].poll() is None:
            time.sleep(0.2)
        took, node0 = time.time() - cut, _log(tmp_path, 0)
        assert "rank 0: the run failed" in node0, \
            f"{took:.0f} s, exit {procs[0].poll()}\n{node0[-4000:]}"
        assert took <= BOUND_S, f"{took:.0f} s\n{node0[-4000:]}"
        # The loss names the host and what the run was doing: the generation that found its
        # engine dead, or, when the cut comes while nothing calls the engine (a SYNC blocked
        # on the broadcast to it), the work in flight when the heartbeat gave the host up
        assert re.search(rf"GENERATE\(\d+\)@\S+ failed: NoEngineLeft: no rollout engine left: "
                         rf"rollout engine 0 \(http://{re.escape(hs.addr(1))}:\d+\): dead",
                         node0) or re.search(
            r"a rank was lost while [A-Z_]+\(\d+\)@\S+.* ran: RankLost: rank 1 on host "
            rf"{re.escape(hs.addr(1))} has had no heartbeat", node0), node0[-4000:]
        time.sleep(5)  # the next life waits for host 1's rank while the link is down
        assert "restart 1/1" not in _log(tmp_path, 0) and procs[0].poll() is None
        hs.link(1, up=True)
        back = time.time()
        codes = [p.wait(timeout=300) for p in procs]
        node0, node1 = _log(tmp_path, 0), _log(tmp_path, 1)
    assert codes == [0, 0], f"{codes}\n--- node 0\n{node0[-4000:]}\n--- node 1\n{node1[-3000:]}"
    saved = int(re.search(r"resuming after step (\d+) from", node0)[1])
    # global_step_<saved> holds `saved` completed steps: training goes on at step saved+1
    assert f"training continues at step {saved + 1}/{steps}" in node0, node0[-3000:]
    assert f"rank 1/2 serving (node {hs.addr(1)}, life 1)" in node1, node1[-3000:]
    # the next life names the loss: host 1's address (its engine's URL, or the silent rank)
    assert re.search(rf"run lost \(.*{re.escape(hs.addr(1))}.*\); restart 1/1", node0), \
        node0[-4000:]
    assert _trained_steps(tmp_path) == list(range(steps))
    print(f"link back to training again: {time.time() - back:.0f} s (upper bound)")


# ------------------------------------------------------------------ Ray
def _ray_env():
    venv_bin = os.path.dirname(sys.executable)
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false", RAY_USAGE_STATS_ENABLED="0",
                PATH=f"{venv_bin}:{os.environ['PATH']}",
                # a token of the test's own, handed to every daemon and the driver
                RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.urandom(32).hex())


def _ray_cluster(hs: Hosts, short_tmp, env, cpus: int | list[int]) -> str:
    """`ray start` on every host the way docs/launch.md says for a cluster without Slurm: the
    head on host 0, the others joining it, each naming its own address."""
    head = f"{hs.addr(0)}:6379"
    for i in range(hs.n):
        where = ["--head", "--port=6379", "--include-dashboard=false"] if i == 0 else \
            [f"--address={head}"]
        r = hs.run(i, ["ray", "start", *where, f"--node-ip-address={hs.addr(i)}",
                       f"--num-cpus={cpus if isinstance(cpus, int) else cpus[i]}",
                       "--disable-usage-stats",
                       f"--temp-dir={short_tmp / f'ray{i}'}"], env=env, timeout=180)
        assert r.returncode == 0, f"ray start on host {i}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return head


# ------------------------------------------------------------------ Slurm
def test_slurm_on_two_hosts_trains_and_converts(quickstart_assets, tmp_path):
    """slurmctld on host 0, a slurmd on each host (its own NodeName and address):
    - `sbatch -N 2 launch/slurm_ray.sh` brings Ray up on both nodes (head on node 0, a worker
      joining it from node 1) and runs the quickstart with trainer.nnodes=2, groups on whole
      hosts, saving a checkpoint at the end;
    - `sbatch -N 1 -w n1 launch/slurm_convert.sh mcore2hf` exports it on the second node
      (conversion is one node's work: its ranks run under `torchrun --standalone`).
    (`slurm_validate.sh` brings Ray up as `slurm_ray.sh` does; it serves a checkpoint's
    weights in test_slurm_launch.py::test_validate_job_serves_the_checkpoint_weights.)"""
    import shutil
    import tempfile

    sbin = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"],
                            "/usr/sbin", "/sbin"])
    if not all(shutil.which(b, path=sbin) for b in ("slurmctld", "slurmd", "munged", "sbatch")):
        pytest.fail("Slurm/munge missing: run `bash tools/install_slurm.sh` (as root) first",
                    pytrace=False)
    d = Path(tempfile.mkdtemp(prefix="mrl-mh-", dir="/tmp"))  # short: Unix socket paths
    for sub in ("state", "log", "run", "spool-n0", "spool-n1"):
        (d / sub).mkdir()
    env = dict(_ray_env(), PATH=sbin, SLURM_CONF=str(d / "slurm.conf"),
               RAY_TMPDIR=str(d / "ray"), RAY_START_TIMEOUT="120", RAY_STOP_ON_NODES="0",
               MEGARL_VENV=sys.prefix)
    env.pop("RAY_AUTH_TOKEN")  # the script makes one per job
    config = str(ROOT / "configs" / "quickstart.yaml")
    common = _overrides(quickstart_assets, tmp_path, 4, "trainer.save_freq=4",
                        "trainer.n_gpus_per_node=2")
    jobs = {}
    try:
        munged = subprocess.run(munged_command(d), env=env, capture_output=True, text=True)
        assert munged.returncode == 0, munged.stderr
        with Hosts(2) as hs:
            ctl = f"{socket.gethostname().split('.')[0]}({hs.addr(0)})"
            (d / "slurm.conf").write_text(slurm_conf(
                d, ctl, ["n0", "n1"], ctl_port=6817, slurmd_port=6818, cpus=2, mem_mb=4096,
                addrs=[hs.addr(0), hs.addr(1)]))

            def ok(i, *cmd):
                r = hs.run(i, [str(c) for c in cmd], env=env, timeout=120)
                assert r.returncode == 0, f"{cmd} on host {i}: {r.stdout}\n{r.stderr}"
                return r.stdout

            def submit(name, *args, watch=None, timeout=400):
                """sbatch on host 0; waits for the end. Returns (state, output, watched):
                `watch` runs once, while the job runs, when its output first shows "step 1/"."""
                out_file = d / f"{name}.out"
                job = ok(0, "sbatch", "--parsable", f"--output={out_file}", *args)
                job = job.strip().split(";")[0]
                deadline, watched = time.time() + timeout, None
                while True:
                    so_far = out_file.read_text(errors="replace") if out_file.exists() else ""
                    if watch and watched is None and "step 1/" in so_far:
                        watched = watch()
                    info = ok(0, "scontrol", "show", "job", "-o", job)
                    state = re.search(r"JobState=(\S+)", info).group(1)
                    if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                        break
                    assert time.time() < deadline, so_far[-4000:]
                    time.sleep(0.5)
                out = out_file.read_text(errors="replace")
                (tmp_path / f"{name}.out").write_text(out)  # kept with the test's files
                return state, out, watched

            ok(0, "slurmctld", "-f", d / "slurm.conf")
            for i in range(2):
                ok(i, "slurmd", "-N", f"n{i}", "-f", d / "slurm.conf")
            deadline = time.time() + 60
            while ok(0, "sinfo", "-h", "-N", "-o", "%T").split() != ["idle", "idle"]:
                assert time.time() < deadline, (d / "log" / "slurmctld.log").read_text()[-3000:]
                time.sleep(0.5)
            jobs["train"] = submit("train", "-N", "2", ROOT / "launch" / "slurm_ray.sh",
                                   config, *common,
                                   watch=lambda: {w: hs.where(f"ray::{w}") for w in
                                                  ("MegatronActor", "RolloutActor")})
            run = tmp_path / "megarl" / "t"
            if jobs["train"][0] == "COMPLETED":
                jobs["convert"] = submit("convert", "-N", "1", "-w", "n1",
                                         ROOT / "launch" / "slurm_convert.sh", "mcore2hf",
                                         "--ckpt", run / "global_step_4" / "actor",
                                         "--out", tmp_path / "hf")
    finally:
        for f in (d / "run").glob("*.pid"):
            try:
                os.kill(int(f.read_text().split()[0]), 9)
            except (ProcessLookupError, ValueError):
                pass
        shutil.rmtree(d, ignore_errors=True)
    state, out, placed = jobs["train"]
    assert state == "COMPLETED", out[-5000:]
    assert re.search(r"Ray: 2 of 2 node\(s\) up", out), out[-4000:]
    servers = {h for h, _ in _servers(out)}
    assert len(servers) == 1 and servers < {hs.addr(0), hs.addr(1)}, servers
    i = [hs.addr(0), hs.addr(1)].index(servers.pop())
    # the trainer group (actor and reference, one process per device each) owns the other host
    assert placed == {"MegatronActor": {1 - i: 4}, "RolloutActor": {i: 2}}, placed
    assert "127.0.0.1" not in "".join(x for x in out.splitlines() if "rollout servers" in x)
    assert _trained_steps(tmp_path) == [0, 1, 2, 3]
    # the export ran on the node it was sent to
    state, out, _ = jobs["convert"]
    assert state == "COMPLETED", out[-5000:]
    assert "with 1 rank(s) on n1" in out, out[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file()
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_ray_trainer_host_killed_is_named_and_the_run_restarts_when_it_returns(
        quickstart_assets, tmp_path, short_tmp):
    """`ray start` on three hosts as docs/launch.md says for a cluster without Slurm: the Ray
    head and the driver on host 0 (no devices, as a cluster's head node), two CPU devices on
    each of hosts 1 and 2; `trainer.nnodes=2`: the trainer group and the rollout group each
    get one whole host, the engines serve on their host's address only, the weight-update
    group runs from the trainer's host to theirs. `trainer.max_restarts=1`. Mid-run every
    process on the trainer group's host is killed:
    within BOUND_S the driver names that host and the rank and task lost on it, and restarts
    the run, whose placement waits for the host (each group needs a whole one). Ray started
    on that host again, the run resumes from its checkpoint and finishes every step. (An
    engine host lost, named by its engines' URLs, restarts likewise under torchrun:
    test_a_host_cut_off_restarts_the_run_which_waits_for_it_and_finishes; with engine
    replacements allowed, Ray holds a lost engine's bundle and the run waits inside.)"""
    env = _ray_env()
    steps = 8
    with Hosts(3) as hs:
        head = _ray_cluster(hs, short_tmp, env, cpus=[0, 2, 2])
        driver = hs.popen(0, [sys.executable, "-m", "megarl.cli", "train",
                              "--config", str(ROOT / "configs" / "quickstart.yaml"),
                              *_overrides(quickstart_assets, tmp_path, steps,
                                          "trainer.save_freq=2", "trainer.nnodes=2",
                                          "trainer.n_gpus_per_node=2",
                                          "trainer.max_restarts=1",
                                          "trainer.restart_backoff_s=1")],
                          env=dict(env, RAY_ADDRESS=head), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
        lines, killed, host, noticed, back = [], None, None, None, None
        bound, placed = {}, {}
        for line in driver.stdout:
            lines.append(line)
            if "rollout servers:" in line and not bound:
                for addr, port in _servers(line):
                    i = [hs.addr(j) for j in range(3)].index(addr)
                    bound[i] = [a for a, p, _ in hs.listening(i) if p == port]
            if "step 1/" in line and not placed:  # every worker is up
                placed = {w: hs.where(f"ray::{w}") for w in ("MegatronActor", "RolloutActor")}
            if "step 3/" in line and killed is None:
                (host,) = hs.where("ray::MegatronActor")  # one host holds the whole group
                Hosts._kill_inside(hs.names[host])
                killed = time.time()
            if "restart 1/1 from the newest checkpoint" in line and noticed is None:
                noticed = time.time()
                time.sleep(3)  # the restart's placement waits for the host
                assert "step 4/" not in "".join(lines[-5:])
                r = hs.run(host, ["ray", "start", f"--address={head}",
                                  f"--node-ip-address={hs.addr(host)}", "--num-cpus=2",
                                  "--disable-usage-stats",
                                  f"--temp-dir={short_tmp / f'ray{host}b'}"],
                           env=env, timeout=180)
                assert r.returncode == 0, r.stderr[-3000:]
                back = time.time()
        code = driver.wait(timeout=60)
        out = "".join(lines)
        (tmp_path / "driver.log").write_text(out)  # kept with the test's files
    # placement: one whole host per group (the trainer's actor and reference, one process
    # per device each; the engines), the engines bound to their host's address only
    assert killed is not None and host in (1, 2), out[-4000:]
    engine_host = 3 - host
    assert placed == {"MegatronActor": {host: 4}, "RolloutActor": {engine_host: 2}}, placed
    assert bound == {engine_host: [hs.addr(engine_host)]}, bound
    assert f"process groups on interface eth0 (toward {hs.addr(host)})" in out
    assert re.search(rf"joined weight-update group .* \(gloo, {re.escape(hs.addr(host))}:\d+\)",
                     out), out[-4000:]
    assert noticed is not None and noticed - killed <= BOUND_S, out[-4000:]
    addr = re.escape(hs.addr(host))
    failed = [x for x in out.splitlines() if "megarl.controller.driver" in x and " failed: " in x]
    assert failed, out[-4000:]
    # a lost rank is named with its host, not just Ray's actor id
    assert re.search(rf"(TRAIN|LOGP|REF_LOGP|SYNC)\(\d+\)@\S+ failed: WorkerLost: "
                     rf"(actor|ref) rank \d on host {addr} \(pid \d+\) was lost during ",
                     failed[0]), failed
    assert code == 0, out[-4000:]
    assert re.search(rf"step \d+ restart: restart 1 after: .*{addr}", out), out[-4000:]
    assert _trained_steps(tmp_path) == list(range(steps))
    print(f"host back to the run finished: {time.time() - back:.0f} s")
