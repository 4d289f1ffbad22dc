"""Start an SGLang server (`python -m sglang.launch_server`) and wait until it is healthy.

Owns the server's command line and process: the RL-relevant server arguments (tp_size,
mem_fraction_static, base_gpu_id, port, nccl_port, skip_tokenizer_init, load_format dummy so
weights come from the trainer), start-up, the /health wait with a timeout, and shutdown.
Placement (which node and GPUs an engine gets) is megarl.cluster's business; this module takes
the result as `base_gpu_id` and ports.

On a CPU (`device="cpu"`) a stock server runs from its own environment (`python`, see
megarl.backends.sglang.cpu_env) with the CPU engine, megarl's import shims and sglang's
torch-native backends; CI runs it so. `module="megarl.rollout.server"` starts megarl's
embedded server with the same arguments (it accepts and ignores the GPU-only ones).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from megarl.rollout import auth as rollout_auth
from megarl.utils import group_guard
# the port a launched server binds: one below the ephemeral range (see free_port)
from megarl.utils.launch import free_port as find_free_port  # noqa: F401

logger = logging.getLogger(__name__)

SGLANG_MODULE = "sglang.launch_server"
EMBEDDED_MODULE = "megarl.rollout.server"


@dataclass
class ServerArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    mem_fraction_static: float | None = None
    base_gpu_id: int | None = None
    nccl_port: int | None = None
    skip_tokenizer_init: bool = True
    load_format: str = "auto"
    dtype: str = "auto"
    random_seed: int | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    weight_version: str | None = None  # the version the loaded weights report (megarl: "0")
    log_level: str = "warning"
    # stock's --enable-return-routed-experts (the embedded server takes it too): requests may
    # then ask for the experts each token was routed to (rollout.enable_rollout_routing_replay)
    enable_return_routed_experts: bool = False
    trust_remote_code: bool = False  # the model's own code may run (model.trust_remote_code)
    device: str = "cuda"  # "cpu": stock sglang gets the CPU engine, shims and flags
    python: str | None = None  # the server's interpreter; None: this one
    extra_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def from_rollout_config(cls, rollout, model_path: str, *, port: int, base_gpu_id: int = 0,
                            nccl_port: int | None = None, load_format: str = "dummy",
                            **overrides) -> "ServerArgs":
        """From `actor_rollout_ref.rollout`: TP and memory fraction; dummy weights, since the
        trainer pushes real ones before the first rollout."""
        return cls(model_path=model_path, port=port, base_gpu_id=base_gpu_id,
                   nccl_port=nccl_port, tp_size=rollout.tensor_model_parallel_size,
                   mem_fraction_static=rollout.gpu_memory_utilization, load_format=load_format,
                   **overrides)


def module_for(rollout) -> str:
    """The module a launched rollout server runs (`rollout.server_module`, else stock SGLang)."""
    return rollout.server_module or SGLANG_MODULE


def replica_server_args(cfg, index: int, *, host: str, port: int,
                        base_gpu_id: int | None, load_format: str = "dummy") -> ServerArgs:
    """The server of rollout replica `index`: the run's model with dummy weights (the trainer
    sends the real ones before the first rollout; `load_format=auto` where no trainer runs),
    the replica's TP and GPUs, version "0"."""
    from megarl.backends.sglang.cpu_env import server_python

    r = cfg.actor_rollout_ref.rollout
    ctx = cfg.data.max_prompt_length + cfg.data.max_response_length
    python = server_python(r.server_python) if module_for(r) == SGLANG_MODULE else None
    return ServerArgs.from_rollout_config(
        r, cfg.actor_rollout_ref.model.path, port=port, base_gpu_id=base_gpu_id, host=host,
        random_seed=cfg.trainer.seed + index, context_length=ctx, weight_version="0",
        dtype=rollout_dtype(cfg), enable_return_routed_experts=r.enable_rollout_routing_replay,
        load_format=load_format, trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code,
        device=cfg.trainer.device, python=python, extra_args=list(r.server_extra_args))


def rollout_dtype(cfg) -> str:
    """The dtype launched servers load (`rollout.dtype`, `auto`: the actor's params dtype)."""
    d = cfg.actor_rollout_ref.rollout.dtype
    return cfg.actor_rollout_ref.actor.megatron.params_dtype if d == "auto" else d


def _stock_on_cpu(args: ServerArgs, module: str) -> bool:
    return module == SGLANG_MODULE and args.device == "cpu"


def build_command(args: ServerArgs, module: str = SGLANG_MODULE,
                  python: str | None = None) -> list[str]:
    python = python or args.python or sys.executable
    cmd = [python, "-m", module, "--model-path", str(args.model_path), "--host", args.host,
           "--port", str(args.port), "--tp-size", str(args.tp_size),
           "--load-format", args.load_format, "--dtype", args.dtype,
           "--log-level", args.log_level]
    mem_fraction = args.mem_fraction_static
    if _stock_on_cpu(args, module):
        from megarl.backends.sglang import cpu_env

        # On a CPU sglang takes the fraction of host memory: bounded by slots instead.
        mem_fraction = cpu_env.CPU_MEM_FRACTION
        cmd += [*cpu_env.CPU_FLAGS, "--max-total-tokens", str(cpu_env.cpu_max_total_tokens(
            args.context_length, args.max_running_requests))]
    optional = [("--mem-fraction-static", mem_fraction),
                ("--base-gpu-id", args.base_gpu_id), ("--nccl-port", args.nccl_port),
                ("--random-seed", args.random_seed), ("--context-length", args.context_length),
                ("--max-running-requests", args.max_running_requests),
                ("--weight-version", args.weight_version)]
    for flag, value in optional:
        if value is not None:
            cmd += [flag, str(value)]
    if args.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if args.enable_return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if args.trust_remote_code:
        cmd.append("--trust-remote-code")
    return cmd + list(args.extra_args)


def wait_for_health(url: str, timeout_s: float, proc: subprocess.Popen | None = None,
                    log_path: str | Path | None = None, interval_s: float = 0.5) -> float:
    """Poll `url`/health until HTTP 200; returns seconds waited.

    Raises RuntimeError at once if `proc` exits first (with the log's tail), TimeoutError
    after `timeout_s`.
    """
    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before becoming "
                               f"healthy{_tail(log_path)}")
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{url}: not healthy after {timeout_s:.0f} s{_tail(log_path)}")
        time.sleep(interval_s)


def _tail(log_path, lines: int = 20) -> str:
    if not log_path or not Path(log_path).exists():
        return ""
    text = Path(log_path).read_text(errors="replace").splitlines()[-lines:]
    return "; log tail:\n" + "\n".join(text)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (a worker
    killed by Ray or torchrun must not leave a server holding GPUs behind). Linux only. The
    kernel sends it when the launching *thread* ends; SGLang may drain for ever on it: the
    server's group guard (megarl.utils.group_guard) escalates to SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# How long a server's group has, after its SIGTERM, before SIGKILL: when the launcher dies
# (the group guard), and when a leaving torchrun rank stops its servers (`stop_all_servers`)
ORPHAN_GRACE_S = 5.0
_live: set["ServerProcess"] = set()  # started here and not stopped yet
# reentrant: `stop_all_servers` may run in a signal handler on a thread inside `stop`
_live_lock = threading.RLock()


class ServerProcess:
    """A started server; `stop()` (or leaving the `with` block) terminates it."""

    def __init__(self, args: ServerArgs, proc: subprocess.Popen, log_path: Path,
                 guard: subprocess.Popen | None = None):
        self.args, self.proc, self.log_path, self.guard = args, proc, log_path, guard
        self._stopped = False  # once stopped, its pid may be another process's: never again
        with _live_lock:
            _live.add(self)

    @property
    def url(self) -> str:
        return self.args.url

    def stop(self, timeout_s: float = 30) -> None:
        # The server runs in its own process group: SGLang forks scheduler/detokenizer
        # processes that must go with it, also when the server process itself was killed or
        # has left before them (they would outlive it, holding memory and cores).
        with _live_lock:
            if self._stopped:
                return
            self._stopped = True
            _live.discard(self)
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout_s)
        if self.guard is not None:  # it leaves once the group is gone
            try:
                self.guard.wait(5)
            except subprocess.TimeoutExpired:
                self.guard.kill()
                self.guard.wait(5)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def spawn(cmd: list[str], env: dict, log, grace_s: float = ORPHAN_GRACE_S):
    """(the server process, in a process group of its own; its group guard, which ends that
    group `grace_s` after a SIGTERM once this process is gone)."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, preexec_fn=_die_with_parent)
    try:
        return proc, group_guard.start(proc.pid, grace_s)
    except BaseException:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def stop_all_servers(grace_s: float = ORPHAN_GRACE_S) -> None:
    """Every server this process started and has not stopped: SIGTERM to each group, then,
    after `grace_s`, SIGKILL to what is left. For a process about to leave without its
    orderly shutdown (a torchrun rank stopped or failing); also run at interpreter exit."""
    with _live_lock:
        servers = list(_live)
        _live.clear()
        for s in servers:
            s._stopped = True
    if servers:
        logger.info("stopping %d rollout server(s) this process started", len(servers))
        group_guard.terminate_groups([s.proc.pid for s in servers], grace_s)


atexit.register(stop_all_servers)


def _private_config(beside: Path, values: dict) -> Path:
    """A YAML file of `values` that only this user can read (created 0600, never widened)."""
    path = beside.with_name(beside.name + f".{secrets.token_hex(4)}.config.yaml")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items()))
    return path


def launch_server(args: ServerArgs, *, module: str = SGLANG_MODULE, timeout_s: float = 600,
                  env: dict | None = None, log_path: str | Path | None = None) -> ServerProcess:
    """Start the server and block until /health answers; on failure the process is stopped.

    The run's token (megarl.rollout.auth), where this process has one, reaches the server
    without appearing on its command line (which every user of the node can read): megarl's
    embedded server reads it from the environment it inherits; stock SGLang from a
    `--config` file only this user can read, removed once the server is up."""
    cmd = build_command(args, module)
    log_path = Path(log_path or tempfile.mkstemp(prefix=f"rollout-{args.port}-", suffix=".log")[1])
    full_env = {**os.environ, **(env or {})}
    if _stock_on_cpu(args, module):
        from megarl.backends.sglang.cpu_env import server_env

        full_env.update(server_env(full_env, args.tp_size))
    key = full_env.get(rollout_auth.API_KEY_ENV)
    secret_file = None
    if key and module == SGLANG_MODULE:
        if "--config" in cmd:
            raise ValueError("actor_rollout_ref.rollout.server_extra_args: --config is megarl's "
                             "to pass (it carries the run's API key to the server); give those "
                             "settings as flags instead")
        secret_file = _private_config(log_path, {"api-key": key})
        cmd += ["--config", str(secret_file)]
    logger.info("starting %s (log %s)", " ".join(cmd), log_path)
    try:
        with open(log_path, "ab") as log:
            proc, guard = spawn(cmd, full_env, log)
        server = ServerProcess(args, proc, log_path, guard)
        try:
            waited = wait_for_health(args.url, timeout_s, proc, log_path)
        except BaseException:
            server.stop()
            raise
    finally:
        if secret_file is not None:
            secret_file.unlink(missing_ok=True)
    logger.info("%s healthy after %.1f s", args.url, waited)
    return server
