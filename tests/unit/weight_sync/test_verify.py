"""Verify mode's comparison of engine checksums with what the trainer sent
(megarl/weight_sync/verify.py); tests/stock runs it against the stock server."""
import torch

from megarl.rollout.weights import tensor_checksum
from megarl.weight_sync.producer import _refused
from megarl.weight_sync.verify import SentDigest, check_engine, direct

P = "model.layers.0"


def sent():
    g = torch.Generator().manual_seed(0)
    named = {f"{P}.self_attn.{n}.{k}": torch.randn(rows, *(() if k == "bias" else (4,)),
                                                   generator=g)
             for n, rows in (("q_proj", 4), ("k_proj", 2), ("v_proj", 2))
             for k in ("weight", "bias")}
    named.update({f"{P}.mlp.{n}.weight": torch.randn(6, 4, generator=g)
                  for n in ("gate_proj", "up_proj")})
    named["model.embed_tokens.weight"] = torch.randn(100, 4, generator=g)
    named["model.norm.weight"] = torch.randn(4, generator=g)
    d = SentDigest()
    for n, t in sorted(named.items()):  # any order: the parts are fused once all are in
        d.add(n, t)
    return named, d


def test_fused_parameters_are_checksummed_as_stock_holds_them():
    named, d = sent()
    qkv = torch.cat([named[f"{P}.self_attn.{n}_proj.weight"] for n in "qkv"])
    gate_up = torch.cat([named[f"{P}.mlp.{n}_proj.weight"] for n in ("gate", "up")])
    assert d.checksums[f"{P}.self_attn.qkv_proj.weight"] == tensor_checksum(qkv)
    assert d.checksums[f"{P}.mlp.gate_up_proj.weight"] == tensor_checksum(gate_up)
    assert not d._parts  # nothing held once fused


def test_check_engine_compares_what_it_can_and_counts_the_rest():
    named, d = sent()
    engine = {f"{P}.self_attn.qkv_proj.weight": d.checksums[f"{P}.self_attn.qkv_proj.weight"],
              "model.norm.weight": d.checksums["model.norm.weight"],
              "model.embed_tokens.weight": "padded-rows",  # 100 rows: stock pads to 128
              "model.rotary_emb.cos_sin_cache": "a buffer, never sent"}
    assert check_engine(engine, d, "float32") == (2, 1, [])
    assert check_engine(engine, d, "bfloat16") == (0, 3, [])  # every tensor cast on load
    engine["model.norm.weight"] = "0" * 16
    assert check_engine(engine, d, "auto")[2] == ["model.norm.weight"]
    # megarl's embedded engine pads nothing: its embedding is compared
    assert check_engine({"model.embed_tokens.weight": "x"}, d, None, embedded=True)[2] == [
        "model.embed_tokens.weight"]


def test_which_engines_are_compared_with_the_trainer():
    assert direct({"engine": "megarl-embedded", "tp_size": 2})
    assert direct({"device": "cpu", "tp_size": 1})
    assert not direct({"device": "cpu", "tp_size": 2})
    assert not direct({"device": "cuda", "tp_size": 1})


def test_stock_refusals_are_told_from_broken_receives():
    """Stock 0.5.23 wraps every exception of its receive in one message
    (managers/scheduler_components/weight_updater.py)."""
    prefix = "Failed to receive weights: "
    for why in ("Group g not in []. Please call `init_weights_update_group` first.",
                "Cannot create empty tensor bucket",
                "Unaligned received tensor w: byte offset 2, dtype torch.float32",
                "module 'torch' has no attribute 'float99'"):
        assert _refused(prefix + why)
    assert _refused("update_weights_from_distributed must run between begin and end")
    assert not _refused(prefix + "[../gloo/transport/tcp/pair.cc] Connection closed by peer")
