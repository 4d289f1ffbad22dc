"""The SGLang launcher end to end, with megarl's embedded server standing in for SGLang:
command line -> process -> /health wait -> client generate -> shutdown."""
import asyncio

from megarl.backends.sglang import SGLangEngine
from megarl.backends.sglang.launcher import (EMBEDDED_MODULE, ServerArgs, find_free_port,
                                             launch_server)
from megarl.rollout.protocol import GenerateRequest, SamplingParams
from megarl.utils.tiny_model import make_tiny_model


def test_launch_wait_generate_stop(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    args = ServerArgs(str(model), port=find_free_port(), mem_fraction_static=0.5, base_gpu_id=0,
                      nccl_port=find_free_port(), load_format="dummy", random_seed=0)

    async def go(url):
        engine = SGLangEngine(url)
        out = await engine.generate(GenerateRequest([1, 2, 3], SamplingParams(
            max_new_tokens=5, temperature=0.0, ignore_eos=True)))
        await engine.close()
        return out

    with launch_server(args, module=EMBEDDED_MODULE, timeout_s=120,
                       log_path=tmp_path / "server.log") as server:
        out = asyncio.run(go(server.url))
        assert len(out.output_ids) == 5 and out.output_logprobs is not None
        assert "text" not in out.to_sglang()  # --skip-tokenizer-init
    assert server.proc.poll() is not None  # stopped on exit


def test_a_launched_server_requires_the_runs_token_which_stays_off_its_command_line(
        tmp_path, monkeypatch):
    """The run's token (MEGARL_ROLLOUT_API_KEY) reaches the server through its environment:
    its command line, which every user of the node can read, does not hold it."""
    import aiohttp

    from megarl.rollout.auth import API_KEY_ENV

    key = "t" * 43
    monkeypatch.setenv(API_KEY_ENV, key)
    model = make_tiny_model(tmp_path / "m")
    args = ServerArgs(str(model), port=find_free_port(), load_format="dummy", random_seed=0)

    async def go(url):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/pause_generation", json={}) as r:
                bare = r.status
        engine = SGLangEngine(url)  # its client brings the token from the environment
        out = await engine.generate(GenerateRequest([1, 2, 3], SamplingParams(
            max_new_tokens=2, temperature=0.0, ignore_eos=True)))
        await engine.close()
        return bare, out

    with launch_server(args, module=EMBEDDED_MODULE, timeout_s=120,
                       log_path=tmp_path / "server.log") as server:
        cmdline = open(f"/proc/{server.proc.pid}/cmdline", "rb").read().decode()
        bare, out = asyncio.run(go(server.url))
    assert key not in cmdline and bare == 401 and len(out.output_ids) == 2
