"""Shared fixtures: tiny HF models and the quickstart task, made locally (launch helpers live in
integration/launch_helpers.py)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from megarl.utils.tiny_model import make_tiny_model


_SLOW_DIRS = ("integration", "stock")

# tools/run_tests.sh runs the suite on two pytest-xdist workers
# (`--dist loadgroup`): each test goes to whichever worker is free, except these modules, each
# run whole by one worker. Their tests share an expensive module- or session-scoped run (a
# Slurm cluster, a trained checkpoint, a finished training run, engines) that a split would
# build once per worker, or they start Ray heads with `ray start` on port 6379 (test_multihost
# on 10.213.77.1 in its namespaces, the Slurm jobs on this host's address): `ray start
# --head` looks for a running head machine-wide, whatever the namespace, and refuses a second
# one, so the two modules share a group and never run at the same time.
_WHOLE_MODULES = {
    "test_checkpoint_fallback.py": "undamaged-run",  # the two share conftest's `undamaged`
    "test_checkpoint_naming_e2e.py": "undamaged-run",
    "test_convert_trained.py": None, "test_critic_model.py": None,
    "test_megatron_optimizer.py": None, "test_megatron_train.py": None,
    "test_multihost.py": "ray-start-heads", "test_slurm_launch.py": "ray-start-heads",
    "test_rollout_server.py": None, "test_weight_sync.py": None,
}


@pytest.fixture(autouse=True)
def _no_run_token_in_the_environment():
    """Each test starts without a rollout token and leaves none behind. A test that runs
    `megarl train` in this process settles one in os.environ (megarl.rollout.auth.establish,
    as the CLI must, for the run's children to inherit); left there, every server a later test
    of this worker starts would require it, and clients that send none would get 401."""
    from megarl.rollout.auth import API_KEY_ENV

    os.environ.pop(API_KEY_ENV, None)
    yield
    os.environ.pop(API_KEY_ENV, None)


# tryfirst: xdist's own hook turns the xdist_group marks into groups, so they must be there
# before it runs
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every end-to-end and multi-process test (tests/integration, tests/stock) is `slow`:
    `-m "not slow"` is the fast tier (unit, contract and fuzz tests)."""
    root = Path(__file__).resolve().parent
    slow = [root / d for d in _SLOW_DIRS]
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if any(d in path.parents for d in slow):
            item.add_marker(pytest.mark.slow)
        if path.name in _WHOLE_MODULES and root / "integration" in path.parents:
            item.add_marker(pytest.mark.xdist_group(_WHOLE_MODULES[path.name] or path.stem))


def pytest_configure(config):
    """`--dist loadgroup` (tools/run_tests.sh) on a pytest that pytest-xdist cannot group
    under: pytest 9.2 keeps node ids where xdist <= 3.8 cannot tag them with their group, and
    the groups would be split silently (pytest-xdist #1386)."""
    if hasattr(config, "workerinput") or config.getoption("dist", "no") != "loadgroup":
        return
    import xdist

    xdist_version = tuple(int(x) for x in xdist.__version__.split(".")[:2])
    if pytest.version_tuple[:2] >= (9, 2) and xdist_version <= (3, 8):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} does not honour "
            "`--dist loadgroup` (pytest-xdist #1386): reinstall the test extras "
            "(pip install -e '.[test]' pins pytest<9.2)")


# Llama 3.2's RoPE: with head_dim 16 and theta 500000, half the frequency pairs have
# wavelengths past 8192 positions (divided by 32) and one lies in the interpolated band.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _make(tmp_path_factory, arch: str) -> Path:
    out = tmp_path_factory.mktemp(f"tiny-{arch}") / "model"
    # vocab 300 is not a multiple of 128×TP, so Megatron's vocab padding is always exercised.
    return make_tiny_model(out, arch, vocab_size=300, hidden_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, intermediate_size=128,
                           rope_theta={"qwen2": 5000.0, "llama": 500000.0}.get(arch, 10000.0),
                           rope_scaling=LLAMA3_ROPE if arch == "llama" else None,
                           max_position_embeddings=131072 if arch == "llama" else 1024,
                           # Qwen3's head_dim is its own (128 at hidden 4096 / 32 heads in
                           # the 8B, but 128 at 5120 / 64 in the 32B): not hidden / heads here
                           head_dim=24 if arch.startswith(("qwen3", "glm4")) else None)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """Qwen2-shaped: QKV bias, tied embeddings, GQA."""
    return _make(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """Llama-3.x-shaped: no bias, untied embeddings, GQA, llama3 RoPE scaling (LLAMA3_ROPE)."""
    return _make(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """Qwen3-shaped: per-head q/k RMSNorm, no bias, head_dim 24 (not 64 / 4), tied, GQA."""
    return _make(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    """Qwen3-MoE-shaped: tiny_qwen3's attention, every MLP 8 routed experts (width 32), top-2
    renormalised, untied embeddings."""
    return _make(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_glm4_moe(tmp_path_factory) -> Path:
    """GLM-4.5-shaped: partial rotary 0.5 (12 of head_dim 24), QKV bias, QK-norm, layer 0
    dense, layer 1 8 routed experts (sigmoid + correction bias, top-2, scaled 2.5) and one
    shared expert, untied embeddings."""
    return _make(tmp_path_factory, "glm4_moe")


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tmp_path_factory) -> Path:
    """DeepSeek-V3-shaped: multi-latent attention (q/kv latents 32, nope 16 + rope 8 key
    channels, values 16), YaRN (factor 4, mscale_all_dim 1), layer 0 dense, layer 1 8 routed
    experts in 2 groups (1 chosen, top-2; sigmoid + correction bias, scaled 2.5) and one
    shared expert, untied embeddings."""
    return _make(tmp_path_factory, "deepseek_v3")


# Default-sized tiny models (make_tiny_model's defaults) for the rollout and weight-sync tests.
@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("rollout") / "qwen2", arch="qwen2")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("rollout") / "llama", arch="llama", seed=3)


@pytest.fixture(scope="session")
def qwen_dir_b(tmp_path_factory):
    """Same shapes as qwen_dir, other weights: the "trainer's" next version."""
    return make_tiny_model(tmp_path_factory.mktemp("rollout") / "qwen2_b", arch="qwen2", seed=1)


@pytest.fixture(scope="session")
def quickstart_assets(tmp_path_factory) -> Path:
    """A run's inputs, as `megarl train` subprocesses take them: `tiny/` (default-sized tiny
    Qwen2) and `data/` (the synthetic quickstart task's train/val jsonl)."""
    from megarl.data.synthetic import make_quickstart_task

    d = tmp_path_factory.mktemp("quickstart")
    make_tiny_model(d / "tiny", "qwen2")
    make_quickstart_task(d / "data")
    return d


@pytest.fixture(scope="session")
def stock_python() -> str:
    """The stock server's Python (built here if needed); skips naming why it cannot be had."""
    from megarl.backends.sglang import cpu_env

    if cpu_env.venv_status() is not None:
        script = Path(__file__).resolve().parents[1] / "tools" / "setup_sglang_env.sh"
        build = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                               timeout=1200)
        if build.returncode != 0:
            pytest.skip("the stock SGLang CPU environment could not be built "
                        f"(tools/setup_sglang_env.sh): {build.stdout[-1500:]}"
                        f"{build.stderr[-1500:]}")
    python = cpu_env.server_python()
    problem = cpu_env.check_python(python)
    if problem:
        pytest.skip(f"no usable stock SGLang: {problem}")
    return python


