"""The SGLang client against the embedded HTTP server: generation, control, weight updates,
bad input. The trainer side of the broadcast update runs in a separate process."""
import asyncio
import json
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megarl.backends.sglang import SGLangClient, SGLangEngine, SGLangError
from megarl.rollout.engine import EmbeddedEngine
from megarl.rollout.protocol import BadRequest, GenerateRequest, SamplingParams
from megarl.rollout.server import ServerThread
from megarl.rollout.weights import dtype_name
from megarl.utils.tiny_model import make_tiny_model

run = asyncio.run
REPO = Path(__file__).resolve().parents[2]
PROMPT = [40, 41, 42, 43]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_server")
    return make_tiny_model(root / "a"), make_tiny_model(root / "b", seed=1)


@pytest.fixture
def server(models):
    with ServerThread(EmbeddedEngine(models[0], weight_version="v0")) as srv:
        yield srv


def hf_greedy(model_dir, n=10):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def post(url, body: bytes):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_generate_single_batch_and_n(server, models):
    async def go():
        async with SGLangClient(server.url) as c:
            one = await c.generate(PROMPT, GREEDY, return_logprob=True, rid="a")
            many = await c.generate([PROMPT, [5, 6]], {**GREEDY, "n": 2}, return_logprob=False)
            info = await c.model_info()
            return one, many, info

    one, many, info = run(go())
    assert one["output_ids"] == hf_greedy(models[0])
    meta = one["meta_info"]
    assert meta["id"] == "a" and meta["finish_reason"] == {"type": "length", "length": 10}
    assert meta["weight_version"] == "v0" and len(meta["output_token_logprobs"]) == 10
    assert [m["output_ids"] for m in many[:2]] == [one["output_ids"]] * 2  # greedy: n alike
    assert len(many) == 4 and "output_token_logprobs" not in many[0]["meta_info"]
    assert info["weight_version"] == "v0" and info["engine"] == "megarl-embedded"


@pytest.mark.parametrize("body, field", [
    ({"input_ids": [], "sampling_params": GREEDY}, "input_ids"),
    ({"input_ids": [5] * 1024, "sampling_params": GREEDY}, "input_ids"),  # context 1024
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}},
     "sampling_params.max_new_tokens"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}},
     "sampling_params.max_new_tokens"),
    ({"input_ids": PROMPT, "sampling_params": {"temprature": 1.0}}, "sampling_params.temprature"),
    ({"input_ids": PROMPT, "sampling": {}}, "sampling"),
    ({"input_ids": PROMPT, "stream": True}, "stream"),
    ({"input_ids": [[1, 2], [3]], "sampling_params": [GREEDY]}, "sampling_params"),
])
def test_bad_generate_input_is_400_naming_the_field(server, body, field):
    status, raw = post(server.url + "/generate", json.dumps(body).encode())
    assert status == 400, raw
    assert json.loads(raw)["error"]["field"] == field


@pytest.mark.parametrize("path, raw", [
    ("/generate", b"{not json"), ("/generate", b"[1, 2]"),
    ("/update_weights_from_tensor", b'{"serialized_named_tensors": ["@@@"]}'),
    ("/update_weights_from_distributed", b'{"names": ["x"], "dtypes": ["float32"],'
                                         b' "shapes": [[1]], "group_name": "none"}'),
    ("/pause_generation", b'{"mode": "later"}'),
    ("/end_weight_update", b'{"weight_version": "3"}'),  # stock's has no fields
])
def test_malformed_requests_are_400_and_the_server_stays_up(server, path, raw):
    status, body = post(server.url + path, raw)
    assert status == 400 and json.loads(body)["error"]["message"]
    with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
        assert r.status == 200
    assert run(SGLangEngine(server.url).generate(GenerateRequest(PROMPT, SamplingParams(
        max_new_tokens=2)))).finish_reason.type == "length"


def test_rejected_weight_updates_leave_weights_intact(server, models):
    engine = SGLangEngine(server.url)
    good = list(load_file(str(models[1] / "model.safetensors")).items())

    async def go():
        before = await engine.client.get_weights_by_name("model.norm.weight")
        for bad in [("model.layers.9.mlp.up_proj.weight", torch.zeros(2)),
                    ("model.norm.weight", torch.zeros(3, 3))]:
            await engine.begin_weight_update()
            with pytest.raises(BadRequest):
                await engine.update_weights_from_tensor(good + [bad], weight_version="v1")
            await engine.end_weight_update()
        after = await engine.client.get_weights_by_name("model.norm.weight")
        out = await engine.generate(GenerateRequest(PROMPT, SamplingParams(**GREEDY)))
        await engine.close()
        return before, after, out

    before, after, out = run(go())
    assert before == after and out.output_ids == hf_greedy(models[0]) and out.weight_version == "v0"


def test_abort_mid_generation_returns_partial(server):
    async def go():
        async with SGLangClient(server.url) as c:
            gen = asyncio.ensure_future(c.generate(PROMPT, {**GREEDY, "max_new_tokens": 1000},
                                                   return_logprob=True, rid="victim"))
            while (await c.server_info())["running"] == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            await c.abort_request("victim")
            return await gen

    out = run(go())
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 1000
    assert len(meta["output_token_logprobs"]) == len(out["output_ids"])


def test_pause_and_continue(server):
    async def go():
        async with SGLangClient(server.url) as c:
            await c.pause_generation("in_place")
            gen = asyncio.ensure_future(c.generate(PROMPT, GREEDY))
            await asyncio.sleep(0.3)
            held = not gen.done()
            # paused, the new request waits without KV: stock allows the flush (0.5.23
            # scheduler.py: a paused scheduler ignores its waiting queue), and so does megarl
            assert await c.flush_cache()
            await c.continue_generation()
            out = await gen
            return held, out, await c.flush_cache()

    held, out, flushed = run(go())
    assert held and out["meta_info"]["finish_reason"]["type"] == "length" and flushed


def test_update_from_tensor_through_the_client(server, models):
    engine = SGLangEngine(server.url)
    named = list(load_file(str(models[1] / "model.safetensors")).items())

    async def go():
        await engine.begin_weight_update()
        await engine.update_weights_from_tensor(named, weight_version="v1")
        await engine.end_weight_update()
        out = await engine.generate(GenerateRequest(PROMPT, SamplingParams(**GREEDY)))
        version = await engine.get_weight_version()
        await engine.close()
        return out, version

    out, version = run(go())
    assert out.output_ids == hf_greedy(models[1]) and out.weight_version == version == "v1"


TRAINER = textwrap.dedent("""
    import sys
    from safetensors.torch import load_file
    from megarl.rollout.weights import new_update_group
    port, path = int(sys.argv[1]), sys.argv[2]
    named = list(load_file(path).items())
    with new_update_group("127.0.0.1", port, 0, 2, "wug", "gloo", timeout_s=120) as group:
        for _, t in named:  # load_format null: one broadcast per tensor, in list order
            group.broadcast(t, 0)
    print("sent", len(named))
""")


def test_update_from_gloo_broadcast_in_another_process(server, models):
    path = models[1] / "model.safetensors"
    named = list(load_file(str(path)).items())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go():
        async with SGLangClient(server.url) as c:
            # Fire the engine's join first: the trainer's blocks until every rank is in.
            join = asyncio.ensure_future(c.init_weights_update_group(
                "127.0.0.1", port, 1, 2, "wug", backend="gloo"))
            trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), str(path)],
                                       cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            await join
            await c.begin_weight_update()
            await c.update_weights_from_distributed(
                [n for n, _ in named], [dtype_name(t.dtype) for _, t in named],
                [list(t.shape) for _, t in named], "wug", flush_cache=False,
                weight_version="v2")
            await c.end_weight_update()
            stdout, stderr = await asyncio.to_thread(trainer.communicate, timeout=120)
            out = await c.generate(PROMPT, GREEDY)
            norm = await c.get_weights_by_name("model.norm.weight")
            return trainer.returncode, stdout + stderr, out, norm

    rc, stdout, out, norm = run(go())
    assert rc == 0 and f"sent {len(named)}" in stdout, stdout
    assert out["output_ids"] == hf_greedy(models[1]) and out["meta_info"]["weight_version"] == "v2"
    assert torch.allclose(torch.tensor(norm), dict(named)["model.norm.weight"])


def test_errors_carry_endpoint_and_status(server):
    async def go():
        async with SGLangClient(server.url) as c:
            await c.generate(PROMPT, {"max_new_tokens": 0})

    with pytest.raises(SGLangError) as e:
        run(go())
    assert e.value.status == 400 and e.value.endpoint == "/generate"
    assert e.value.field == "sampling_params.max_new_tokens"
