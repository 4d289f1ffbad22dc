"""`trainer.device: auto` and the dtypes that follow the device (megarl.config.device).

The GPU count is the loader's `cuda_devices` argument, so the cuda branch runs here on a CPU
machine: what it says is how a config resolves on a node where torch sees that many GPUs.
The CPU tests use this machine's own count (torch's, through `cuda_device_count`)."""
import logging

import pytest

from megarl.backends.sglang.launcher import rollout_dtype
from megarl.config import ConfigError, load_config
from megarl.config.device import cuda_device_count
from megarl.config.preflight import preflight
from megarl.config.schema import MEGATRON_SECTIONS

ROLLOUT_DTYPE = "actor_rollout_ref.rollout.dtype"


def _dtypes(cfg) -> dict[str, str]:
    from omegaconf import OmegaConf

    return {s: OmegaConf.select(cfg, f"{s}.params_dtype") for s in MEGATRON_SECTIONS}


def test_default_config_on_this_cpu_machine_is_cpu_float32(caplog):
    """The default config here resolves as it always ran: cpu, float32 in all three Megatron
    models, the rollout following the actor; said in one line."""
    import torch

    # the count skips importing torch where no GPU driver is present: it must agree with torch
    assert cuda_device_count() == torch.cuda.device_count()
    if cuda_device_count():
        pytest.skip("this machine has a GPU: the cpu resolution is for CPU machines")
    with caplog.at_level(logging.INFO, logger="megarl.config.device"):
        cfg = load_config(None, [])
    assert cfg.trainer.device == "cpu"
    assert set(_dtypes(cfg).values()) == {"float32"}
    assert rollout_dtype(cfg) == "float32"  # rollout.dtype auto: the actor's
    lines = [r.getMessage() for r in caplog.records if r.name == "megarl.config.device"]
    assert lines in ([], ["trainer.device=auto: cpu (0 GPUs visible)"])  # once per process


def test_auto_on_a_gpu_node_is_cuda_bf16(caplog):
    with caplog.at_level(logging.INFO, logger="megarl.config.device"):
        cfg = load_config(None, ["trainer.n_gpus_per_node=8"], cuda_devices=8)
    assert cfg.trainer.device == "cuda"
    assert set(_dtypes(cfg).values()) == {"bfloat16"}
    assert rollout_dtype(cfg) == "bfloat16"  # the SGLang servers' --dtype
    assert "trainer.device=auto: cuda (8 GPUs visible)" in caplog.messages
    preflight_devices_only(cfg, 8)


def test_explicit_values_win_over_the_device_defaults():
    actor = "actor_rollout_ref.actor.megatron.params_dtype"
    cfg = load_config(None, [f"{actor}=float32", f"{ROLLOUT_DTYPE}=float16"], cuda_devices=8)
    assert cfg.trainer.device == "cuda"
    assert _dtypes(cfg) == {"actor_rollout_ref.actor.megatron": "float32",
                            "actor_rollout_ref.ref.megatron": "bfloat16",
                            "critic.megatron": "bfloat16"}
    assert cfg.actor_rollout_ref.rollout.dtype == "float16"
    # an explicit cpu on a GPU node stays cpu, in float32; bf16 asked for on cpu is kept
    cfg = load_config(None, ["trainer.device=cpu", "critic.megatron.params_dtype=bfloat16"],
                      cuda_devices=8)
    assert cfg.trainer.device == "cpu"
    assert list(_dtypes(cfg).values()) == ["float32", "float32", "bfloat16"]
    # explicit cuda with no GPU visible loads (a dry run plans it anywhere) ...
    cfg = load_config(None, ["trainer.device=cuda"], cuda_devices=0)
    assert cfg.trainer.device == "cuda" and set(_dtypes(cfg).values()) == {"bfloat16"}
    # ... and the run is refused before any work
    with pytest.raises(ConfigError, match=r"^trainer.n_gpus_per_node: 1 asked, but this node "
                                          r"has 0 visible CUDA devices .*trainer.device=cpu"):
        preflight_devices_only(cfg, 0)


def test_more_gpus_than_the_node_has_is_refused_naming_the_key():
    cfg = load_config(None, ["trainer.n_gpus_per_node=8"], cuda_devices=4)
    with pytest.raises(ConfigError, match=r"^trainer.n_gpus_per_node: 8 asked, but this node "
                                          r"has 4 visible CUDA devices"):
        preflight_devices_only(cfg, 4)
    # through preflight itself, first of its checks: before any file is looked at
    with pytest.raises(ConfigError, match=r"^trainer.n_gpus_per_node: 8 asked"):
        preflight(cfg, cuda_devices=4)
    # a multi-node Ray driver may sit on a head without GPUs: Ray's placement waits instead
    preflight_devices_only(load_config(None, ["trainer.device=cuda", "trainer.nnodes=2",
                                              "trainer.n_gpus_per_node=8"]), 0)


def test_a_bad_device_is_named_with_its_choices():
    with pytest.raises(ConfigError, match=r"^trainer.device: 'gpu' is not one of auto, cpu, "
                                          r"cuda"):
        load_config(None, ["trainer.device=gpu"])
    with pytest.raises(ConfigError, match=r"params_dtype: 'bf16' is not one of None, float32"):
        load_config(None, ["actor_rollout_ref.ref.megatron.params_dtype=bf16"])


def preflight_devices_only(cfg, n: int) -> None:
    from megarl.config.device import check_node_devices

    check_node_devices(cfg, cuda_devices=n)


def test_a_refused_config_prints_only_its_error(capfd):
    """The resolution's line is said once the config is valid: a refused one prints only its
    one line of error (the fuzz tests hold the CLI to that)."""
    from megarl.cli import main

    assert main(["config", "trainer.nnodes=0"]) == 2
    err = capfd.readouterr().err
    assert "trainer.device=auto" not in err and err.count("\n") == 1
    with pytest.raises(ConfigError, match=r"^trainer.device"):
        load_config(None, ["trainer.device=${oc.env:MEGARL_NO_SUCH_VARIABLE}"])
