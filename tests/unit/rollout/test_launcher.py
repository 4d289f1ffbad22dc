"""The SGLang launcher's command line and health wait (no SGLang needed)."""
import subprocess
import sys

import pytest

from megarl.backends.sglang.launcher import (EMBEDDED_MODULE, ServerArgs, build_command,
                                             find_free_port, replica_server_args,
                                             wait_for_health)
from megarl.config import ConfigError, load_config
from megarl.config.schema import RolloutConfig
from megarl.rollout.server import build_arg_parser


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_command_carries_the_rl_server_args():
    args = ServerArgs("/m", port=31000, tp_size=2, mem_fraction_static=0.7, base_gpu_id=4,
                      nccl_port=31001, load_format="dummy", extra_args=["--disable-radix-cache"])
    cmd = build_command(args, python="py")
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    assert flag(cmd, "--model-path") == "/m" and flag(cmd, "--port") == "31000"
    assert flag(cmd, "--tp-size") == "2" and flag(cmd, "--mem-fraction-static") == "0.7"
    assert flag(cmd, "--base-gpu-id") == "4" and flag(cmd, "--nccl-port") == "31001"
    assert flag(cmd, "--load-format") == "dummy" and "--skip-tokenizer-init" in cmd
    assert flag(cmd, "--host") == "127.0.0.1" and cmd[-1] == "--disable-radix-cache"


def test_from_rollout_config():
    cfg = RolloutConfig(tensor_model_parallel_size=4, gpu_memory_utilization=0.6)
    args = ServerArgs.from_rollout_config(cfg, "/m", port=1234, base_gpu_id=4, nccl_port=1235)
    assert (args.tp_size, args.mem_fraction_static, args.load_format) == (4, 0.6, "dummy")
    assert args.url == "http://127.0.0.1:1234"


def test_embedded_server_parses_the_sglang_command():
    args = ServerArgs("/m", port=31000, mem_fraction_static=0.7, base_gpu_id=0, nccl_port=5,
                      random_seed=1, context_length=64, max_running_requests=8)
    parsed = build_arg_parser().parse_args(build_command(args, EMBEDDED_MODULE)[3:])
    assert parsed.model_path == "/m" and parsed.port == 31000 and parsed.skip_tokenizer_init
    assert parsed.context_length == 64 and parsed.max_running_requests == 8


@pytest.mark.parametrize("params,rollout,want", [
    ("float32", "auto", "float32"),    # SGLang's own auto would serve this in float16
    ("bfloat16", "auto", "bfloat16"),
    ("bfloat16", "float32", "float32"),
    ("float32", "float16", "float16")])
def test_replicas_load_the_dtype_the_trainer_sends_unless_told(params, rollout, want):
    cfg = load_config(None, [f"actor_rollout_ref.actor.megatron.params_dtype={params}",
                             f"actor_rollout_ref.rollout.dtype={rollout}"])
    args = replica_server_args(cfg, 0, host="127.0.0.1", port=1, base_gpu_id=None)
    assert flag(build_command(args, python="py"), "--dtype") == want
    parsed = build_arg_parser().parse_args(build_command(args, EMBEDDED_MODULE)[3:])
    assert parsed.dtype == want


def test_an_unknown_rollout_dtype_is_refused_by_key():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.dtype"):
        load_config(None, ["actor_rollout_ref.rollout.dtype=fp8"])


def test_health_wait_times_out_on_a_silent_port():
    with pytest.raises(TimeoutError, match="not healthy"):
        wait_for_health(f"http://127.0.0.1:{find_free_port()}", timeout_s=0.5, interval_s=0.1)


def test_health_wait_reports_a_dead_server(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("boom: CUDA out of memory\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(RuntimeError, match="(?s)status 3.*out of memory"):
        wait_for_health(f"http://127.0.0.1:{find_free_port()}", 30, proc, log)


def test_routing_replay_launches_servers_that_return_routed_experts():
    cfg = load_config(None, ["actor_rollout_ref.rollout.enable_rollout_routing_replay=true"])
    args = replica_server_args(cfg, 0, host="127.0.0.1", port=1, base_gpu_id=None)
    assert "--enable-return-routed-experts" in build_command(args, python="py")
    parsed = build_arg_parser().parse_args(build_command(args, EMBEDDED_MODULE)[3:])
    assert parsed.enable_return_routed_experts
    off = replica_server_args(load_config(None, []), 0, host="127.0.0.1", port=1,
                              base_gpu_id=None)
    assert "--enable-return-routed-experts" not in build_command(off, python="py")


def test_trust_remote_code_reaches_the_launched_servers_and_the_embedded_engine(tiny_qwen2):
    """actor_rollout_ref.model.trust_remote_code: stock SGLang's flag on the command line, which
    the embedded server takes to its engine's transformers loads."""
    cfg = load_config(None, ["actor_rollout_ref.model.trust_remote_code=true"])
    args = replica_server_args(cfg, 0, host="127.0.0.1", port=1, base_gpu_id=None)
    assert "--trust-remote-code" in build_command(args, python="py")
    assert build_arg_parser().parse_args(build_command(args, EMBEDDED_MODULE)[3:]) \
        .trust_remote_code
    off = replica_server_args(load_config(None, []), 0, host="127.0.0.1", port=1,
                              base_gpu_id=None)
    assert "--trust-remote-code" not in build_command(off, python="py")
    from unittest import mock

    import transformers

    from megarl.rollout.engine import EmbeddedEngine
    seen = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(*a, **k):
        seen.append(k.get("trust_remote_code"))
        return real(*a, **k)

    with mock.patch.object(transformers.AutoTokenizer, "from_pretrained", spy):
        EmbeddedEngine(tiny_qwen2, trust_remote_code=True)
    assert seen == [True]
