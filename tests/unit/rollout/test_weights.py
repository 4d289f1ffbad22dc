"""Weight updates on the embedded engine: apply, reject atomically, stage, version spans."""
import asyncio
import socket
import threading

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megarl.rollout.protocol import BadRequest, GenerateRequest, SamplingParams
from megarl.rollout.weights import (broadcast_tensors, deserialize_named_tensors, dtype_name,
                                    new_update_group, serialize_named_tensors)

run = asyncio.run
PROMPT = [40, 41, 42, 43]


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def new_weights(model_dir):
    return list(load_file(str(model_dir / "model.safetensors")).items())


def hf_greedy(model_dir, n):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def test_update_from_tensor_changes_generation_and_version(engine, qwen_dir, qwen_dir_b):
    before = run(engine.generate(GenerateRequest(PROMPT, greedy(12))))
    assert before.output_ids == hf_greedy(qwen_dir, 12) and before.weight_version == "v0"
    run(engine.update_weights_from_tensor(new_weights(qwen_dir_b), weight_version="v1"))
    after = run(engine.generate(GenerateRequest(PROMPT, greedy(12))))
    assert after.output_ids == hf_greedy(qwen_dir_b, 12)
    assert after.weight_version == "v1" and after.weight_version_spans == [("v1", 0, 12)]
    assert run(engine.get_weight_version()) == "v1"


@pytest.mark.parametrize("bad, field", [
    (("model.no_such.weight", torch.zeros(3)), "names"),
    (("model.norm.weight", torch.zeros(7)), "shapes"),
])
def test_rejected_update_leaves_old_weights_intact(engine, qwen_dir_b, bad, field):
    named = new_weights(qwen_dir_b)
    before = {n: p.clone() for n, p in engine.model.named_parameters()}
    # The bad tensor comes last: nothing before it may have been applied either.
    with pytest.raises(BadRequest) as e:
        run(engine.update_weights_from_tensor(named + [bad], weight_version="v1"))
    assert e.value.field == field
    assert all(torch.equal(before[n], p) for n, p in engine.model.named_parameters())
    assert run(engine.get_weight_version()) == "v0"


def test_tied_lm_head_accepted_under_either_name(engine):
    emb = engine.model.get_input_embeddings().weight
    run(engine.update_weights_from_tensor([("lm_head.weight", torch.ones_like(emb))]))
    assert torch.equal(emb, torch.ones_like(emb))


def test_weights_changed_mid_request_are_recorded_as_spans(engine, qwen_dir_b):
    async def go():
        task = asyncio.ensure_future(engine.generate(GenerateRequest(PROMPT, greedy(300),
                                                                     rid="long")))
        while "long" not in engine._seqs or len(engine._seqs["long"].output_ids) < 5:
            await asyncio.sleep(0.002)
        await engine.update_weights_from_tensor(new_weights(qwen_dir_b), weight_version="v1")
        return await task

    out = run(go())
    (v0, a0, b0), (v1, a1, b1) = out.weight_version_spans
    assert (v0, a0, v1, b1) == ("v0", 0, "v1", 300) and b0 == a1 >= 5
    assert out.weight_version == "v0"  # stamped at dispatch
    assert out.token_versions()[b0 - 1:b0 + 1] == ["v0", "v1"]


def test_begin_end_stages_until_end(engine, qwen_dir, qwen_dir_b):
    named = new_weights(qwen_dir_b)
    run(engine.begin_weight_update())
    run(engine.update_weights_from_tensor(named[: len(named) // 2]))
    run(engine.update_weights_from_tensor(named[len(named) // 2:], weight_version="v1"))
    staged = run(engine.generate(GenerateRequest(PROMPT, greedy(8))))
    assert staged.output_ids == hf_greedy(qwen_dir, 8) and staged.weight_version == "v0"
    run(engine.end_weight_update())
    after = run(engine.generate(GenerateRequest(PROMPT, greedy(8))))
    assert after.output_ids == hf_greedy(qwen_dir_b, 8) and after.weight_version == "v1"
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


def test_update_from_gloo_group_in_process(engine, qwen_dir_b):
    """Trainer on a thread here; the separate-process version is in tests/integration."""
    port, named = _free_port(), new_weights(qwen_dir_b)
    groups = {}

    def trainer():
        groups["pg"] = new_update_group("127.0.0.1", port, 0, 2, "wug", "gloo", timeout_s=60)

    async def go():
        t = threading.Thread(target=trainer)
        # The engine's join is fired before the trainer blocks on rendezvous.
        join = asyncio.ensure_future(engine.init_weights_update_group(
            "127.0.0.1", port, 1, 2, "wug", "gloo"))
        await asyncio.sleep(0)
        t.start()
        await join
        await asyncio.to_thread(t.join)
        send = threading.Thread(target=broadcast_tensors, args=(groups["pg"], [t for _, t in named]))
        send.start()
        await engine.update_weights_from_distributed(
            [n for n, _ in named], [dtype_name(t.dtype) for _, t in named],
            [list(t.shape) for _, t in named], "wug", weight_version="v7")
        send.join()

    run(go())
    params = dict(engine.model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in named)
    assert run(engine.get_weight_version()) == "v7"
    with pytest.raises(BadRequest, match="group_name"):
        run(engine.update_weights_from_distributed(["x"], ["float32"], [[1]], "nope"))
