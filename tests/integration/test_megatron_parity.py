"""Megatron GPTModel built from an HF config reproduces the HF model (TP=1, TP=2, PP=2) for
Qwen2, Llama 3 (llama3 RoPE scaling), Qwen3, Qwen3-MoE (every token through its top-2 of 8
experts, expert weights TP-split at TP=2) and GLM-4.5 (a dense first layer, then sigmoid
routing with a correction bias, scaling and a shared expert; partial rotary; at PP=2 the dense
layer is stage 0's, the MoE one stage 1's) and DeepSeek-V3 (multi-latent attention with
YaRN, then GLM's kind of MoE with two expert groups). The TP=2 job also runs DeepSeek-V3 at
TP1 × EP2 (its routing equal to transformers' at every token) and TP2 × EP2 with SP (its
HF export, TP and EP gathered, bit-exact), and
every model with sequence parallelism (`sp:` keys), padded and packed (THD), 17-token rows that SP pads to 18. The PP=2
job also runs a 4-layer Qwen2 (tied embeddings) at PP2 × VPP2 (`vpp:` keys): two model chunks
per stage under Megatron's interleaved schedule.
Context parallelism: CP=2 (Qwen3-MoE: Qwen3's Q/K norms and head_dim 24, routed experts, and
routing replay; packed rows through FlexAttention, `attention_backend: flex`) and CP=2 × TP=2
with SP (Qwen2: QKV bias, tied; packed rows one SDPA call per length), padded and packed,
17-token rows padded to 2·CP (×TP) chunks."""
import pytest

from launch_helpers import SCRIPTS, read_json, torchrun

from megarl.utils.tiny_model import make_tiny_model


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_logits_logprobs_entropy_match_hf(tmp_path, tiny_qwen2, tiny_llama, tiny_qwen3,
                                          tiny_qwen3_moe, tiny_glm4_moe, tiny_deepseek_v3,
                                          tp, pp):
    models = (tiny_qwen2, tiny_llama, tiny_qwen3, tiny_qwen3_moe, tiny_glm4_moe,
              tiny_deepseek_v3)
    out = tmp_path / "parity.json"
    # the MoE models also replay a forced routing (R3): Qwen3-MoE's softmax router, GLM-4.5's
    # sigmoid one behind its dense first layer (at PP2 the two are on different stages)
    env = {"PARITY_REPLAY": "1",
           **({"PARITY_SP": "1", "PARITY_EP_MODELS": str(tiny_deepseek_v3)} if tp > 1 else {})}
    deep = None
    if pp > 1:  # layers 0,1 | 2,3 chunks over the two stages: stage 0 holds 0 and 2
        deep = make_tiny_model(tmp_path / "deep", "qwen2", num_layers=4, num_heads=4,
                               num_kv_heads=2, rope_theta=5000.0)
        env["PARITY_VPP_MODELS"] = str(deep)
    torchrun(SCRIPTS / "parity.py", tp * pp, out, tp, pp, *models, env=env)
    res = read_json(out)
    assert set(res) == set(map(str, models)) | ({str(deep)} if deep else set())
    if deep is not None:
        r = res.pop(str(deep))
        assert r["vpp:logits"] <= 1e-4, r
        for temp in ("1.0", "0.7"):
            for layout in ("", "packed_", "mb1_"):
                assert r[f"vpp:{layout}logprobs@{temp}"] <= 1e-5, r
                assert r[f"vpp:{layout}entropy@{temp}"] <= 1e-5, r
                assert r[f"vpp:{layout}pos0@{temp}"] == 0.0, r
    if tp > 1:
        r = res[str(tiny_deepseek_v3)]
        assert r["ep2:routing_off"] == 0, r
        assert r["tp2ep2:export_off"] == [], r  # what the sync and the converter send
        for run in ("ep2:", "tp2ep2:"):
            assert r[f"{run}logits"] <= 1e-4, r
            for temp in ("1.0", "0.7"):
                for layout in ("", "packed_") if run == "tp2ep2:" else ("",):
                    assert r[f"{run}{layout}logprobs@{temp}"] <= 1e-5, r
                    assert r[f"{run}{layout}entropy@{temp}"] <= 1e-5, r
    for model, r in res.items():
        runs = [""] + (["sp:"] if tp > 1 else [])
        for sp in runs:
            assert r[f"{sp}logits"] <= 1e-4, (model, r)
            for temp in ("1.0", "0.7"):
                for layout in ("", "packed_") if sp else ("",):
                    assert r[f"{sp}{layout}logprobs@{temp}"] <= 1e-5, (model, r)
                    assert r[f"{sp}{layout}entropy@{temp}"] <= 1e-5, (model, r)
                    assert r[f"{sp}{layout}pos0@{temp}"] == 0.0
            if model in (str(tiny_qwen3_moe), str(tiny_glm4_moe)):
                assert r[f"{sp}forced_vs_own"] > 0.05, (model, r)  # another routing indeed
                assert r[f"{sp}forced_padded"] <= 1e-5, (model, r)
                assert r[f"{sp}forced_packed"] <= 1e-5, (model, r)


@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2)], ids=["cp2", "cp2-tp2-sp"])
def test_context_parallel_matches_hf(tmp_path, tiny_qwen2, tiny_qwen3_moe, tp, cp):
    """Each rank holds chunks r and 2·CP-1-r of every sequence (of every packed sequence),
    attends over K/V gathered from the CP group; Megatron's RoPE slices the same chunks. At
    CP=2 the MoE worker replays a forced routing (R3): each router takes the experts of its
    rank's chunks. At CP=2 × TP=2 the log-probs take the token-chunked path (5-token chunks of
    each rank's share, vocab-parallel): the same numbers."""
    model = tiny_qwen3_moe if tp == 1 else tiny_qwen2
    out = tmp_path / "parity.json"
    torchrun(SCRIPTS / "parity.py", tp * cp, out, tp, 1, model,
             env={"PARITY_CP": str(cp), "PARITY_REPLAY": "1",
                  **({"PARITY_SP": "only", "PARITY_CHUNK": "5"} if tp > 1
                     else {"PARITY_ATTENTION": "flex"})})
    r = read_json(out)[str(model)]
    if tp == 1:
        assert r["forced_vs_own"] > 0.05, r  # the forced routing really is another one
        assert r["forced_padded"] <= 1e-5 and r["forced_packed"] <= 1e-5, r
    sp = "sp:" if tp > 1 else ""
    assert r[f"{sp}logits"] <= 1e-5, r
    for temp in ("1.0", "0.7"):
        for layout in ("", "packed_"):
            assert r[f"{sp}{layout}logprobs@{temp}"] <= 1e-5, r
            assert r[f"{sp}{layout}entropy@{temp}"] <= 1e-5, r
            assert r[f"{sp}{layout}pos0@{temp}"] == 0.0
