"""Megatron GPTModel built from an HF config reproduces the HF model (TP=1, TP=2, PP=2) for
Qwen2, Llama 3 (llama3 RoPE scaling), Qwen3 and Qwen3-MoE (every token through its top-2 of 8
experts, expert weights TP-split at TP=2)."""
import pytest

from launch_helpers import SCRIPTS, read_json, torchrun


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_logits_logprobs_entropy_match_hf(tmp_path, tiny_qwen2, tiny_llama, tiny_qwen3,
                                          tiny_qwen3_moe, tp, pp):
    models = (tiny_qwen2, tiny_llama, tiny_qwen3, tiny_qwen3_moe)
    out = tmp_path / "parity.json"
    torchrun(SCRIPTS / "parity.py", tp * pp, out, tp, pp, *models)
    res = read_json(out)
    assert set(res) == set(map(str, models))
    for model, r in res.items():
        assert r["logits"] <= 1e-4, (model, r)
        for temp in ("1.0", "0.7"):
            assert r[f"logprobs@{temp}"] <= 1e-5, (model, r)
            assert r[f"entropy@{temp}"] <= 1e-5, (model, r)
            assert r[f"pos0@{temp}"] == 0.0
