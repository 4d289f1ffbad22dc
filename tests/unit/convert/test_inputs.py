"""convert/inputs.py: the shared TP×PP layout rule and the model-directory checks, seen from
the converter, the Megatron worker and the train preflight alike."""
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.backends.megatron.model import ModelArgs
from megarl.config.errors import ConfigError
from megarl.convert import inputs
from megarl.convert.cli import hf_to_megatron_main
from megarl.backends.megatron.hf.hf_io import save_hf
from megarl.convert.inputs import ConvertError, layout_error
from megarl.convert.plan import hf_shapes, plan_hf2mcore

BASE = ModelArgs(arch="qwen2", vocab_size=300, hidden_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, ffn_hidden_size=128, norm_eps=1e-6,
                 rope_theta=1e4, max_position_embeddings=1024, tie_word_embeddings=True,
                 qkv_bias=True)


@pytest.mark.parametrize("change,tp,pp,needle", [
    ({}, 1, 1, None),
    ({}, 2, 2, None),
    ({}, 4, 1, None),  # 2 KV heads over 4 ranks: each KV head replicated on 2
    ({"num_kv_heads": 1}, 2, 1, None),
    ({"num_kv_heads": 1}, 4, 1, None),
    ({}, 0, 1, "TP=0 PP=1 EP=1 ETP=0: each must be at least 1"),
    ({}, 1, -1, "TP=1 PP=-1 EP=1 ETP=1: each must be at least 1"),
    ({}, 3, 1, "num_attention_heads=4 is not divisible by TP=3"),
    ({"num_heads": 6, "num_kv_heads": 3, "head_dim": 8}, 2, 1,
     "num_key_value_heads=3 is neither a multiple nor a divisor of TP=2"),
    ({"num_kv_heads": 1, "head_dim": 3}, 4, 1,
     "= 18 rows) is not divisible by TP=4"),
    ({"ffn_hidden_size": 130}, 4, 1, "intermediate_size=130 is not divisible by TP=4"),
    ({"num_layers": 3}, 1, 2, ("num_hidden_layers=3 is not divisible by PP=2 (every pipeline "
                               "stage holds the same number of layers; uneven stages are not "
                               "supported)")),
])
def test_layout_rules(change, tp, pp, needle):
    problem = layout_error(dataclasses.replace(BASE, **change), tp, pp)
    if needle is None:
        assert problem is None
    else:
        assert problem is not None and needle in problem


MOE = dataclasses.replace(BASE, arch="qwen3_moe", num_experts=8, moe_topk=2,
                          moe_ffn_hidden_size=32, qkv_bias=False)


@pytest.mark.parametrize("args,ep,etp,needle", [
    (MOE, 2, None, None),
    (MOE, 8, 1, None),
    (MOE, 3, None, "num_experts=8 is not divisible by EP=3"),
    (MOE, 2, 3, "moe_intermediate_size=32 is not divisible by ETP=3"),
    (BASE, 2, None, "EP=2 ETP=2: expert parallelism needs a mixture-of-experts model"),
])
def test_expert_layout_rules(args, ep, etp, needle):
    """The shared rule the worker and preflight apply (the converter checks its flags first,
    in its own words: test_plan.test_bad_expert_layout_fails_naming_the_flag)."""
    problem = layout_error(args, 2, 1, ep, etp)
    assert problem is None if needle is None else needle in problem


def _fake_model(src, dst, **config):
    """An HF directory with `src`'s config.json changed by `config` and zero weights of the
    shapes that config implies (fast: no tokenizer training)."""
    dst.mkdir(parents=True)
    cfg = {**json.loads((src / "config.json").read_text()), **config}
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    a = ModelArgs.from_hf(cfg)
    save_file({k: torch.zeros(s) for k, s in hf_shapes(a).items()}, dst / "model.safetensors")
    return dst


def test_one_kv_head_plans_at_tp2(tiny_qwen2, tmp_path):
    """What the worker runs (Megatron replicates the KV head), the converter accepts."""
    src = _fake_model(tiny_qwen2, tmp_path / "kv1", num_key_value_heads=1)
    p = plan_hf2mcore(src, tmp_path / "out", tp=2)
    assert (p.tp, p.hf_tensors) == (2, 26) and not (tmp_path / "out").exists()


def _preflight_cfg(model_dir, **megatron):
    from megarl.config.schema import MegaRLConfig

    cfg = OmegaConf.structured(MegaRLConfig)
    cfg.actor_rollout_ref.model.path = str(model_dir)
    for k, v in megatron.items():
        cfg.actor_rollout_ref.actor.megatron[k] = v
    return cfg


def _preflight_error(cfg) -> str:
    from megarl.config.preflight import _check_model

    with pytest.raises(ConfigError) as e:
        _check_model(cfg)
    return str(e.value)


def test_uneven_layers_refused_with_one_message_everywhere(tiny_qwen2, tmp_path, capsys):
    src = _fake_model(tiny_qwen2, tmp_path / "three", num_hidden_layers=3)
    cfg_path = src / "config.json"
    msg = ("num_hidden_layers=3 is not divisible by PP=2 (every pipeline stage holds the same "
           "number of layers; uneven stages are not supported)")
    # the converter
    assert hf_to_megatron_main(["--hf-dir", str(src), "--out", str(tmp_path / "o"),
                                "--pp", "2"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {cfg_path}: {msg}"
    # the Megatron worker: refused before it joins any process group
    from megarl.backends.megatron.worker import MegatronWorker

    with pytest.raises(ConvertError) as e:
        MegatronWorker(str(src), 1, 2, trainable=False, load_hf=False)
    assert str(e.value) == f"{cfg_path}: {msg}"
    assert not dist.is_initialized()
    # the train preflight, naming the key
    err = _preflight_error(_preflight_cfg(src, pipeline_model_parallel_size=2))
    assert err == (f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size: "
                   f"{cfg_path}: {msg}")


def test_preflight_checks_the_model_directory(tiny_qwen2, tmp_path):
    key = "actor_rollout_ref.model.path"
    ok = _preflight_cfg(tiny_qwen2)
    from megarl.config.preflight import _check_model

    _check_model(ok)  # the real tiny model passes
    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen2, bad)
    (bad / "config.json").write_text('{"hidden_size": ')
    assert _preflight_error(_preflight_cfg(bad)).startswith(
        f"{key}: {bad / 'config.json'}: not valid JSON")
    shutil.copy(tiny_qwen2 / "config.json", bad / "config.json")
    (bad / "model.safetensors").unlink()
    assert _preflight_error(_preflight_cfg(bad)) == (
        f"{key}: {bad}: no model.safetensors or model.safetensors.index.json (no weights)")
    err = _preflight_error(_preflight_cfg(tiny_qwen2, tensor_model_parallel_size=3))
    assert err == (f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size: "
                   f"{tiny_qwen2 / 'config.json'}: num_attention_heads=4 is not divisible by "
                   f"TP=3")
    # The quickstart's model is made by the run itself: nothing to read yet, nothing refused.
    later = _preflight_cfg(tmp_path / "made-later" / "tiny")
    later.actor_rollout_ref.model.make_tiny = "qwen2"
    _check_model(later)
    assert not (tmp_path / "made-later" / "tiny").exists()


def test_headers_of_sharded_bf16_files_read_like_the_library(tmp_path):
    """No false alarms: a sharded, bf16 model written by save_hf passes, with the library's
    own view of names, dtypes and shapes."""
    tensors = [(f"t{i}", torch.randn(3 + i, 5).to(torch.bfloat16)) for i in range(6)]
    tensors.append(("empty", torch.zeros(0, 4)))
    out = save_hf(tmp_path / "m", iter(tensors), shard_bytes=64)
    weights = inputs.hf_weights(out)
    assert len({p for p, _, _ in weights.values()}) > 1  # really sharded
    for name, (path, dtype, shape) in weights.items():
        with safe_open(path, "pt") as f:
            sl = f.get_slice(name)
            assert (sl.get_dtype(), tuple(sl.get_shape())) == (dtype, shape)


def test_out_dir_probe_leaves_nothing(tmp_path):
    inputs.check_out_dir(tmp_path / "a" / "b" / "out")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConvertError, match=r"cannot be created \(.*file is not a directory\)"):
        inputs.check_out_dir(tmp_path / "file" / "out")


GLM = json.loads((Path(__file__).resolve().parents[3] / "configs" / "models" /
                  "glm45_355b.json").read_text())


@pytest.mark.parametrize("change,needle", [
    ({}, None),
    # DeepSeek-V3's grouping: 8 groups, 4 chosen, top-8: Megatron's top-2 per group agrees
    ({"n_group": 8, "topk_group": 4}, None),
    ({"n_group": 8, "topk_group": 2}, "n_group=8 topk_group=2: Megatron scores a group by its "
                                      "top num_experts_per_tok / topk_group experts"),
    ({"n_group": 3}, "n_group must divide n_routed_experts=160"),
    ({"norm_topk_prob": False}, "norm_topk_prob=false: Megatron's sigmoid router always "
                                "renormalises"),
    ({"first_k_dense_replace": 92}, "first_k_dense_replace=92: must be an integer in"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor=0 must be a positive finite number"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5: must be in (0, 1]"),
    ({"n_routed_experts": None}, "n_routed_experts=None: a GLM-4.5 MoE needs a positive "
                                 "integer"),
])
def test_glm45_config_json_refused_by_key_where_megatron_routes_otherwise(change, needle):
    """GLM-4.5's config.json read into the generic MoE fields; what Megatron's router does not
    compute as transformers does is refused naming the key, before any work."""
    from megarl.backends.megatron.hf.model_config import model_args

    cfg = {k: v for k, v in {**GLM, **change}.items() if v is not None}
    if needle is None:
        a = model_args(cfg, "config.json")
        assert a.arch == "glm4_moe" and a.moe_expert_bias and a.first_k_dense == 3
        assert layout_error(a, 8, 4, 16, 1) is None
        return
    with pytest.raises(ConvertError, match="config.json: ") as err:
        model_args(cfg, "config.json")
    assert needle in str(err.value)


def test_glm45_transformer_config_keeps_the_correction_bias_fixed():
    """Megatron's sigmoid router with its expert bias at update rate 0 (the RL run never moves
    it), first-k dense layers as moe_layer_freq, the shared expert's width, scaling."""
    from megarl.backends.megatron.model import MoESettings, transformer_config

    a = ModelArgs.from_hf(GLM)
    c = transformer_config(a, 8, 4, "bfloat16", MoESettings(ep=16, etp=1),
                           sequence_parallel=True)
    assert (c.moe_router_score_function, c.moe_router_enable_expert_bias,
            c.moe_router_bias_update_rate, c.moe_router_topk_scaling_factor,
            c.moe_shared_expert_intermediate_size, c.moe_router_num_groups) == (
        "sigmoid", True, 0.0, 2.5, 1536, None)
    assert c.moe_layer_freq == [0, 0, 0] + [1] * 89


DSV3 = json.loads((Path(__file__).resolve().parents[3] / "configs" / "models" /
                   "deepseek_v3_671b.json").read_text())
# Kimi-K2-Instruct's released config.json (its model_type is its own, the architecture
# DeepSeek-V3's), less auto_map and the FP8 quantization_config (refused: bf16 weights only)
KIMI_K2 = json.loads((Path(__file__).resolve().parents[3] / "configs" / "models" /
                      "kimi_k2_1t.json").read_text())


@pytest.mark.parametrize("change,needle", [
    ({}, None),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config (quant_method 'fp8'): quantised checkpoints are not read"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax': supported is DeepSeek-V3's"),
    ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
    ({"attention_bias": True}, "attention_bias=true: DeepSeek-V3's multi-latent attention"),
    ({"rope_interleave": False}, "rope_interleave=False: Megatron's MLA applies RoPE to "
                                 "interleaved channels only"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "multi-latent attention supports "
                                                          "plain RoPE and rope_type yarn"),
    # transformers then scales cos/sin by mscale(40) (its default when either is 0),
    # Megatron by 1 / mscale(40, 1)
    ({"rope_scaling": {**DSV3["rope_scaling"], "mscale": 0}},
     "transformers scales cos/sin by 1.36889, Megatron's YaRN by 0.73052"),
    ({"rope_scaling": {**DSV3["rope_scaling"], "truncate": False}}, "rope_scaling.truncate"),
    ({"n_group": 8, "topk_group": 2}, "n_group=8 topk_group=2: Megatron scores a group"),
    ({"kv_lora_rank": None}, "kv_lora_rank=None: multi-latent attention needs a positive"),
])
def test_deepseek_v3_config_json_refused_by_key(change, needle):
    """DeepSeek-V3's config.json read into the MLA and MoE fields; what Megatron does not
    compute as transformers does is refused naming the key, before any work."""
    from megarl.backends.megatron.hf.model_config import model_args

    cfg = {k: v for k, v in {**DSV3, **change}.items() if v is not None}
    if needle is None:
        a = model_args(cfg, "config.json")
        assert (a.arch, a.is_mla, a.q_lora_rank, a.kv_lora_rank, a.head_dim, a.v_head_dim,
                a.first_k_dense, a.moe_num_groups, a.moe_group_topk, a.mtp_layers) == (
            "deepseek_v3", True, 1536, 512, 192, 128, 3, 8, 4, 1)
        assert a.yarn == (40.0, 4096, 32.0, 1.0, 1.0, 1.0)
        return
    with pytest.raises(ConvertError, match="config.json: ") as err:
        model_args(cfg, "config.json")
    assert needle in str(err.value)


@pytest.mark.parametrize("tp,problem", [
    (8, None), (16, None),
    (3, "num_attention_heads=128 is not divisible by TP=3"),
    (256, "num_attention_heads=128 is not divisible by TP=256"),
])
def test_deepseek_v3_tp_rules_name_the_mla_sizes(tp, problem):
    a = ModelArgs.from_hf(DSV3)
    assert layout_error(a, tp, 1, 8, 1) == problem
    small = dataclasses.replace(a, num_heads=8, q_lora_rank=12)
    assert layout_error(small, 8, 1) == "q_lora_rank=12 is not divisible by TP=8"
    small = dataclasses.replace(a, num_heads=8, qk_rope_head_dim=60)
    assert layout_error(small, 8, 1) == ("kv_lora_rank + qk_rope_head_dim = 512 + 60 is not "
                                         "divisible by TP=8")


def test_deepseek_v3_transformer_config_is_megatrons_mla_with_yarn():
    """MLATransformerConfig: the latent ranks and head dims, YaRN's settings, one query group
    per head, the latent norms (qk_layernorm); the router as GLM-4.5's with groups."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megarl.backends.megatron.model import MoESettings, transformer_config

    c = transformer_config(ModelArgs.from_hf(DSV3), 8, 1, "bfloat16", MoESettings(ep=64, etp=1),
                           sequence_parallel=True)
    assert isinstance(c, MLATransformerConfig)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim,
            c.num_query_groups, c.qk_layernorm, c.rope_type, c.rotary_scaling_factor,
            c.original_max_position_embeddings, c.mscale, c.mscale_all_dim) == (
        1536, 512, 128, 64, 128, 128, True, "yarn", 40.0, 4096, 1.0, 1.0)
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor,
            c.moe_router_enable_expert_bias, c.moe_router_bias_update_rate) == (8, 4, 2.5, True,
                                                                                0.0)
    assert c.moe_layer_freq == [0, 0, 0] + [1] * 58


def test_kimi_k2_config_json_reads_as_deepseek_v3(tmp_path):
    """Kimi-K2's model_type (kimi_k2) is not transformers': megarl reads its config.json as
    DeepSeek-V3's, for Megatron and for the embedded engine, without remote code."""
    from megarl.backends.megatron.hf.model_config import model_args
    from megarl.rollout.engine import hf_config

    a = model_args(KIMI_K2, "config.json")
    assert (a.arch, a.num_experts, a.moe_num_groups, a.first_k_dense, a.num_heads) == (
        "deepseek_v3", 384, 0, 1, 64)
    assert layout_error(a, 8, 1, 64, 1) is None
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K2))
    cfg = hf_config(str(tmp_path))
    assert (cfg.model_type, cfg.n_routed_experts, cfg.num_attention_heads) == (
        "deepseek_v3", 384, 64)
