"""Shared fixtures: tiny HF models made locally, and a torchrun launcher for multi-rank tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "integration" / "scripts"


def _make(tmp_path_factory, arch: str) -> Path:
    from megarl.utils.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp(f"tiny-{arch}") / "model"
    # vocab 300 is not a multiple of 128×TP, so Megatron's vocab padding is always exercised.
    return make_tiny_model(out, arch, vocab_size=300, hidden_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, intermediate_size=128,
                           rope_theta=5000.0 if arch == "qwen2" else 10000.0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """Qwen2-shaped: QKV bias, tied embeddings, GQA."""
    return _make(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """Llama-shaped: no bias, untied embeddings, GQA."""
    return _make(tmp_path_factory, "llama")


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
