"""Pure HF <-> Megatron layout maps: sharding, QKV interleave, vocab padding, name coverage."""
import pytest
import torch

from megarl.backends.megatron.model import ModelArgs, padded_vocab_size
from megarl.backends.megatron.hf import mapping


def _args(**kw):
    base = dict(arch="qwen2", vocab_size=300, hidden_size=16, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=4, ffn_hidden_size=24, norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=True)
    base.update(kw)
    return ModelArgs(**base)


def test_padded_vocab_is_aligned_to_tp():
    assert padded_vocab_size(300, 128, 1) == 384
    assert padded_vocab_size(300, 128, 2) == 512
    assert padded_vocab_size(256, 128, 2) == 256


@pytest.mark.parametrize("name", ["decoder.layers.1.self_attention.linear_qkv.weight",
                                  "decoder.layers.0.mlp.linear_fc1.weight",
                                  "decoder.layers.0.mlp.linear_fc2.weight",
                                  "embedding.word_embeddings.weight",
                                  "decoder.final_layernorm.weight"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_unshard_roundtrip(name, tp):
    full = torch.randn(48, 16)
    shards = [mapping.shard(name, full, tp, r) for r in range(tp)]
    assert torch.equal(mapping.unshard(name, shards), full)


def test_gated_fc1_shard_holds_its_gate_and_up_slices():
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    full = torch.cat([gate, up])
    s1 = mapping.shard("decoder.layers.0.mlp.linear_fc1.weight", full, 2, 1)
    assert torch.equal(s1, torch.cat([gate[2:], up[2:]]))


def test_qkv_interleaves_per_query_group():
    a = _args()
    q = torch.arange(16.0)[:, None].expand(16, 3)   # 4 heads × 4 dims
    k = 100 + torch.arange(8.0)[:, None].expand(8, 3)  # 2 groups × 4 dims
    v = 200 + torch.arange(8.0)[:, None].expand(8, 3)
    fused = mapping.fuse_qkv(q, k, v, a)
    # group 0: q heads 0-1, k0, v0; group 1: q heads 2-3, k1, v1
    col = fused[:, 0].tolist()
    assert col[:8] == list(range(8)) and col[8:12] == [100, 101, 102, 103]
    assert col[12:16] == [200, 201, 202, 203] and col[16:24] == list(range(8, 16))
    for x, y in zip(mapping.split_qkv(fused, a), (q, k, v)):
        assert torch.equal(x, y)
    # and a TP=2 shard of the fused tensor is exactly one whole group
    assert torch.equal(mapping.shard("decoder.layers.0.self_attention.linear_qkv.weight",
                                     fused, 2, 1), fused[16:])


@pytest.mark.parametrize("tie", [True, False])
def test_hf_names_cover_every_megatron_tensor(tie):
    a = _args(tie_word_embeddings=tie)
    hf = {n: torch.randn(3) for n in mapping.hf_names(a)}
    hf["model.embed_tokens.weight"] = torch.randn(300, 16)
    if not tie:
        hf["lm_head.weight"] = torch.randn(300, 16)
    back = {}
    mc = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    for i in range(2):
        for s in ["input_layernorm.weight", "pre_mlp_layernorm.weight",
                  "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                  "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
                  "mlp.linear_fc2.weight"]:
            mc.append(f"decoder.layers.{i}.{s}")
    for name in mc:
        if "linear_qkv" in name:
            continue  # shapes of the random stand-ins do not fuse; covered above
        full = mapping.mcore_from_hf(name, hf.__getitem__, a, 384)
        back.update(mapping.hf_from_mcore(name, full, a))
    for n, t in back.items():
        assert torch.equal(t, hf[n]), n
    assert torch.equal(mapping.mcore_from_hf("output_layer.weight", hf.__getitem__, a, 384)[:300],
                       hf["model.embed_tokens.weight" if tie else "lm_head.weight"])


def test_unknown_name_is_rejected_by_name():
    with pytest.raises(KeyError, match="decoder.layers.0.weird"):
        mapping.hf_from_mcore("decoder.layers.0.weird", torch.zeros(1), _args())


def _layer_names(layers=2):
    return [f"decoder.layers.{i}.{s}" for i in range(layers)
            for s in ["input_layernorm.weight", "pre_mlp_layernorm.weight",
                      "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                      "self_attention.q_layernorm.weight", "self_attention.linear_proj.weight",
                      "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]]


def test_transformer_engine_names_are_megatrons_own_and_round_trip():
    """TE's spec fuses the pre-norms into the next linear; the names the map gives are the
    ones Megatron itself uses for them (its local spec's checkpoint key map), and every name
    comes back unchanged."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec(normalization="RMSNorm").submodules \
        .sharded_state_dict_keys_map
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
             "output_layer.weight", *_layer_names()]
    for name in names:
        te = mapping.te_name(name)
        assert mapping.local_name(te) == name
        assert mapping.local_name(name) == name  # local names pass through
        layer, suffix = mapping.split_layer_name(name)
        expected = name
        for old, new in keys_map.items():
            if layer is not None and suffix.startswith(old):
                expected = f"decoder.layers.{layer}.{new}{suffix[len(old):]}"
        assert te == expected, name
    assert mapping.te_name("decoder.layers.3.input_layernorm.weight") == \
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert mapping.te_name("decoder.layers.0.pre_mlp_layernorm.weight") == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"


def test_a_te_named_norm_maps_to_the_same_hf_tensor():
    a = _args()
    hf = {n: torch.randn(16) for n in mapping.hf_names(a) if "norm" in n}
    for name in _layer_names():
        if "layernorm" not in name or "q_layernorm" in name:
            continue
        te = mapping.local_name(mapping.te_name(name))
        assert torch.equal(mapping.mcore_from_hf(te, hf.__getitem__, a, 384),
                           mapping.mcore_from_hf(name, hf.__getitem__, a, 384))
        assert mapping.partition_dim(mapping.te_name(name)) is None  # norms: replicated
