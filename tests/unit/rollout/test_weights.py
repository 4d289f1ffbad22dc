"""Weight updates on the embedded engine, under stock SGLang's contract (a begin/end session
around every update): apply, reject atomically, stage or load live, version spans."""
import asyncio
import socket
import threading

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megarl.rollout.protocol import BadRequest, GenerateRequest, SamplingParams
from megarl.rollout.weights import (LOAD_FORMAT, deserialize_named_tensors, dtype_name,
                                    new_update_group, serialize_named_tensors)

run = asyncio.run
PROMPT = [40, 41, 42, 43]


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def new_weights(model_dir):
    return list(load_file(str(model_dir / "model.safetensors")).items())


def update(engine, named, version=None):
    async def go():
        await engine.begin_weight_update()
        try:
            await engine.update_weights_from_tensor(named, weight_version=version,
                                                    flush_cache=False)
        finally:
            await engine.end_weight_update()
    return go()


def hf_greedy(model_dir, n):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def test_update_from_tensor_changes_generation_and_version(engine, qwen_dir, qwen_dir_b):
    before = run(engine.generate(GenerateRequest(PROMPT, greedy(12))))
    assert before.output_ids == hf_greedy(qwen_dir, 12) and before.weight_version == "0"
    run(update(engine, new_weights(qwen_dir_b), "1"))
    after = run(engine.generate(GenerateRequest(PROMPT, greedy(12))))
    assert after.output_ids == hf_greedy(qwen_dir_b, 12)
    assert after.weight_version == "1" and after.weight_version_spans == [("1", 0, 12)]
    assert after.token_versions() == [1] * 12  # megarl's integers
    assert run(engine.get_weight_version()) == "1"


@pytest.mark.parametrize("bad, field", [
    (("model.no_such.weight", torch.zeros(3)), "names"),
    (("model.norm.weight", torch.zeros(7)), "shapes"),
])
def test_rejected_update_leaves_old_weights_intact(engine, qwen_dir_b, bad, field):
    named = new_weights(qwen_dir_b)
    before = {n: p.clone() for n, p in engine.model.named_parameters()}
    # The bad tensor comes last: nothing before it may have been applied either.
    with pytest.raises(BadRequest) as e:
        run(update(engine, named + [bad], "1"))
    assert field in str(e.value)
    assert all(torch.equal(before[n], p) for n, p in engine.model.named_parameters())
    assert run(engine.get_weight_version()) == "0"


def test_tied_lm_head_accepted_under_either_name(engine):
    emb = engine.model.get_input_embeddings().weight
    run(update(engine, [("lm_head.weight", torch.ones_like(emb))]))
    assert torch.equal(emb, torch.ones_like(emb))


def test_weights_changed_mid_request_are_recorded_as_spans(engine, qwen_dir_b):
    async def go():
        task = asyncio.ensure_future(engine.generate(GenerateRequest(PROMPT, greedy(300),
                                                                     rid="long")))
        while "long" not in engine._seqs or len(engine._seqs["long"].output_ids) < 5:
            await asyncio.sleep(0.002)
        await update(engine, new_weights(qwen_dir_b), "1")
        return await task

    out = run(go())
    (v0, a0, b0), (v1, a1, b1) = out.weight_version_spans
    assert (v0, a0, v1, b1) == ("0", 0, "1", 300) and b0 == a1 >= 5
    assert out.weight_version == "1"  # as stock SGLang: the last span's
    assert out.token_versions()[b0 - 1:b0 + 1] == [0, 1]
    wire = out.to_sglang()["meta_info"]["weight_versions"]
    assert wire == [{"version": "0", "start": 0, "end": b0}, {"version": "1", "start": b0,
                                                               "end": 300}]


def test_begin_end_stages_until_end(engine, qwen_dir, qwen_dir_b):
    named = new_weights(qwen_dir_b)
    run(engine.begin_weight_update())
    run(engine.update_weights_from_tensor(named[: len(named) // 2]))
    run(engine.update_weights_from_tensor(named[len(named) // 2:], weight_version="1"))
    staged = run(engine.generate(GenerateRequest(PROMPT, greedy(8))))
    assert staged.output_ids == hf_greedy(qwen_dir, 8) and staged.weight_version == "0"
    run(engine.end_weight_update())
    after = run(engine.generate(GenerateRequest(PROMPT, greedy(8))))
    assert after.output_ids == hf_greedy(qwen_dir_b, 8) and after.weight_version == "1"
    with pytest.raises(BadRequest):
        run(engine.end_weight_update())


def test_serialization_round_trip_and_garbage():
    named = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(2, dtype=torch.bfloat16))]
    back = deserialize_named_tensors(serialize_named_tensors(named))
    assert [n for n, _ in back] == ["a", "b"] and all(
        torch.equal(x, y) for (_, x), (_, y) in zip(named, back))
    with pytest.raises(BadRequest, match="serialized_named_tensors"):
        deserialize_named_tensors("not base64!!")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("load_format", [None, LOAD_FORMAT], ids=["per-tensor", "flattened"])
@pytest.mark.parametrize("live", [False, True], ids=["staged", "live"])
def test_update_from_gloo_group_in_process(qwen_dir, qwen_dir_b, load_format, live):
    """Trainer on a thread here, both stock load formats; the separate-process version is in
    tests/integration. Live loading (stock SGLang's way) sets the version at the call."""
    from megarl.rollout.engine import EmbeddedEngine

    engine = EmbeddedEngine(qwen_dir, weight_version="0", live_updates=live)
    port, named = _free_port(), new_weights(qwen_dir_b)
    named = [(n, t) for n, t in named if t.dtype == torch.float32]
    groups = {}

    def trainer():
        groups["pg"] = new_update_group("127.0.0.1", port, 0, 2, "wug", "gloo", timeout_s=60)

    def send():
        if load_format is None:
            for _, t in named:
                groups["pg"].broadcast(t.contiguous(), 0)
        else:
            groups["pg"].broadcast(torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named]))

    async def go():
        t = threading.Thread(target=trainer)
        # The engine's join is fired before the trainer blocks on rendezvous.
        join = asyncio.ensure_future(engine.init_weights_update_group(
            "127.0.0.1", port, 1, 2, "wug", "gloo"))
        await asyncio.sleep(0)
        t.start()
        await join
        await asyncio.to_thread(t.join)
        await engine.begin_weight_update()
        sender = threading.Thread(target=send)
        sender.start()
        await engine.update_weights_from_distributed(
            [n for n, _ in named], [dtype_name(t.dtype) for _, t in named],
            [list(t.shape) for _, t in named], "wug", weight_version="7",
            flush_cache=False, load_format=load_format)
        sender.join()
        mid = engine.weight_version
        await engine.end_weight_update()
        return mid

    try:
        mid = run(go())
        assert mid == ("7" if live else "0")  # staged: goes live at end_weight_update
        params = dict(engine.model.named_parameters())
        assert all(torch.equal(params[n], t) for n, t in named)
        assert run(engine.get_weight_version()) == "7"
        from megarl.rollout.engine import UpdateRefused
        run(engine.begin_weight_update())
        with pytest.raises(UpdateRefused, match="not in"):
            run(engine.update_weights_from_distributed(["x"], ["float32"], [[1]], "nope"))
    finally:
        run(engine.close())
        groups["pg"].close()


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """Two tiny Qwen3-MoE models (8 experts, top-2), other weights each."""
    from megarl.utils.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("moe")
    return [make_tiny_model(root / f"m{seed}", "qwen3_moe", seed=seed) for seed in (0, 1)]


def test_per_expert_updates_land_in_the_fused_experts(moe_dirs):
    """transformers fuses a layer's experts into 3-D tensors; updates named per expert, as
    trainers and checkpoints name them, must change exactly those tensors' slices."""
    from megarl.rollout.engine import EmbeddedEngine

    a, b = moe_dirs
    eng = EmbeddedEngine(a, weight_version="0")
    try:
        assert run(eng.generate(GenerateRequest(PROMPT, greedy(12)))).output_ids == \
            hf_greedy(a, 12)
        named = new_weights(b)
        assert sum(".mlp.experts." in n for n, _ in named) == 2 * 8 * 3
        run(update(eng, named, "1"))
        fused = eng.weights.params["model.layers.1.mlp.experts.gate_up_proj"]
        want = dict(named)
        assert torch.equal(fused[5, fused.shape[1] // 2:],
                           want["model.layers.1.mlp.experts.5.up_proj.weight"])
        assert run(eng.generate(GenerateRequest(PROMPT, greedy(12)))).output_ids == \
            hf_greedy(b, 12) != hf_greedy(a, 12)
    finally:
        run(eng.close())
