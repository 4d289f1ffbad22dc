"""Dual buffer: requests in flight while two versions arrive all complete; every token carries
the version that produced it, and no forward pass mixed versions (each token's log-prob is
reproduced by replaying the request with exactly the tagged version's weights per step)."""
import time

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache

from megarl.rollout.protocol import GenerateRequest, SamplingParams
from megarl.weight_sync.producer import WeightProducer
from megarl.weight_sync.protocol import SyncConfig
from megarl.weight_sync.transports import EngineLink

from ws_helpers import deliver


@torch.no_grad()
def replay(model, versions, out, prompt, temperature):
    """Per-token log-probs of `out`, switching weights where its version spans say."""
    version_of = [v for v, a, b in out.weight_version_spans for _ in range(a, b)]
    past, logps, feed = DynamicCache(), [], torch.tensor([prompt])
    for i, tok in enumerate(out.output_ids):
        model.load_state_dict(versions[version_of[i]], strict=False)
        logits = model(feed, past_key_values=past, use_cache=True).logits[0, -1]
        logps.append(torch.log_softmax(logits.float() / temperature, -1)[tok].item())
        feed = torch.tensor([[tok]])
    return torch.tensor(logps)


def test_in_flight_requests_complete_with_per_token_versions(engine_server, ws_model, ws_model_b):
    v0 = load_file(str(ws_model / "model.safetensors"))
    v1 = load_file(str(ws_model_b / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    v2 = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in v1.items()}
    versions = {"0": v0, "1": v1, "2": v2}
    eng = engine_server.engine
    prod = WeightProducer([EngineLink(engine_server.url, pause_for_update=False)],
                          SyncConfig(dual_buffer=True, consume_bucket_mb=1 / 64))
    prod.connect("127.0.0.1")
    prompts = [[5 + i, 17, 42, 7 * i + 1] for i in range(4)]
    sp = SamplingParams(max_new_tokens=300, temperature=0.8, ignore_eos=True, sampling_seed=3)
    futs = [engine_server.submit(eng.generate(GenerateRequest(p, sp))) for p in prompts]
    try:
        for version in (1, 2):
            time.sleep(0.05)  # let decoding move on under the current version
            deliver(prod, sorted(versions[str(version)].items()), version, dual=True)
        outs = [f.result(120) for f in futs]
    finally:
        prod.close()
    assert eng.weight_version == "2"
    seen = set()
    for p, out in zip(prompts, outs):
        assert out.finish_reason.type == "length" and len(out.output_ids) == 300
        spans = out.weight_version_spans
        assert spans[0][1] == 0 and spans[-1][2] == 300
        assert all(a[2] == b[1] for a, b in zip(spans, spans[1:]))  # contiguous
        order = [v for v, _, _ in spans]
        assert order == sorted(order, key=int)  # versions only move forward
        seen.update(order)
        model = AutoModelForCausalLM.from_pretrained(ws_model, dtype=torch.float32).eval()
        want = replay(model, versions, out, p, sp.temperature)
        assert torch.allclose(torch.tensor(out.output_logprobs), want, atol=1e-4), (
            (torch.tensor(out.output_logprobs) - want).abs().max())
    assert {"1", "2"} <= seen, seen  # the syncs really happened mid-request
