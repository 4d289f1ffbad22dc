"""Helpers of the stock SGLang tests (a module with its own name, not conftest.py, so that
test modules can import it whichever conftest pytest loaded first)."""
from __future__ import annotations

import asyncio

PROMPT = [5, 17, 42, 99, 7, 123, 64]


def run(coro):
    return asyncio.run(coro)


def greedy(n=8, **kw):
    from megarl.rollout.protocol import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def hf_greedy(model_dir, prompt, n=8):
    """Greedy tokens of transformers in fp32, one full forward per token (no cache)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                              dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def assert_serves_like_transformers(url, model_dir):
    """The server's greedy tokens are transformers' (fp32) and its log-probs within 1e-4."""
    import torch
    import transformers

    out = run(generate(url))
    assert out.output_ids == hf_greedy(model_dir, PROMPT)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                              dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out.output_ids])).logits[0, len(PROMPT) - 1:-1]
    want = logits.log_softmax(-1).gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.output_logprobs), want, atol=1e-4, rtol=0)


async def generate(url, prompt=PROMPT, sp=None, rid="g", **kw):
    from megarl.backends.sglang import SGLangEngine
    from megarl.rollout.protocol import GenerateRequest

    engine = SGLangEngine(url, **kw)
    try:
        return await engine.generate(GenerateRequest(prompt, sp or greedy(), rid=rid,
                                                     return_logprob=True))
    finally:
        await engine.close()


def stock_args(model, python: str, **kw):
    """ServerArgs of a stock server on this CPU for `model` (fp32: equal to transformers)."""
    from megarl.backends.sglang.launcher import ServerArgs, find_free_port

    kw.setdefault("context_length", 512)
    kw.setdefault("max_running_requests", 8)
    return ServerArgs(str(model), port=find_free_port(), device="cpu", python=python,
                      dtype="float32", weight_version="0", random_seed=0, **kw)


def launched(model, python: str, tmp_path_factory, name: str, **kw):
    """A stock server on `model` started now (a context manager), its log under a temp dir;
    `kw`: more ServerArgs."""
    from megarl.backends.sglang.launcher import launch_server

    log = tmp_path_factory.mktemp(name) / "server.log"
    return launch_server(stock_args(model, python, **kw), timeout_s=300, log_path=log)


def assert_routes_like_embedded(url, embedded, cases, layers: int, topk: int) -> list:
    """The same greedy requests (prompt ids, routed_experts_start_len, new tokens) on the
    stock server at `url` and on the `embedded` engine: the same tokens, and the routed
    experts equal at every position from the start. Returns stock's decoded rows per case."""
    import numpy as np

    from megarl.backends.sglang import SGLangEngine
    from megarl.rollout.protocol import GenerateRequest, decode_routed_experts

    async def both(ids, start, n):
        def req():
            return GenerateRequest(ids, greedy(n), return_routed_experts=True,
                                   routed_experts_start_len=start)
        stock = SGLangEngine(url)
        try:
            return await stock.generate(req()), await embedded.generate(req())
        finally:
            await stock.close()

    out = []
    for ids, start, n in cases:
        stock, mine = run(both(ids, start, n))
        assert stock.output_ids == mine.output_ids, (ids, start)
        rows = decode_routed_experts(stock.routed_experts, layers, topk)
        assert rows.shape == (len(ids) + n - 1 - start, layers, topk), (ids, start)
        np.testing.assert_array_equal(
            rows, decode_routed_experts(mine.routed_experts, layers, topk),
            err_msg=f"prompt {ids}, start_len {start}")
        out.append(rows)
    return out


def send_whole_update(url, named) -> None:
    """Send `named` (name, tensor) pairs to the stock server at `url` as weight version 1
    through megarl's producer (buckets of 16 KiB, the server paused for the update)."""
    from megarl.weight_sync.producer import SyncStats, WeightProducer
    from megarl.weight_sync.protocol import SyncConfig
    from megarl.weight_sync.transports import EngineLink

    prod = WeightProducer([EngineLink(url, 1, pause_for_update=True)],
                          SyncConfig(consume_bucket_mb=1 / 64))
    prod.connect("127.0.0.1")
    try:
        prod.open_version(1)
        try:
            prod.send(prod.stream(iter(named), 1), 1, True, SyncStats(1))
        finally:
            prod.close_version(dict(prod.stale))
    finally:
        prod.close()
