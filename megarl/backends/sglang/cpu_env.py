"""Running the stock SGLang server on a CPU: its environment, its Python, its flags.

Owns three things the launcher needs when `trainer.device=cpu` and the server is stock
`sglang.launch_server` (laptops, CI; the production path on CPU machines):
- where the server's Python is: sglang pins torch 2.14.1 with CUDA, which must never move
  megarl's own environment, so the server lives in a virtual environment of its own, built by
  `tools/setup_sglang_env.sh` from `cpu/requirements.lock` (`default_venv`, `server_python`);
- the process environment: `SGLANG_USE_CPU_ENGINE=1` (without it sglang's rotary embedding
  imports CUDA ops) and the import shims of `cpu/shim/sitecustomize.py`, loaded only there
  (`server_env`);
- the flags that keep sglang on its torch-native paths (`CPU_FLAGS`).
Nothing here imports sglang. On a GPU none of it applies: the server runs from the `gpu`
extra in megarl's own environment.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megarl.backends.sglang import SGLANG_VERSION

HERE = Path(__file__).resolve().parent / "cpu"
SHIM_DIR = HERE / "shim"
LOCK = HERE / "requirements.lock"
STAMP = ".megarl-sglang-stamp"
"""File in the built environment holding `lock_stamp()`: a stale environment is rebuilt."""

# torch_native attention and the pytorch sampler are sglang's CPU-capable backends; CUDA graphs
# and grammar backends need CUDA or compiled kernels; the tokenizer is never needed (megarl
# sends token ids). --sleep-on-idle: an idle scheduler otherwise polls its sockets without
# pause, measured at ~60% of a core per server here, which a CPU shares with the trainer.
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native",
             "--sampling-backend", "pytorch", "--disable-cuda-graph",
             "--grammar-backend", "none", "--sleep-on-idle")
CPU_MEM_FRACTION = 0.05
"""sglang sizes its KV pool as a fraction of host memory on a CPU; `--max-total-tokens`
(`cpu_max_total_tokens`) is what really bounds it."""


def cache_dir() -> Path:
    return Path(os.environ.get("MEGARL_CACHE_DIR") or Path.home() / ".cache" / "megarl")


def default_venv() -> Path:
    """`$MEGARL_SGLANG_VENV`, else `<cache>/venvs/sglang-<version>-cpu`."""
    env = os.environ.get("MEGARL_SGLANG_VENV")
    return Path(env) if env else cache_dir() / "venvs" / f"sglang-{SGLANG_VERSION}-cpu"


def lock_stamp() -> str:
    import hashlib

    return f"sglang=={SGLANG_VERSION} " + hashlib.sha256(LOCK.read_bytes()).hexdigest()[:16]


def venv_status(venv: Path | None = None) -> str | None:
    """None when `venv` (default `default_venv()`) is a built, current server environment;
    else why not, naming the path and the command that builds it."""
    venv = Path(venv or default_venv())
    build = "build it with: bash tools/setup_sglang_env.sh (or tools/setup_env.sh --sglang)"
    if not (venv / "bin" / "python").exists():
        return f"no stock SGLang environment at {venv}; {build}"
    stamp = venv / STAMP
    if not stamp.exists() or stamp.read_text().strip() != lock_stamp():
        return f"the stock SGLang environment at {venv} is out of date; {build}"
    return None


def server_python(configured: str | None = None) -> str:
    """The Python that runs a stock server: `configured` (`rollout.server_python`), else
    `$MEGARL_SGLANG_PYTHON`, else the built CPU environment when it is current, else this
    Python (a GPU install, where sglang sits in megarl's own environment)."""
    if configured:
        return configured
    if os.environ.get("MEGARL_SGLANG_PYTHON"):
        return os.environ["MEGARL_SGLANG_PYTHON"]
    if venv_status() is None:
        return str(default_venv() / "bin" / "python")
    return sys.executable


def server_env(base: dict | None = None, tp_size: int = 1) -> dict:
    """Environment additions for a stock server on a CPU: the CPU engine and the shims, and
    for TP > 1 the cores of each TP rank (`SGLANG_CPU_OMP_THREADS_BIND`, `a-b|c-d|...`):
    without it sglang allows one rank per NUMA node only. The cores this process may use are
    split evenly; with fewer cores than ranks, ranks share them round robin."""
    base = base or os.environ
    path = base.get("PYTHONPATH", "")
    env = {"SGLANG_USE_CPU_ENGINE": "1", "MEGARL_SGLANG_CPU_SHIM": "1",
           "PYTHONPATH": str(SHIM_DIR) + (os.pathsep + path if path else ""),
           "CUDA_VISIBLE_DEVICES": ""}
    if tp_size > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in base:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = cores_per_rank(sorted(os.sched_getaffinity(0)),
                                                            tp_size)
    return env


def cores_per_rank(cores: list[int], ranks: int) -> str:
    if len(cores) < ranks:
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    share = len(cores) // ranks
    parts = [cores[r * share:(r + 1) * share] for r in range(ranks)]
    return "|".join(",".join(map(str, p)) if len(p) < 2 or p[-1] - p[0] != len(p) - 1
                    else f"{p[0]}-{p[-1]}" for p in parts)


def cpu_max_total_tokens(context_length: int | None, max_running_requests: int | None) -> int:
    """KV slots for a CPU server: every running request at full context, at least 4096."""
    return max(4096, (context_length or 512) * (max_running_requests or 8))


def check_python(python: str, timeout_s: float = 120) -> str | None:
    """None when `python` imports sglang at the pinned version; else what is wrong."""
    code = "import importlib.metadata as m; print(m.version('sglang'))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python}: {e}"
    if out.returncode != 0:
        return f"{python} has no sglang: {out.stderr.strip().splitlines()[-1:]}"
    if out.stdout.strip() != SGLANG_VERSION:
        return f"{python} has sglang {out.stdout.strip()}, megarl pins {SGLANG_VERSION}"
    return None
