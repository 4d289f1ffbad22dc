"""DeepSeek-V3 on the stock server (deepseek_v2.py of the pinned release, on this CPU in fp32,
with megarl's CPU shim routing torch_native attention to the absorbed MLA method): a tiny
DeepSeek-V3 (multi-latent attention with YaRN, a dense first layer, then 8 sigmoid-routed
experts in 2 groups with a correction bias, scaled, and a shared expert) generates what
transformers generates; its routed experts are the embedded engine's at every position (the
dense layer reported as expert 0 by both); and a whole new set of weights under the names
megarl's sync sends (q_a_proj and kv_a_proj_with_mqa of a layer in one bucket, which stock
fuses; kv_b_proj, from which it rebuilds its absorbed w_kc / w_vc; the fp32 correction bias)
makes it serve what transformers does on those weights. One server (~20 s to start)."""
import pytest
from safetensors.torch import load_file

from megarl.rollout.engine import EmbeddedEngine
from megarl.utils.tiny_model import make_tiny_model
from stock_helpers import (assert_routes_like_embedded, assert_serves_like_transformers,
                           launched, run, send_whole_update)


@pytest.fixture(scope="module")
def deepseek_server(stock_python, tiny_deepseek_v3, tmp_path_factory):
    with launched(tiny_deepseek_v3, stock_python, tmp_path_factory, "stock-deepseek",
                  enable_return_routed_experts=True) as server:
        yield server


def test_stock_deepseek_v3_serves_and_routes_like_the_embedded_engine(deepseek_server,
                                                                      tiny_deepseek_v3):
    assert_serves_like_transformers(deepseek_server.url, tiny_deepseek_v3)
    embedded = EmbeddedEngine(tiny_deepseek_v3, load_tokenizer=False, dtype="float32",
                              enable_return_routed_experts=True)
    try:
        for rows in assert_routes_like_embedded(
                deepseek_server.url, embedded, [([5, 17, 42, 99, 7, 123, 64], 0, 6),
                                                ([9, 8, 7, 6, 5], 2, 4)], 2, 2):
            assert (rows[:, 0] == 0).all() and rows[:, 1].any()  # layer 0 is dense
    finally:
        run(embedded.close())


def test_stock_deepseek_v3_loads_a_whole_update_under_megarls_names(deepseek_server,
                                                                    tiny_deepseek_v3,
                                                                    tmp_path):
    b = make_tiny_model(tmp_path / "dsv3-b", "deepseek_v3", seed=1, vocab_size=300,
                        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=128)
    # name order puts each layer's kv_a_proj_with_mqa and q_a_proj 16 KiB buckets apart:
    # only the packer's pairing keeps them in one update call
    named = sorted(load_file(str(b / "model.safetensors")).items())
    assert any(n.endswith("e_score_correction_bias") for n, _ in named)
    assert any(n.endswith("kv_a_proj_with_mqa.weight") for n, _ in named)
    send_whole_update(deepseek_server.url, named)
    assert_serves_like_transformers(deepseek_server.url, b)
