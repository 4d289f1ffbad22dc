"""Launch helpers for the multi-process tests: torchrun'd rank programs and the tools.

A module with its own name rather than conftest.py, so `import` finds it whichever conftest
pytest happened to load first.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "integration" / "scripts"
# The secret a torchrun launch's ranks sign their commands with (utils/control_auth.py):
# launch/torchrun.sh makes one for one node; plain torchrun, and every node of a multi-node
# launch, take it from the environment.
CONTROL_SECRET = {"MEGARL_CONTROL_SECRET": secrets.token_hex(32)}


def torchrun(script: str | Path, nproc: int, *args, timeout: float = 600,
             env: dict | None = None) -> str:
    """Run a script under torch.distributed.run with `nproc` ranks (gloo on CPU); return its
    output. `env`: variables to add (CUDA_VISIBLE_DEVICES="" hides the GPUs)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc.stdout


def run_tool(tool: str, *args, timeout: float = 600) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / tool), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{tool} {args} failed ({proc.returncode}):\n{proc.stderr[-8000:]}")
    return proc.stdout + proc.stderr


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


# ------------------------------------------------------------------ a private Slurm
def slurm_conf(d: Path, controller: str, nodes: list[str], *, ctl_port: int, slurmd_port: int,
               cpus: int, mem_mb: int, addrs: list[str] | None = None) -> str:
    """slurm.conf of a private Slurm under `d` (state, spool, run, log). One node: its files
    are `spool/`, `slurmd.pid`, `slurmd.log`. Several (`slurmd -N NAME` each, at `addrs`):
    per-node files through %n."""
    many = len(nodes) > 1
    per = "-%n" if many else ""
    node_lines = [f"NodeName={n}" + (f" NodeHostname={n} NodeAddr={addrs[i]}" if addrs else "")
                  + f" CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN"
                  for i, n in enumerate(nodes)]
    return "\n".join([
        "ClusterName=megarltest",
        f"SlurmctldHost={controller}",
        f"SlurmctldPort={ctl_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={d}/run/munge.sock",
        "CredType=cred/munge",
        "MpiDefault=none",
        # no cgroups in containers: track processes by parentage, bind nothing
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        "KillWait=10",
        f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool{per}",
        f"SlurmctldPidFile={d}/run/slurmctld.pid",
        f"SlurmdPidFile={d}/run/slurmd{per}.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log",
        f"SlurmdLogFile={d}/log/slurmd{per}.log",
        *node_lines,
        f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP",
        ""])


def munged_command(d: Path) -> list[str]:
    """munged for a private Slurm under `d`, with a fresh key: `--force` runs it as root with
    its own key and socket instead of the packaged service."""
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    return ["munged", "--force", f"--key-file={key}", f"--socket={d}/run/munge.sock",
            f"--pid-file={d}/run/munged.pid", f"--log-file={d}/log/munged.log",
            f"--seed-file={d}/run/munge.seed"]
