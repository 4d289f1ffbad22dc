"""The stock SGLang server on a CPU, as megarl launches it: its command line, process
environment, Python and environment stamp (no sglang needed; tests/stock runs the server)."""
import os
import subprocess
import sys

from megarl.backends.sglang import cpu_env
from megarl.backends.sglang.launcher import EMBEDDED_MODULE, ServerArgs, build_command


def test_stock_on_cpu_gets_the_torch_native_flags_and_a_bounded_kv_pool():
    args = ServerArgs("/m", port=1, device="cpu", python="/venv/bin/python",
                      mem_fraction_static=0.9, context_length=300, max_running_requests=32)
    cmd = build_command(args)
    assert cmd[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    for f in ("--device", "--attention-backend", "--sampling-backend", "--grammar-backend"):
        assert cmd[cmd.index(f) + 1] == cpu_env.CPU_FLAGS[cpu_env.CPU_FLAGS.index(f) + 1]
    assert "--disable-cuda-graph" in cmd
    assert cmd[cmd.index("--mem-fraction-static") + 1] == str(cpu_env.CPU_MEM_FRACTION)
    assert cmd[cmd.index("--max-total-tokens") + 1] == str(300 * 32)
    # on a GPU, and for megarl's embedded server, none of it
    gpu = build_command(ServerArgs("/m", port=1, mem_fraction_static=0.9))
    embedded = build_command(ServerArgs("/m", port=1, device="cpu"), EMBEDDED_MODULE)
    for c in (gpu, embedded):
        assert "--attention-backend" not in c and "--max-total-tokens" not in c
    assert gpu[0] == sys.executable


def test_server_env_loads_the_shims_and_binds_tp_ranks_to_cores():
    env = cpu_env.server_env({"PYTHONPATH": "/x"}, tp_size=1)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["MEGARL_SGLANG_CPU_SHIM"] == "1"
    assert env["PYTHONPATH"] == f"{cpu_env.SHIM_DIR}{os.pathsep}/x"
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in env
    assert "SGLANG_CPU_OMP_THREADS_BIND" in cpu_env.server_env({}, tp_size=2)
    assert cpu_env.server_env({"SGLANG_CPU_OMP_THREADS_BIND": "0"}, 2).get(
        "SGLANG_CPU_OMP_THREADS_BIND") is None  # the user's own binding stands
    assert cpu_env.cores_per_rank([0, 1], 2) == "0|1"
    assert cpu_env.cores_per_rank([0, 1], 4) == "0|1|0|1"
    assert cpu_env.cores_per_rank(list(range(8)), 2) == "0-3|4-7"


def test_the_shim_does_nothing_unless_asked(tmp_path):
    code = "import sys; print('sgl_kernel' in sys.modules)"
    base = dict(os.environ, PYTHONPATH=str(cpu_env.SHIM_DIR), SGLANG_USE_CPU_ENGINE="1")
    off = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True)
    on = subprocess.run([sys.executable, "-c", code + "; import sgl_kernel as k; "
                         "print(callable(k.anything_cpu)); k.anything_cpu()"],
                        env=dict(base, MEGARL_SGLANG_CPU_SHIM="1"), capture_output=True,
                        text=True)
    assert off.stdout.split() == ["False"]
    assert on.stdout.split() == ["True", "True"]
    assert "NotImplementedError" in on.stderr and "no CPU sgl-kernel" in on.stderr


def test_server_python_and_environment_status(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_SGLANG_VENV", str(tmp_path / "venv"))
    monkeypatch.delenv("MEGARL_SGLANG_PYTHON", raising=False)
    assert "no stock SGLang environment" in cpu_env.venv_status()
    assert "setup_sglang_env.sh" in cpu_env.venv_status()
    assert cpu_env.server_python() == sys.executable  # nothing built: megarl's own
    assert cpu_env.server_python("/given/python") == "/given/python"
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "venv" / cpu_env.STAMP).write_text("sglang==0.0.0 old\n")
    assert "out of date" in cpu_env.venv_status()
    (tmp_path / "venv" / cpu_env.STAMP).write_text(cpu_env.lock_stamp() + "\n")
    assert cpu_env.venv_status() is None
    assert cpu_env.server_python() == str(tmp_path / "venv" / "bin" / "python")
    monkeypatch.setenv("MEGARL_SGLANG_PYTHON", "/env/python")
    assert cpu_env.server_python() == "/env/python"
    assert "has no sglang" in cpu_env.check_python(sys.executable)


def test_the_lock_pins_every_package_and_never_torch_or_sglang():
    lines = [ln for ln in cpu_env.LOCK.read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines and all("==" in ln for ln in lines)
    names = {ln.split("==")[0].lower() for ln in lines}
    assert not names & {"torch", "sglang", "sgl-kernel", "flashinfer-python"}
