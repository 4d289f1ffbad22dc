"""launch/slurm_*.sh under a real one-machine Slurm (slurmctld + slurmd + munged, private).

The fixture starts the three daemons as root with their own key, sockets, ports, state and logs
under a temp dir, so neither the packages' system services nor other users are touched; it
stops them (and cancels any job left) however the tests end. Jobs run the real scripts:
Ray head via srun, `megarl train`/`validate`/`convert` on the tiny quickstart task.

Jobs are waited for by polling `scontrol show job` each second rather than `sbatch --wait`,
whose back-off polling added ~30 s per job here; the job's exit code is checked the same.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launch_helpers import ROOT, munged_command, slurm_conf

pytestmark = pytest.mark.timeout(900)

SBIN = os.pathsep.join(["/usr/sbin", "/sbin"])
BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _kill_pidfile(path: Path, timeout: float = 10.0) -> None:
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.time() + timeout
        while time.time() < deadline:
            os.kill(pid, 0)
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _pids_matching(text: str) -> list[int]:
    """Processes whose command line contains `text` (this test's own paths only)."""
    out = subprocess.run(["pgrep", "-f", text], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != os.getpid()]


class Slurm:
    """A running private Slurm: run client commands against it and submit jobs."""

    def __init__(self, d: Path):
        self.dir = d
        self.host = socket.gethostname().split(".")[0]
        self.ray_tmp = d / "ray"  # every Ray process of the jobs has this in its command line
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", ""), SBIN])
        self.env = dict(os.environ, PATH=path, SLURM_CONF=str(d / "slurm.conf"),
                        RAY_TMPDIR=str(self.ray_tmp), RAY_PORT=str(_free_port()),
                        RAY_START_TIMEOUT="120", OMP_NUM_THREADS="1",
                        # Not `ray stop` on the node: on a shared dev box it would also stop
                        # other users' Ray; the tests check the jobs' own teardown suffices.
                        RAY_STOP_ON_NODES="0")
        if sys.prefix != sys.base_prefix:
            self.env["MEGARL_VENV"] = sys.prefix

    def run(self, *cmd, check=True) -> subprocess.CompletedProcess:
        p = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=120)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} -> {p.returncode}\n{p.stdout}\n{p.stderr}\n"
                                 f"{self.logs()}")
        return p

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            f = self.dir / "log" / name
            if f.exists():
                parts.append(f"--- {name}\n" + "\n".join(f.read_text().splitlines()[-20:]))
        return "\n".join(parts)

    def submit(self, script: str, *args, sbatch=()) -> str:
        out = self.run("sbatch", "--parsable", f"--output={self.dir}/job-%j.out", *sbatch,
                       str(ROOT / "launch" / script), *map(str, args)).stdout
        return out.strip().split(";")[0]

    def wait(self, job: str, timeout: float = 600) -> tuple[str, int, str]:
        """Wait for `job` to end: (state, exit code, its output file's text)."""
        deadline = time.time() + timeout
        while True:
            info = self.run("scontrol", "show", "job", "-o", job).stdout
            state = re.search(r"JobState=(\S+)", info).group(1)
            if state in TERMINAL:
                break
            if time.time() > deadline:
                self.run("scancel", job, check=False)
                raise AssertionError(f"job {job} still {state} after {timeout}s\n"
                                     f"{self.output(job)[-4000:]}")
            time.sleep(1)
        code = int(re.search(r"ExitCode=(\d+):", info).group(1))
        return state, code, self.output(job)

    def output(self, job: str) -> str:
        f = self.dir / f"job-{job}.out"
        return f.read_text(errors="replace") if f.exists() else ""

    def ray_leftovers(self) -> list[str]:
        return [Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:200]
                for p in _pids_matching(str(self.ray_tmp)) if Path(f"/proc/{p}").exists()]


@pytest.fixture(scope="module")
def slurm():
    search = os.pathsep.join([os.environ.get("PATH", ""), SBIN])
    missing = [b for b in BINARIES if not shutil.which(b, path=search)]
    if missing:
        pytest.fail(f"Slurm/munge binaries missing ({', '.join(missing)}): run "
                    "`bash tools/install_slurm.sh` (as root) first", pytrace=False)
    if os.geteuid() != 0:
        pytest.fail("this test starts slurmctld/slurmd/munged as root (SlurmUser=root); "
                    "run it as root", pytrace=False)
    cpus = os.cpu_count() or 1
    if cpus < 2:
        pytest.fail(f"the quickstart needs 2 CPU devices; this machine has {cpus} CPU",
                    pytrace=False)
    mem_mb = int(int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())
                     .group(1)) / 1024 * 0.9)
    # Short path: Ray's and munge's Unix sockets live under it (108-byte limit).
    d = Path(tempfile.mkdtemp(prefix="mrl-slurm-", dir="/tmp"))
    for sub in ("state", "spool", "log", "run"):
        (d / sub).mkdir()
    s = Slurm(d)
    (d / "slurm.conf").write_text(slurm_conf(d, s.host, [s.host], ctl_port=_free_port(),
                                             slurmd_port=_free_port(), cpus=cpus,
                                             mem_mb=mem_mb))
    try:
        s.run(*munged_command(d))
        s.run("slurmctld", "-f", str(d / "slurm.conf"))
        s.run("slurmd", "-f", str(d / "slurm.conf"))
        deadline = time.time() + 60
        while "idle" not in s.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout:
            if time.time() > deadline:
                raise AssertionError(f"node never became idle:\n{s.logs()}")
            time.sleep(0.5)
        yield s
    finally:
        # Cancel what is left so slurmstepd and the jobs' processes go with the daemons.
        jobs = s.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            s.run("scancel", *jobs, check=False)
            deadline = time.time() + 30
            while s.run("squeue", "-h", check=False).stdout.strip() and time.time() < deadline:
                time.sleep(1)
        for name in ("slurmd", "slurmctld", "munged"):
            _kill_pidfile(d / "run" / f"{name}.pid")
        for pid in _pids_matching(str(d)):  # only processes under this test's own temp dir
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def assets(slurm):
    from megarl.data.synthetic import make_quickstart_task
    from megarl.utils.tiny_model import make_tiny_model

    make_tiny_model(slurm.dir / "tiny", "qwen2")
    make_quickstart_task(slurm.dir / "data")
    return slurm.dir


def _paths(assets) -> list[str]:
    return [f"actor_rollout_ref.model.path={assets / 'tiny'}",
            f"data.train_files={assets / 'data' / 'train.jsonl'}",
            f"data.val_files={assets / 'data' / 'val.jsonl'}",
            f"trainer.default_local_dir={assets / 'runs'}", "trainer.experiment_name=t"]


CONFIG = "configs/quickstart.yaml"


@pytest.fixture(scope="module")
def train_job(slurm, assets):
    """The quickstart as a job: 4 steps, a checkpoint every 2, `trainer.max_restarts=1`;
    once the checkpoint of step 2 exists its node "fails": megarl is frozen where it stands
    (SIGSTOP; the two steps left take about a second, less than Slurm takes to requeue), and
    the job is requeued (`scontrol requeue`: what Slurm does to a `--requeue` job when one of
    its nodes fails), so the job runs twice."""
    import psutil

    run = assets / "runs" / "megarl" / "t"
    job = slurm.submit("slurm_ray.sh", CONFIG, *_paths(assets), "trainer.total_training_steps=4",
                       "trainer.save_freq=2", "trainer.test_freq=4", "trainer.max_restarts=1",
                       "trainer.val_before_train=False")
    latest, deadline = run / "latest_checkpointed_iteration.txt", time.time() + 300
    polls = 0
    while not (latest.exists() and latest.read_text().strip() == "2"):
        if polls % 20 == 0:  # the job's state once a second, the checkpoint every 50 ms
            info = slurm.run("scontrol", "show", "job", "-o", job).stdout
            assert time.time() < deadline and not any(f"JobState={t} " in info
                                                      for t in TERMINAL), \
                slurm.output(job)[-4000:]
        polls += 1
        time.sleep(0.05)
    megarl = [p for p in psutil.process_iter(["cmdline"])
              if "megarl.cli" in (p.info["cmdline"] or []) and str(assets / "tiny")
              in " ".join(p.info["cmdline"] or [])]
    assert len(megarl) == 1, megarl
    megarl[0].suspend()  # Slurm's kill sends SIGCONT before its SIGTERM
    assert latest.read_text().strip() == "2", "the run reached its end before it was frozen"
    slurm.run("scontrol", "requeue", job)
    # Slurm holds a requeued job back (its begin time two minutes on): make it eligible now
    while "JobState=PENDING" not in slurm.run("scontrol", "show", "job", "-o", job).stdout:
        assert time.time() < deadline, slurm.output(job)[-4000:]
        time.sleep(0.2)
    while (u := slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now",
                          check=False)).returncode:
        assert time.time() < deadline, u.stdout + u.stderr  # refused while it still cleans up
        time.sleep(0.5)
    state, code, out = slurm.wait(job)
    return {"state": state, "code": code, "out": out, "run": run,
            "leftovers": slurm.ray_leftovers()}


def test_train_job_requeued_resumes_checkpoints_and_tears_ray_down(train_job, assets):
    from test_train_e2e import fresh_loader, scalars, trained

    out = train_job["out"]
    assert (train_job["state"], train_job["code"]) == ("COMPLETED", 0), out[-6000:]
    assert out.count("Ray: 1 of 1 node(s) up") == 2, out[-6000:]  # the job ran twice
    # the requeued job is restart 1 of the run: it resumes after step 2 and says why
    assert "requeued job: restart 1/1 of the run, from its newest checkpoint" in out
    assert "resuming after step 2 from" in out, out[-4000:]
    assert re.search(r"step 2 restart: restart 1 after: Slurm requeued job \d+", out), out[-4000:]
    assert re.search(r"step 4/4 .*reward/mean=", out), out[-4000:]
    assert "megarl exited with status 0" in out
    run = train_job["run"]
    assert scalars(run.parents[1], "trainer/restarts") == {3: 1.0}
    # every step's batch is the one an uninterrupted run draws
    loader = fresh_loader(assets)
    steps = trained(run.parents[1])
    assert sorted(steps) == [0, 1, 2, 3]
    for k in range(4):
        assert steps[k] == sorted(p.uid for p in loader.next_batch()), k
    # named by completed steps (as verl): after the fourth (last) step, global_step_4
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (run / "global_step_4" / "driver_state.json").is_file()
    assert (run / "global_step_4" / "actor").is_dir()
    assert "stopping Ray on 1 node(s)" in out
    assert train_job["leftovers"] == [], "Ray processes outlived the job"


def test_validate_job_serves_the_checkpoint_weights(slurm, assets, train_job):
    assert train_job["code"] == 0, "needs the train job's checkpoint"
    trained = (train_job["run"] / "trained_prompts.jsonl").read_text()
    # the run directory: the script follows latest_checkpointed_iteration.txt to global_step_4
    job = slurm.submit("slurm_validate.sh", CONFIG, train_job["run"], *_paths(assets))
    state, code, out = slurm.wait(job)
    assert (state, code) == ("COMPLETED", 0), out[-6000:]
    ckpt = train_job["run"] / "global_step_4"
    assert f"validating checkpoint {ckpt}" in out
    assert f"loaded Megatron checkpoint {ckpt / 'actor'}" in out
    # the engines validated the checkpoint's weights (v4, after four steps), not the HF init
    assert re.search(r"validation of weights v4: val/reward_mean=", out), out[-4000:]
    assert (train_job["run"] / "trained_prompts.jsonl").read_text() == trained  # no training
    assert slurm.ray_leftovers() == []


def test_cancelled_job_stops_megarl_and_ray(slurm, assets, train_job):
    # after the train job: both need the node's 2 CPUs
    job = slurm.submit("slurm_ray.sh", CONFIG, *_paths(assets), "trainer.experiment_name=c",
                       "trainer.total_training_steps=1000", "trainer.save_freq=-1",
                       "trainer.test_freq=-1", "trainer.val_before_train=False")
    deadline = time.time() + 300
    while not re.search(r"step \d+/1000", slurm.output(job)):
        assert time.time() < deadline, slurm.output(job)[-4000:]
        assert "JobState=RUNNING" in slurm.run("scontrol", "show", "job", "-o", job).stdout \
            or "JobState=PENDING" in slurm.run("scontrol", "show", "job", "-o", job).stdout, \
            slurm.output(job)[-4000:]
        time.sleep(1)
    slurm.run("scancel", job)
    state, _, out = slurm.wait(job, timeout=120)
    assert state == "CANCELLED", out[-4000:]
    assert "caught SIGTERM: stopping megarl and Ray" in out, out[-4000:]
    # Slurm's KillWait (10 s) bounds how long anything of the job may live on
    deadline = time.time() + 15
    while slurm.ray_leftovers() and time.time() < deadline:
        time.sleep(1)
    assert slurm.ray_leftovers() == []


def test_megarl_failure_is_the_job_status_and_ray_still_stops(slurm, assets, train_job):
    # a model dir without config.json passes the config check (`megarl config`, before the
    # script starts Ray) but fails inside `megarl train` (its file checks), once Ray is up
    job = slurm.submit("slurm_ray.sh", CONFIG, *_paths(assets), "trainer.experiment_name=f",
                       f"actor_rollout_ref.model.path={assets / 'data'}",
                       "actor_rollout_ref.model.make_tiny=null")
    state, code, out = slurm.wait(job)
    assert (state, code) == ("FAILED", 2), out[-4000:]
    assert "Ray: 1 of 1 node(s) up" in out, out[-4000:]
    assert f"actor_rollout_ref.model.path: {assets / 'data'}" in out, out[-4000:]
    assert "megarl exited with status 2" in out and "stopping Ray on 1 node(s)" in out
    assert slurm.ray_leftovers() == []


def test_bad_config_fails_before_ray_starts(slurm, assets):
    job = slurm.submit("slurm_ray.sh", CONFIG, *_paths(assets),
                       "trainer.separated_node_ratios=[0.3,0.3]")
    state, code, out = slurm.wait(job, timeout=120)
    assert (state, code) == ("FAILED", 2), out
    assert "separated_node_ratios" in out
    assert "Ray head" not in out


def test_validate_job_rejects_a_non_checkpoint(slurm, assets):
    job = slurm.submit("slurm_validate.sh", CONFIG, assets / "data", *_paths(assets))
    state, code, out = slurm.wait(job, timeout=120)
    assert (state, code) == ("FAILED", 2), out
    assert "not a megarl checkpoint" in out


def test_convert_job_exports_hf_and_checks_the_allocation(slurm, train_job):
    assert train_job["code"] == 0, "needs the train job's checkpoint"
    actor = train_job["run"] / "global_step_2" / "actor"
    hf = slurm.dir / "hf"
    too_big = slurm.submit("slurm_convert.sh", "mcore2hf", "--ckpt", actor, "--out",
                           slurm.dir / "hf_tp", "--tp", str((os.cpu_count() or 1) + 1),
                           sbatch=["--cpus-per-task=1"])
    job = slurm.submit("slurm_convert.sh", "mcore2hf", "--ckpt", actor, "--out", hf)
    state, code, out = slurm.wait(too_big, timeout=120)
    assert (state, code) == ("FAILED", 2), out
    assert "resubmit with --cpus-per-task=" in out
    assert not (slurm.dir / "hf_tp").exists()
    state, code, out = slurm.wait(job)
    assert (state, code) == ("COMPLETED", 0), out[-4000:]
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()


def test_install_slurm_is_idempotent(slurm):
    # the fixture found every binary, so the installer must see them too and change nothing
    p = subprocess.run(["bash", str(ROOT / "tools" / "install_slurm.sh")], env=slurm.env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "already installed (slurm-wlm" in p.stdout
