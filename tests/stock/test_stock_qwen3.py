"""Qwen3-MoE on the stock server (qwen3_moe.py of the pinned release, on this CPU in fp32):
a tiny Qwen3-MoE (Qwen3's attention: per-head q/k RMSNorm, a head_dim apart from hidden /
heads; 8 experts, top-2) generates what transformers generates; a Megatron trainer at TP=2
syncs into it bit for bit wherever stock's checksums name a tensor as sent (q_norm and k_norm
included; stock fuses the experts into w13/w2, which no sent tensor names); and a whole new
set of weights named per expert, as megarl's trainer sends them, makes it generate what
transformers does on those weights (stock fuses them on load); started with
--enable-return-routed-experts, it reports the experts megarl's embedded engine reports, position
by position. One server: each costs ~20 s to start. (The dense Qwen3's qwen3.py loads q/k norms
by the same names; checked by hand, docs/megatron_backend.md.)"""
import json
import urllib.error
import urllib.request

import pytest
from safetensors.torch import load_file

from launch_helpers import SCRIPTS, read_json, torchrun
from megarl.rollout.engine import EmbeddedEngine
from megarl.rollout.protocol import BadRequest, GenerateRequest
from megarl.utils.tiny_model import make_tiny_model
from stock_helpers import (PROMPT, assert_routes_like_embedded, assert_serves_like_transformers,
                           generate, greedy, hf_greedy, launched, run, send_whole_update)


@pytest.fixture(scope="module")
def moe_dirs(tiny_qwen3_moe, tmp_path_factory):
    other = make_tiny_model(tmp_path_factory.mktemp("moe-b") / "model", "qwen3_moe", seed=1,
                            head_dim=24, vocab_size=300, hidden_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=128)
    return tiny_qwen3_moe, other


@pytest.fixture(scope="module")
def moe_server(stock_python, tiny_qwen3_moe, tmp_path_factory):
    with launched(tiny_qwen3_moe, stock_python, tmp_path_factory, "stock-moe",
                  enable_return_routed_experts=True) as server:
        yield server


def test_stock_qwen3_moe_generates_what_transformers_does(moe_server, tiny_qwen3_moe):
    assert_serves_like_transformers(moe_server.url, tiny_qwen3_moe)


def test_stock_routed_experts_are_the_embedded_engines(moe_server, tiny_qwen3_moe):
    """Before the tests below change the server's weights: the same greedy requests on stock
    and on the embedded engine, routed experts equal at every position (start_len 0 and not),
    and a start past the prompt refused by both."""
    cases = [(PROMPT, 0, 6), (PROMPT, 3, 6), ([9, 8, 7, 6, 5], 5, 4), ([200, 3], 1, 1)]
    embedded = EmbeddedEngine(tiny_qwen3_moe, load_tokenizer=False, dtype="float32",
                              enable_return_routed_experts=True)
    try:
        assert_routes_like_embedded(moe_server.url, embedded, cases, 2, 2)
        bad = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2},
               "return_routed_experts": True, "routed_experts_start_len": len(PROMPT) + 1}
        req = urllib.request.Request(moe_server.url + "/generate", json.dumps(bad).encode(),
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 400 and "routed_experts_start_len" in e.value.read().decode()
        with pytest.raises(BadRequest) as mine_e:
            embedded.check(GenerateRequest(PROMPT, greedy(2), return_routed_experts=True,
                                           routed_experts_start_len=len(PROMPT) + 1))
        assert mine_e.value.field == "routed_experts_start_len"
    finally:
        run(embedded.close())


def test_a_tp2_megatron_qwen3_moe_syncs_into_stock_bit_exact(tmp_path, tiny_qwen3_moe,
                                                            moe_server):
    out = tmp_path / "ws.json"
    torchrun(SCRIPTS / "ws_sync.py", 2, out, 2, 1, tiny_qwen3_moe, "qwen3-moe",
             f"{moe_server.url},1,1", timeout=600)
    res = read_json(out)
    assert list(res) == ["smaller", "equal", "larger", "dual"]
    for case, r in res.items():
        assert r["equal"] == [True], (case, r)
        # per layer qkv_proj, o_proj, q_norm, k_norm, two norms and the router (gate), and
        # the final norm (the embedding's rows are padded by stock: not comparable)
        assert r["compared"][0] >= 2 * 7 + 1, (case, r)
        names = r["names"][0]
        assert {f"model.layers.{i}.self_attn.{x}_norm.weight"
                for i in (0, 1) for x in "qk"} <= set(names), (case, names)


def test_stock_qwen3_moe_loads_per_expert_updates(moe_server, moe_dirs):
    """After the test above the server holds the trainer's perturbed weights: a whole update
    from another model, every expert named on its own, must replace all of them."""
    a, b = moe_dirs
    named = sorted(load_file(str(b / "model.safetensors")).items())
    assert sum(".mlp.experts." in n for n, _ in named) == 2 * 8 * 3
    send_whole_update(moe_server.url, named)
    out = run(generate(moe_server.url, rid="after"))
    assert out.output_ids == hf_greedy(b, PROMPT) != hf_greedy(a, PROMPT)
