"""GLM-4.5 on the stock server (glm4_moe.py of the pinned release, on this CPU in fp32): a tiny
GLM-4.5 (partial rotary 0.5, QKV bias, QK-norm, a dense first layer, then 8 sigmoid-routed
experts with a correction bias, scaled, and a shared expert) generates what transformers
generates; its routed experts are the embedded engine's at every position (the dense layer
reported as expert 0 by both); and a whole new set of weights under the names megarl's sync
sends (per expert, the shared expert, the fp32 correction bias) makes it generate what
transformers does on those weights. One server (~20 s to start)."""
import pytest
from safetensors.torch import load_file

from megarl.rollout.engine import EmbeddedEngine
from megarl.utils.tiny_model import make_tiny_model
from stock_helpers import (PROMPT, assert_routes_like_embedded, assert_serves_like_transformers,
                           generate, hf_greedy, launched, run, send_whole_update)


@pytest.fixture(scope="module")
def glm_server(stock_python, tiny_glm4_moe, tmp_path_factory):
    with launched(tiny_glm4_moe, stock_python, tmp_path_factory, "stock-glm",
                  enable_return_routed_experts=True) as server:
        yield server


def test_stock_glm45_serves_and_routes_like_the_embedded_engine(glm_server, tiny_glm4_moe):
    assert_serves_like_transformers(glm_server.url, tiny_glm4_moe)
    embedded = EmbeddedEngine(tiny_glm4_moe, load_tokenizer=False, dtype="float32",
                              enable_return_routed_experts=True)
    try:
        for rows in assert_routes_like_embedded(
                glm_server.url, embedded, [(PROMPT, 0, 6), ([9, 8, 7, 6, 5], 2, 4)], 2, 2):
            assert (rows[:, 0] == 0).all() and rows[:, 1].any()  # layer 0 is dense
    finally:
        run(embedded.close())


def test_stock_glm45_loads_a_whole_update_under_megarls_names(glm_server, tiny_glm4_moe,
                                                               tmp_path):
    b = make_tiny_model(tmp_path / "glm-b", "glm4_moe", seed=1, head_dim=24, vocab_size=300,
                        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=128)
    named = sorted(load_file(str(b / "model.safetensors")).items())
    assert any(n.endswith("e_score_correction_bias") for n, _ in named)
    assert any(".mlp.shared_experts." in n for n, _ in named)
    send_whole_update(glm_server.url, named)
    out = run(generate(glm_server.url, rid="after"))
    assert out.output_ids == hf_greedy(b, PROMPT) != hf_greedy(tiny_glm4_moe, PROMPT)
