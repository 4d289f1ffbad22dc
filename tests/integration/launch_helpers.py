"""Launch helpers for the multi-process tests: torchrun'd rank programs and the tools.

A module with its own name rather than conftest.py, so `import` finds it whichever conftest
pytest happened to load first.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "integration" / "scripts"


def torchrun(script: str | Path, nproc: int, *args, timeout: float = 600) -> str:
    """Run a script under torch.distributed.run with `nproc` gloo ranks; return its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
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
