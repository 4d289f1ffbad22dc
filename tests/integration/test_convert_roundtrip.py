"""HF <-> Megatron dist-checkpoint conversion through the tools, bit-exact, with resharding."""
import json

import pytest
import torch

from launch_helpers import run_tool
from megarl.convert.checkpoints import compare_hf_dirs
from megarl.backends.megatron.hf.hf_io import HFReader


def _assert_bit_exact(src, dst):
    diffs = compare_hf_dirs(src, dst)
    assert len(diffs) == len(HFReader(src).keys())
    bad = {k: v for k, v in diffs.items() if v != 0.0}
    assert not bad, bad


# glm4_moe: every tensor kind of qwen3_moe (q/k norms, head_dim 24, routed experts split over
# TP and EP, untied embeddings) and more: QKV bias, a dense first layer, a shared expert and the
# router's fp32 correction bias (a Megatron buffer), so it stands in for qwen3_moe here (the
# suite's time has room for one MoE case). (Qwen2's tied embeddings, QKV bias and dense MLP
# convert in test_pp2_vpp2_checkpoint_reads_back_at_pp1_and_pp2_vpp2 and test_convert_trained.py,
# at PP2 x VPP2 and TP2;
# Llama's tensors are Qwen2's without the bias, untied: the suite's time has no room for it.
# DeepSeek-V3's MLA tensors: loaded from HF in test_megatron_parity.py's jobs and exported
# back bit-exact at TP2 x EP2 there (`tp2ep2:export_off`), the checkpoint steps being GLM's;
# its HF -> TP2xEP2 -> HF(ETP1) run here measured bit-exact, 27 s, on 2026-11-29.)
@pytest.mark.parametrize("arch", ["glm4_moe"])
def test_hf_to_tp2_ep2_to_hf_roundtrip_and_reshard(tmp_path, request, arch):
    """One case for every layout move: HF -> TP2×EP2 (ETP = TP: 4 ranks, each EP rank 4 of the
    8 experts split over TP2); read back at TP2×EP2×ETP1 (2 ranks: the experts re-split from
    ETP2 to whole, exported by gathering over EP) and resharded to TP1×EP1 (one rank holding
    every expert) then exported: bit-exact every way."""
    src = request.getfixturevalue(f"tiny_{arch}")
    ckpt = tmp_path / "mcore-tp2-ep2"
    run_tool("convert_hf_to_megatron.py", "--hf-dir", src, "--out", ckpt, "--tp", 2, "--ep", 2)
    meta = json.loads((ckpt / "megarl_meta.json").read_text())
    assert (meta["tp"], meta["pp"], meta["ep"], meta["etp"], meta["world"]) == (2, 1, 2, 2, 4)
    run_tool("convert_megatron_to_hf.py", "--ckpt", ckpt, "--out", tmp_path / "hf-ep2",
             "--tp", 2, "--ep", 2, "--etp", 1)
    _assert_bit_exact(src, tmp_path / "hf-ep2")
    run_tool("convert_reshard.py", "--ckpt", ckpt, "--out", tmp_path / "mcore-tp1")
    meta = json.loads((tmp_path / "mcore-tp1" / "megarl_meta.json").read_text())
    assert (meta["tp"], meta["ep"], meta["etp"], meta["world"]) == (1, 1, 1, 1)
    assert meta["resharded_from_layout"] == {"tp": 2, "pp": 1, "ep": 2, "etp": 2}
    run_tool("convert_megatron_to_hf.py", "--ckpt", tmp_path / "mcore-tp1", "--out",
             tmp_path / "hf-tp1")
    _assert_bit_exact(src, tmp_path / "hf-tp1")
    # The exported directory is a loadable HF model.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(tmp_path / "hf-tp1")
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-tp1", dtype=torch.float32)
    assert m.config.tie_word_embeddings == (arch in ("qwen2", "qwen3"))


def test_pp2_vpp2_checkpoint_reads_back_at_pp1_and_pp2_vpp2(tmp_path):
    """A checkpoint written with two model chunks per stage (a 4-layer Qwen2, tied
    embeddings: stage 0 holds layers 0 and 2) records its layout and reads back bit-exact at
    PP=1 (no chunks) and at PP2 × VPP2, its HF tensors in global layer order."""
    from safetensors import safe_open

    from megarl.utils.tiny_model import make_tiny_model

    deep = make_tiny_model(tmp_path / "deep", "qwen2", num_layers=4, num_heads=4,
                           num_kv_heads=2, rope_theta=5000.0)
    ckpt = tmp_path / "mcore-pp2"
    run_tool("convert_hf_to_megatron.py", "--hf-dir", deep, "--out", ckpt, "--pp", 2,
             "--vpp", 2)
    meta = json.loads((ckpt / "megarl_meta.json").read_text())
    assert (meta["tp"], meta["pp"], meta["vpp"]) == (1, 2, 2)
    run_tool("convert_megatron_to_hf.py", "--ckpt", ckpt, "--out", tmp_path / "a")
    run_tool("convert_megatron_to_hf.py", "--ckpt", ckpt, "--out", tmp_path / "b", "--pp", 2,
             "--vpp", 2)
    _assert_bit_exact(deep, tmp_path / "a")
    _assert_bit_exact(deep, tmp_path / "b")
    (shard,) = (tmp_path / "b").glob("*.safetensors")
    with safe_open(shard, "pt") as f:
        layers = [int(k.split(".")[2]) for k in f.keys() if k.startswith("model.layers.")]
    assert layers == sorted(layers) and set(layers) == {0, 1, 2, 3}


def test_converter_rejects_missing_dirs_without_writing(tmp_path):
    out = tmp_path / "never"
    with pytest.raises(AssertionError, match="config.json"):
        run_tool("convert_hf_to_megatron.py", "--hf-dir", tmp_path / "nope", "--out", out)
    with pytest.raises(AssertionError, match="megarl_meta.json"):
        run_tool("convert_megatron_to_hf.py", "--ckpt", tmp_path / "nope", "--out", out)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".never")]


def test_one_kv_head_at_tp2_runs_and_converts(tmp_path):
    """Fewer KV heads than TP ranks: Megatron replicates the KV head, so the worker matches
    transformers at TP=2 and the converter (which accepts the layout, inputs.layout_error)
    round-trips it bit-exact through a TP=2 checkpoint read back at TP=1."""
    from launch_helpers import SCRIPTS, read_json, torchrun
    from megarl.utils.tiny_model import make_tiny_model

    src = make_tiny_model(tmp_path / "kv1", "llama", vocab_size=300, hidden_size=64,
                          num_layers=2, num_heads=4, num_kv_heads=1, intermediate_size=128)
    torchrun(SCRIPTS / "parity.py", 2, tmp_path / "parity.json", 2, 1, src)
    r = read_json(tmp_path / "parity.json")[str(src)]
    assert r["logits"] <= 1e-4 and r["logprobs@1.0"] <= 1e-5, r
    run_tool("convert_hf_to_megatron.py", "--hf-dir", src, "--out", tmp_path / "ckpt", "--tp", 2)
    run_tool("convert_megatron_to_hf.py", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf")
    _assert_bit_exact(src, tmp_path / "hf")
