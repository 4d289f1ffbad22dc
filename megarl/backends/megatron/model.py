"""Megatron-core GPTModel from a Hugging Face `config.json` (Llama, Qwen2, Qwen3, Qwen3-MoE,
GLM-4.5, DeepSeek-V3 / Kimi-K2).

Owns the mapping from HF hyper-parameters to Megatron's `TransformerConfig` and the layer
spec: Megatron's local layers with `SDPAttention` as core attention (attention.py) where
Transformer Engine is absent, TE's layers with TE's attention where it is used; the HF maps
read both layouts.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SUPPORTED_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                   "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                   "Glm4MoeForCausalLM": "glm4_moe",
                   # Kimi-K2 ships the same architecture name (its model_type kimi_k2)
                   "DeepseekV3ForCausalLM": "deepseek_v3",
                   # a critic in HF form (verl's too): the transformer + `score` (hidden -> 1)
                   "LlamaForTokenClassification": "llama",
                   "Qwen2ForTokenClassification": "qwen2",
                   "Qwen3ForTokenClassification": "qwen3",
                   "Qwen3MoeForTokenClassification": "qwen3_moe"}
CRITIC_ARCHS = {"llama": "LlamaForTokenClassification", "qwen2": "Qwen2ForTokenClassification",
                "qwen3": "Qwen3ForTokenClassification",
                "qwen3_moe": "Qwen3MoeForTokenClassification"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class MoESettings:
    """How a mixture-of-experts model is laid out and routed (the config's
    `megatron.expert_*` and `megatron.override_transformer_config.moe_*` keys); nothing here
    applies to a dense model."""
    ep: int = 1
    """Expert-parallel ranks: each holds num_experts / ep of every layer's experts."""
    etp: int | None = None
    """Ranks each expert is split over (None: the TP ranks, Megatron's default)."""
    aux_loss_coeff: float = 0.0
    """Load-balancing loss coefficient; 0: none (it is not the RL objective's)."""
    z_loss_coeff: float | None = None
    """Router z-loss coefficient; None: none."""
    token_dispatcher: str | None = None
    """allgather | alltoall; None: alltoall on GPUs, allgather on the CPU."""
    capacity_factor: float | None = None
    """Expert capacity (tokens beyond it dropped, by `token_drop_policy`); None: nothing
    dropped, what RL wants."""
    token_drop_policy: str = "probs"
    routing_replay: bool = False
    """The routers take their top-k experts from the batch's `routed_experts` when it has
    them (R3: the rollout engine's choices) instead of computing them."""


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """The architecture facts both sides of a conversion agree on."""
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False
    """Qwen3: an RMSNorm over each head's query and key (one weight of head_dim each,
    shared by the heads), after the projection and before RoPE."""
    rope_scaling_factor: float | None = None
    """Llama 3.x (``rope_type: llama3``): low RoPE frequencies divided by this factor, the
    middle band interpolated; None: plain RoPE."""
    num_experts: int = 0
    """Qwen3-MoE: routed experts per layer (every layer's MLP is a mixture); 0: dense."""
    moe_topk: int = 0
    """Experts each token is routed to (``num_experts_per_tok``)."""
    moe_ffn_hidden_size: int = 0
    """One expert's SwiGLU width (``moe_intermediate_size``)."""
    norm_topk_prob: bool = False
    """The top-k routing probabilities renormalised to sum to 1 (softmax over the chosen
    experts' logits); else the full softmax's values are used as they are."""
    # The fields below are generic MoE / attention facts (GLM-4.5 sets them today; the
    # DeepSeek-V3 family sets the same ones), each mapped to one Megatron setting.
    rotary_percent: float = 1.0
    """Share of each head's channels RoPE rotates (``partial_rotary_factor``; GLM-4.5: 0.5,
    the first half, rotate-half style, as Megatron's ``rotary_percent``)."""
    moe_score_function: str = "softmax"
    """softmax | sigmoid (GLM-4.5, DeepSeek-V3: sigmoid scores, top-k renormalised)."""
    moe_expert_bias: bool = False
    """A per-expert bias added to the scores for choosing experts only
    (``e_score_correction_bias``; Megatron's ``expert_bias``, fp32, never updated in RL)."""
    moe_num_groups: int = 0
    """Expert groups for group-limited routing (``n_group``); 0: none."""
    moe_group_topk: int = 0
    """Groups each token may route into (``topk_group``)."""
    moe_scaling_factor: float = 1.0
    """Routing weights multiplied by this after top-k (``routed_scaling_factor``)."""
    moe_shared_ffn_hidden_size: int = 0
    """Width of the always-on shared expert(s) of each MoE layer (``moe_intermediate_size ×
    n_shared_experts``); 0: none."""
    first_k_dense: int = 0
    """The first this many layers have a dense MLP (``first_k_dense_replace``, of width
    ``intermediate_size``); the rest are mixtures."""
    # Multi-latent attention (DeepSeek-V3, Kimi-K2): Megatron's MLASelfAttention. With
    # `kv_lora_rank` 0 the model has ordinary attention and none of these apply.
    q_lora_rank: int = 0
    """Width of the query's low-rank latent (``q_lora_rank``); 0: one direct q_proj."""
    kv_lora_rank: int = 0
    """Width of the shared key/value latent (``kv_lora_rank``); > 0 means MLA."""
    qk_nope_head_dim: int = 0
    """Per-head query/key channels without RoPE (``qk_nope_head_dim``)."""
    qk_rope_head_dim: int = 0
    """Per-head query/key channels with RoPE, the key's shared by all heads."""
    v_head_dim: int = 0
    """Per-head value channels (``v_head_dim``)."""
    yarn: tuple = ()
    """YaRN RoPE as (factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
    mscale_all_dim); (): plain RoPE. Read for MLA models only."""
    mtp_layers: int = 0
    """Multi-token-prediction layers the checkpoint holds (``num_nextn_predict_layers``):
    never built, loaded or synced (RL does not train them)."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelArgs":
        archs = hf.get("architectures") or []
        known = [SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS]
        if not known:
            raise ValueError(f"config.json architectures={archs}: supported are "
                             f"{sorted(SUPPORTED_ARCHS)}")
        arch = known[0]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        scaling = _llama3_factor(rope) if kind == "llama3" else None
        mla = mla_fields(hf, rope, kind) if arch == "deepseek_v3" else {}
        if kind == "yarn" and mla:
            kind = "default"  # read by mla_fields
        if kind not in ("default", None, "llama3"):
            raise ValueError(f"config.json rope_scaling={rope}: supported are plain RoPE and "
                             f"rope_type llama3")
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        if hf.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window=true: not supported")
        moe = _moe_fields(hf) if arch == "qwen3_moe" else \
            _glm4_moe_fields(hf) if arch == "glm4_moe" else \
            _glm4_moe_fields(hf, "a DeepSeek-V3 MoE") if arch == "deepseek_v3" else {}
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if isinstance(partial, bool) or not isinstance(partial, (int, float)) or \
                not 0 < partial <= 1:
            raise ValueError(f"config.json partial_rotary_factor={partial!r}: must be in (0, 1]")
        return cls(
            arch=arch, vocab_size=hf["vocab_size"], hidden_size=hidden,
            num_layers=hf["num_hidden_layers"], num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=mla.pop("head_dim", None) or hf.get("head_dim") or hidden // heads,
            ffn_hidden_size=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has QKV bias; Llama and Qwen3 have it only with attention_bias.
            qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe") or (
                arch == "glm4_moe" and bool(hf.get("use_qk_norm", False))),
            rope_scaling_factor=scaling, rotary_percent=float(partial),
            **moe, **mla,
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0


def _positive_ints(values: dict[str, Any], what: str) -> None:
    """Refuse, naming the config.json key, any of `values` that is not a positive integer."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.json {key}={value!r}: {what} needs a positive integer")


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's routing facts. Layouts with dense layers among the MoE ones
    (decoder_sparse_step > 1, mlp_only_layers) are refused: no released Qwen3-MoE has them."""
    # the released configs say num_experts; transformers 5 writes num_local_experts
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    topk = hf.get("num_experts_per_tok")
    _positive_ints({"num_experts": experts, "num_experts_per_tok": topk,
                    "moe_intermediate_size": hf.get("moe_intermediate_size")}, "a Qwen3-MoE")
    if topk > experts:
        raise ValueError(f"config.json num_experts_per_tok={topk} exceeds num_experts="
                         f"{experts}")
    if hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"config.json decoder_sparse_step={hf['decoder_sparse_step']!r}: "
                         f"only 1 (every layer a mixture of experts) is supported")
    if hf.get("mlp_only_layers"):
        raise ValueError(f"config.json mlp_only_layers={hf['mlp_only_layers']!r}: dense "
                         f"layers among the MoE ones are not supported")
    return dict(num_experts=experts, moe_topk=topk,
                moe_ffn_hidden_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def _glm4_moe_fields(hf: dict[str, Any], what: str = "a GLM-4.5 MoE") -> dict[str, Any]:
    """GLM-4.5's routing: sigmoid scores plus a correction bias choose the experts,
    group-limited, the chosen scores renormalised and scaled; shared experts; the first
    `first_k_dense_replace` layers dense. Refused by key what Megatron's router does not
    compute the same way: it always renormalises sigmoid top-k, and scores a group by its
    top-(topk / topk_group) experts where transformers takes the top 2, which agree only
    when there is one group or that quotient is 2."""
    experts, topk = hf.get("n_routed_experts"), hf.get("num_experts_per_tok")
    _positive_ints({k: hf.get(k) for k in ("n_routed_experts", "num_experts_per_tok",
                                           "moe_intermediate_size")}, what)
    if topk > experts:
        raise ValueError(f"config.json num_experts_per_tok={topk} exceeds n_routed_experts="
                         f"{experts}")
    if not hf.get("norm_topk_prob", True):
        raise ValueError("config.json norm_topk_prob=false: Megatron's sigmoid router always "
                         "renormalises the top-k scores")
    groups, group_topk = hf.get("n_group", 1) or 1, hf.get("topk_group", 1) or 1
    if experts % groups or group_topk > groups:
        raise ValueError(f"config.json n_group={groups} topk_group={group_topk}: n_group must "
                         f"divide n_routed_experts={experts} and be at least topk_group")
    if groups > 1 and (topk % group_topk or topk // group_topk != 2):
        raise ValueError(f"config.json n_group={groups} topk_group={group_topk}: Megatron "
                         f"scores a group by its top num_experts_per_tok / topk_group experts, "
                         f"transformers by its top 2; supported are n_group 1 or "
                         f"num_experts_per_tok / topk_group = 2")
    dense = hf.get("first_k_dense_replace", 0) or 0
    if not isinstance(dense, int) or isinstance(dense, bool) or \
            not 0 <= dense < hf["num_hidden_layers"]:
        raise ValueError(f"config.json first_k_dense_replace={dense!r}: must be an integer in "
                         f"[0, num_hidden_layers)")
    shared = hf.get("n_shared_experts", 0) or 0
    scale = hf.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"config.json routed_scaling_factor={scale!r}: must be positive")
    return dict(num_experts=experts, moe_topk=topk,
                moe_ffn_hidden_size=hf["moe_intermediate_size"], norm_topk_prob=True,
                moe_score_function="sigmoid", moe_expert_bias=True,
                moe_num_groups=groups if groups > 1 else 0,
                moe_group_topk=group_topk if groups > 1 else 0,
                moe_scaling_factor=float(scale),
                moe_shared_ffn_hidden_size=hf["moe_intermediate_size"] * shared,
                first_k_dense=dense)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_fields(hf: dict[str, Any], rope: dict[str, Any], kind: str | None) -> dict[str, Any]:
    """DeepSeek-V3's (and Kimi-K2's) multi-latent attention and RoPE, as Megatron's
    MLATransformerConfig computes them. Refused by key: attention biases, non-interleaved
    RoPE (Megatron's MLA always de-interleaves the rotary channels, transformers' does so
    only with rope_interleave), RoPE types other than plain and YaRN, YaRN settings whose
    cos/sin scale transformers infers differently from Megatron (its `mscale` ratio), and
    FP8 checkpoints (block-quantised weights with scales that the maps do not read)."""
    if hf.get("quantization_config") is not None:
        method = hf["quantization_config"].get("quant_method", "?") \
            if isinstance(hf["quantization_config"], dict) else "?"
        raise ValueError(f"config.json quantization_config (quant_method {method!r}): "
                         f"quantised checkpoints are not read; convert the weights to bf16 "
                         f"first (DeepSeek's fp8_cast_bf16.py) and drop the key")
    # DeepSeek-V2's softmax routers (scoring_func softmax, topk_method greedy /
    # group_limited_greedy) are not this one; absent keys mean V3's
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, want) != want:
            raise ValueError(f"config.json {key}={hf[key]!r}: supported is DeepSeek-V3's "
                             f"{want!r} router")
    if hf.get("attention_bias"):
        raise ValueError("config.json attention_bias=true: DeepSeek-V3's multi-latent "
                         "attention has no biases in Megatron's MLA")
    if hf.get("rope_interleave", True) is not True:
        raise ValueError(f"config.json rope_interleave={hf['rope_interleave']!r}: Megatron's "
                         f"MLA applies RoPE to interleaved channels only")
    q_lora = hf.get("q_lora_rank") or 0
    keys = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    _positive_ints({k: hf.get(k) for k in keys}, "multi-latent attention")
    if q_lora:
        _positive_ints({"q_lora_rank": q_lora}, "multi-latent attention")
    yarn: tuple = ()
    if kind == "yarn":
        factor = rope.get("factor")
        orig = rope.get("original_max_position_embeddings")
        _positive_ints({"rope_scaling.original_max_position_embeddings": orig}, "YaRN")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"config.json rope_scaling.factor={factor!r}: YaRN needs a "
                             f"positive number")
        if rope.get("truncate", True) is not True:
            raise ValueError("config.json rope_scaling.truncate=false: Megatron's YaRN rounds "
                             "its correction range (truncate true) only")
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        # transformers' cos/sin factor (attention_factor) against Megatron's, which is
        # mscale(factor, mscale) / mscale(factor, mscale_all_dim) with defaults 1 and 0
        ours = _yarn_mscale(factor, 1.0 if mscale is None else mscale) / \
            _yarn_mscale(factor, all_dim or 0.0)
        theirs = rope.get("attention_factor")
        if theirs is None:
            theirs = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim) \
                if mscale and all_dim else _yarn_mscale(factor, 1.0)
        if not math.isclose(ours, theirs, rel_tol=1e-12):
            raise ValueError(f"config.json rope_scaling mscale={mscale!r} mscale_all_dim="
                             f"{all_dim!r} attention_factor={rope.get('attention_factor')!r}: "
                             f"transformers scales cos/sin by {theirs:.6g}, Megatron's YaRN "
                             f"by {ours:.6g}")
        yarn = (float(factor), int(orig), float(rope.get("beta_fast") or 32),
                float(rope.get("beta_slow") or 1), float(1.0 if mscale is None else mscale),
                float(all_dim or 0.0))
    elif kind not in ("default", None):
        raise ValueError(f"config.json rope_scaling={rope}: multi-latent attention supports "
                         f"plain RoPE and rope_type yarn")
    mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0
    return dict(q_lora_rank=q_lora, kv_lora_rank=hf["kv_lora_rank"],
                qk_nope_head_dim=hf["qk_nope_head_dim"],
                qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], yarn=yarn,
                mtp_layers=int(mtp))


# Megatron-core's llama3 RoPE takes the factor; these three it holds at Llama 3.1/3.2/3.3's
# values (RotaryEmbedding._apply_scaling), so a config.json with others is refused.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


def _llama3_factor(rope: dict) -> float:
    factor = rope.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"config.json rope_scaling.factor={factor!r}: llama3 RoPE needs a "
                         f"positive number")
    for key, want in _LLAMA3_FIXED.items():
        got = rope.get(key, want)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or got != want:
            raise ValueError(f"config.json rope_scaling.{key}={got!r}: Megatron-core's llama3 "
                             f"RoPE supports {want:g} only")
    return float(factor)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary so every TP rank holds an equal, aligned slice."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


# `enable_gradient_checkpointing`: every layer's activations dropped after forward and
# recomputed in backward from its input; what stays is one [s, b, h] input per layer
# (controller/memory.py counts that)
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform",
                  "recompute_num_layers": 1}


# Megatron's fusions a config may turn on (`override_transformer_config`); both are
# `torch.compile`d functions in megatron-core 0.16 (megatron/core/fusions/), needing neither
# Apex nor TE, and compute what the unfused path does.
FUSION_KEYS = ("bias_activation_fusion", "bias_dropout_fusion")


def recompute_settings(overrides, gradient_checkpointing: bool) -> dict | None:
    """Megatron's recompute settings of a model that trains, from its section's
    `override_transformer_config` (verl's keys, Megatron's names) or, where those leave it
    null, the model's `enable_gradient_checkpointing` (FULL_RECOMPUTE); None: no recompute."""
    granularity = overrides.recompute_granularity
    if granularity == "selective":
        return {"recompute_granularity": "selective"}
    if granularity == "full":
        return {"recompute_granularity": "full",
                "recompute_method": overrides.recompute_method or "uniform",
                "recompute_num_layers": overrides.recompute_num_layers or 1}
    return dict(FULL_RECOMPUTE) if gradient_checkpointing else None


VPP_KEY = "megatron.virtual_pipeline_model_parallel_size"


def vpp_error(num_layers: int, pp: int, vpp: int | None, cp: int = 1) -> str | None:
    """Why a virtual pipeline of `vpp` model chunks per stage cannot be laid out over `pp`
    stages of a `num_layers`-layer model (None: it can; vpp None or 1: no virtual pipeline).
    The caller names the key."""
    if vpp is None or vpp == 1:
        return None
    if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1:
        return f"{vpp!r} is not a positive integer or null"
    if cp > 1:
        # the interleaved schedule's filler micro-batches are not cut into CP chunks, and the
        # two have not run together: refused rather than trusted untested
        return (f"a virtual pipeline with context_parallel_size={cp} is not supported yet "
                f"(use one of them)")
    if pp < 2:
        return (f"{vpp} model chunks per stage need pipeline_model_parallel_size >= 2 (it "
                f"is {pp}): the chunks interleave across pipeline stages")
    if num_layers % (pp * vpp):
        return (f"num_hidden_layers={num_layers} is not divisible by PP x VPP = "
                f"{pp} x {vpp}")
    return None


def transformer_config(args: ModelArgs, tp: int, pp: int, params_dtype: str = "float32",
                       moe: MoESettings | None = None, recompute: dict | bool | None = None,
                       sequence_parallel: bool = False, context_parallel: int = 1,
                       vpp: int | None = None, **overrides):
    """Megatron's TransformerConfig of `args`. `recompute`: Megatron's recompute settings
    (`recompute_settings`; True: FULL_RECOMPUTE), None or False for none.
    `sequence_parallel`: Megatron's sequence parallelism (norms and the residual stream
    sharded over the sequence across TP ranks); it only exists with TP > 1 (Megatron refuses
    it at TP=1), so at TP=1 it is ignored, as verl and Megatron-LM do. `context_parallel`:
    Megatron's context-parallel size (context_parallel.py)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = DTYPES[params_dtype]
    on_gpu = torch.cuda.is_available()
    kw = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_heads, num_query_groups=args.num_kv_heads,
        kv_channels=args.head_dim, ffn_hidden_size=args.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=args.norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=args.qkv_bias, qk_layernorm=args.qk_norm, hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        context_parallel_size=int(context_parallel),
        # Megatron's interleaved schedule: `vpp` model chunks per stage (None: one)
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        # Under a virtual pipeline a stage sends activations and grads to the same peer in one
        # exchange (at PP=2 the next stage is also the previous); batched, gloo matches the
        # two same-shaped messages by order and the peers post them in different orders, so
        # activations and grads swap silently. Unbatched, Megatron sends the two directions
        # on two process groups at PP=2 (and orders them by rank parity otherwise).
        batch_p2p_comm=not (vpp and vpp > 1),
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, use_cpu_initialization=not on_gpu,
        # Off unless asked for (FUSION_KEYS, via `overrides`): SwiGLU and bias-dropout-add are
        # torch.compile'd and run anywhere, but compile for seconds and are not yet measured on
        # a GPU. The others need Apex or TE kernels (softmax: megarl's attention is SDPA).
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        # Every micro-batch of a call is padded to the same length, so pipeline stages can
        # exchange fixed-shape tensors.
        variable_seq_lengths=False, sequence_parallel=bool(sequence_parallel) and tp > 1,
    )
    if args.is_moe:
        moe = moe or MoESettings()
        kw.update(
            num_moe_experts=args.num_experts, moe_router_topk=args.moe_topk,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            expert_model_parallel_size=moe.ep,
            expert_tensor_parallel_size=tp if moe.etp is None else moe.etp,
            # Qwen3-MoE: softmax over all experts, top-k, renormalised (norm_topk_prob), which
            # is a softmax over the top-k logits, Megatron's order without pre-softmax
            moe_router_score_function=args.moe_score_function,
            moe_router_pre_softmax=args.moe_score_function == "softmax" and not
            args.norm_topk_prob,
            moe_router_dtype="fp32",
            # sigmoid routers (GLM-4.5, DeepSeek-V3): the correction bias chooses experts and
            # is a checkpoint value in RL, never updated by Megatron's load balancer (rate 0)
            moe_router_enable_expert_bias=args.moe_expert_bias,
            moe_router_bias_update_rate=0.0,
            moe_router_num_groups=args.moe_num_groups or None,
            moe_router_group_topk=args.moe_group_topk or None,
            moe_router_topk_scaling_factor=(args.moe_scaling_factor
                                            if args.moe_scaling_factor != 1.0 else None),
            moe_shared_expert_intermediate_size=args.moe_shared_ffn_hidden_size or None,
            moe_layer_freq=[0] * args.first_k_dense + [1] * (
                args.num_layers - args.first_k_dense),
            # By default RL wants every token through its experts (no capacity, nothing
            # dropped) and no loss but its own (no load balancing); both are config keys.
            moe_expert_capacity_factor=moe.capacity_factor,
            moe_token_drop_policy=moe.token_drop_policy,
            moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff else "none",
            moe_aux_loss_coeff=moe.aux_loss_coeff, moe_z_loss_coeff=moe.z_loss_coeff or None,
            # alltoall (what GPUs run) opens a CUDA stream when built; allgather is the CPU's:
            # with nothing dropped both send each token to the same experts
            moe_token_dispatcher_type=moe.token_dispatcher or (
                "alltoall" if on_gpu else "allgather"),
            moe_enable_routing_replay=moe.routing_replay,
            moe_grouped_gemm=False)
    if recompute:
        kw.update(FULL_RECOMPUTE if recompute is True else recompute)
    if args.is_mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        kw.update(mla_config(args))
        kw.update(overrides)
        return MLATransformerConfig(**kw)
    kw.update(overrides)
    return TransformerConfig(**kw)


def mla_config(args: ModelArgs) -> dict:
    """MLATransformerConfig's fields of a multi-latent-attention model. Every head has its
    own key (the shared RoPE key is expanded per head), so there are as many query groups
    as heads; `qk_layernorm` is MLA's q_a / kv_a latent norms."""
    kw = dict(multi_latent_attention=True, q_lora_rank=args.q_lora_rank or None,
              kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_nope_head_dim,
              qk_pos_emb_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
              num_query_groups=args.num_heads, kv_channels=args.head_dim, qk_layernorm=True,
              rotary_base=args.rope_theta, rope_type="yarn" if args.yarn else "rope",
              # Megatron's MLA softmax scale is mscale(rotary_scaling_factor,
              # mscale_all_dim)² / sqrt(q head dim): factor 1 gives plain RoPE's
              rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if args.yarn:
        factor, orig, fast, slow, mscale, all_dim = args.yarn
        kw.update(rotary_scaling_factor=factor, original_max_position_embeddings=orig,
                  beta_fast=fast, beta_slow=slow, mscale=mscale, mscale_all_dim=all_dim)
    return kw


def transformer_engine_usable() -> bool:
    """Transformer Engine installed and a CUDA device to run its kernels."""
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


_SPEC_LOGGED: set = set()


def layer_spec(impl: str = "auto", qk_norm: bool = False, num_experts: int = 0,
               context_parallel: int = 1, attention_backend: str = "auto",
               mla: bool = False):
    """The transformer layer: Transformer Engine's (each pre-norm fused into the linear after
    it) for `transformer_engine`, or `auto` where TE is usable; else Megatron's local layers.
    TE's layers come with TE's own core attention (`TEDotProductAttention`, its CP ring
    under context parallelism), as Megatron ships them; the local layers with
    `SDPAttention` (attention.py; `attention_backend` chooses its kernels and packed path),
    and so do TE's layers where `attention_backend: flex` asks for FlexAttention. The HF
    maps and checkpoints read both layouts (hf/mapping.py: `local_name`)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .attention import SDPAttention, packed_path

    use_te = impl == "transformer_engine" or (impl == "auto" and transformer_engine_usable())
    if mla and impl == "transformer_engine":
        raise ValueError("transformer_impl=transformer_engine: multi-latent attention "
                         "(DeepSeek-V3) runs on Megatron's local layers only; use local or auto")
    if mla:
        use_te = False
        impl = "local (multi-latent attention)" if impl == "auto" else impl
    if use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts or None, moe_grouped_gemm=False, qk_layernorm=qk_norm)
        what = "Transformer Engine layers (fused norm + linear)"
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts or None, moe_grouped_gemm=False, normalization="RMSNorm",
            qk_layernorm=qk_norm or mla, multi_latent_attention=mla)
        why = {"local": "transformer_impl=local",
               "auto": "Transformer Engine not installed or no CUDA"}.get(impl, impl)
        what = f"Megatron local layers ({why})"
        if mla:
            what = "Megatron local layers, multi-latent attention"
    if use_te and attention_backend != "flex":
        what += ", Transformer Engine attention" + (
            f" (CP={context_parallel}: TE's ring)" if context_parallel > 1 else "")
    else:
        path = {"flex": "FlexAttention", "per_length": "one SDPA call per length"}[
            packed_path(attention_backend)]
        what += (f", torch SDPA attention (attention_backend={attention_backend}; packed "
                 f"sequences: {path})")
        if context_parallel > 1:
            what += f" (CP={context_parallel}: K/V all-gathered over the CP group)"
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=SDPAttention, params={"backend": attention_backend})
    if what not in _SPEC_LOGGED:  # once per process, not once per model
        _SPEC_LOGGED.add(what)
        logger.info("megatron: %s", what)
    return spec


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm in the local spec's norm slots, the one Megatron's `WrappedTorchNorm`
    builds, except that it runs under sequence parallelism (WrappedTorchNorm asserts it off).
    Under SP each TP rank normalises its own slice of the sequence, so the weight's gradient
    is a partial sum per rank: the weight is marked `sequence_parallel`, which is what
    Megatron's `finalize_model_grads` all-reduces over TP (as its own fused norm marks it).
    Q/K norms (`QKRMSNorm`) act on the whole sequence after the all-gather and are not
    marked (Megatron all-reduces them under TP by name, since the heads differ by rank)."""

    marks_sequence_parallel = True

    def __init__(self, config, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(f"megarl's local norm is RMSNorm without zero-centred gamma, "
                             f"got {config.normalization}")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.sequence_parallel = bool(config.sequence_parallel) and self.marks_sequence_parallel
        self.weight.sequence_parallel = self.sequence_parallel


class QKRMSNorm(RMSNorm):
    marks_sequence_parallel = False


def block_spec(layer, config, impl: str = "auto", dense_layer=None, first_k_dense: int = 0,
               vp_stage: int | None = None):
    """The decoder's spec: Megatron's own for Transformer Engine layers (TE's norms run under
    sequence parallelism), and for the local layers one whose every norm (the layers', the
    Q/K norms, the final one) is `RMSNorm` above in place of `WrappedTorchNorm`.
    `dense_layer`, `first_k_dense`: the first layers (global indices) built from the dense
    spec, the rest from `layer` (an MoE model with dense first layers, GLM-4.5). `vp_stage`:
    the model chunk under a virtual pipeline (its layers and their global offset)."""
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layer, local = _local_norms(layer)
    if dense_layer is None or not first_k_dense:
        if not local:
            return layer  # TE's layers (or apex's fused norm, which handles SP itself)
        return TransformerBlockSubmodules(
            layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
            layer_norm=RMSNorm)
    dense_layer, _ = _local_norms(dense_layer)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    specs = [dense_layer if offset + i < first_k_dense else layer
             for i in range(get_num_layers_to_build(config, vp_stage=vp_stage))]
    if local:
        return TransformerBlockSubmodules(layer_specs=specs, layer_norm=RMSNorm)
    from megatron.core.extensions.transformer_engine import TENorm

    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TENorm)


def _local_norms(layer):
    """`layer` with its WrappedTorchNorm slots set to megarl's norms; whether it had any."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    subs = layer.submodules
    slots = [(subs, "input_layernorm"), (subs, "pre_mlp_layernorm")]
    attn = getattr(subs.self_attention, "submodules", None)
    if attn is not None:
        slots += [(attn, "q_layernorm"), (attn, "k_layernorm"), (attn, "kv_layernorm")]
    # MLA's latent norms (q_layernorm, kv_layernorm) run on the residual stream's sequence
    # slice under SP, so they are marked like the layers' norms; Q/K head norms are not
    mla = getattr(attn, "kv_layernorm", None) is not None
    local = False
    for holder, name in slots:
        if getattr(holder, name, None) is WrappedTorchNorm:
            setattr(holder, name, QKRMSNorm if name in ("q_layernorm", "k_layernorm")
                    and not mla else RMSNorm)
            local = True
    return layer, local


class ValueHead(torch.nn.Module):
    """The critic's output layer: Linear(hidden, 1), replicated on every TP rank.

    It stands in for GPTModel's vocab-parallel `output_layer` (same call signature, so
    GPTModel's own forward runs it), which makes the model's output [b, s, 1] values instead
    of [b, s, vocab/TP] logits. Replicated, not split: one output column cannot be split over
    TP, and the head is tiny. Without sequence parallelism the final hidden states are whole
    on every TP rank, so every rank computes the same values and the same gradients (which
    also reach the decoder whole, where the vocab-parallel head would all-reduce partial
    ones). Under sequence parallelism each rank holds a slice of the sequence: the head
    all-gathers it first, and in backward each rank keeps its own slice of the (identical)
    gradient rather than summing TP copies of it (`tensor_parallel_output_grad=False`). It
    starts at zero: the first values are 0 on every rank, whatever the seed."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.gather_sequence = sequence_parallel
        self.sequence_parallel = False  # GPTModel's inference path reads it

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.gather_sequence:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden,
                                                          tensor_parallel_output_grad=False)
        return F.linear(hidden, self.weight, self.bias), None


def build_gpt_model(args: ModelArgs, config, make_vocab_size_divisible_by: int = 128,
                    value_head: bool = False, transformer_impl: str = "auto",
                    vp_stage: int | None = None, attention_backend: str = "auto"):
    """Build this rank's pipeline stage of the model (parallel_state must be initialised);
    under a virtual pipeline its model chunk `vp_stage` (`build_model_chunks`: all of them).

    `value_head`: the critic, whose last stage ends in a `ValueHead` (output [b, s, 1]) and
    whose embeddings are never tied to an output layer."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from . import _patches

    _patches.apply()
    tp = ps.get_tensor_model_parallel_world_size()
    dense = layer_spec(transformer_impl, args.qk_norm, 0, config.context_parallel_size,
                       attention_backend, args.is_mla) if args.first_k_dense else None
    if args.mtp_layers and not _SPEC_LOGGED.intersection({"mtp"}):
        _SPEC_LOGGED.add("mtp")
        logger.info("megatron: the checkpoint's %d multi-token-prediction layer(s) "
                    "(num_nextn_predict_layers) are not built, loaded or synced: RL trains "
                    "the next-token model only", args.mtp_layers)
    # the embedding lives in the first stage's first chunk, the output layer in the last
    # stage's last chunk (ignore_virtual=False asks for the chunk's place, not the rank's)
    virtual = vp_stage is not None
    model = GPTModel(
        config=config, transformer_layer_spec=block_spec(
            layer_spec(transformer_impl, args.qk_norm, args.num_experts,
                       config.context_parallel_size, attention_backend, args.is_mla), config,
            dense_layer=dense, first_k_dense=args.first_k_dense, vp_stage=vp_stage),
        vocab_size=padded_vocab_size(args.vocab_size, make_vocab_size_divisible_by, tp),
        max_sequence_length=args.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=not virtual, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=not virtual, vp_stage=vp_stage),
        share_embeddings_and_output_weights=args.tie_word_embeddings and not value_head,
        position_embedding_type="rope", rotary_base=args.rope_theta,
        rotary_percent=args.rotary_percent,
        rope_scaling=args.rope_scaling_factor is not None,
        rope_scaling_factor=args.rope_scaling_factor or 8.0,
        parallel_output=True, vp_stage=vp_stage,
    )
    if value_head and model.post_process:
        model.output_layer = ValueHead(args.hidden_size, config.params_dtype,
                                       config.sequence_parallel)
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def build_model_chunks(args: ModelArgs, config, make_vocab_size_divisible_by: int = 128,
                       value_head: bool = False, transformer_impl: str = "auto",
                       attention_backend: str = "auto"):
    """This rank's model chunks: one per virtual pipeline stage (`config`'s
    virtual_pipeline_model_parallel_size; one chunk without a virtual pipeline), in chunk
    order, which is also the order of their layers (Megatron's interleaved layout: chunk c
    of stage r holds the (c·PP + r)-th run of layers): a `ModelChunks`, or
    without a virtual pipeline the one GPTModel."""
    vpp = config.virtual_pipeline_model_parallel_size
    if not vpp or vpp == 1:
        return build_gpt_model(args, config, make_vocab_size_divisible_by, value_head,
                               transformer_impl, attention_backend=attention_backend)
    return ModelChunks([build_gpt_model(args, config, make_vocab_size_divisible_by, value_head,
                                        transformer_impl, vp_stage=i,
                                        attention_backend=attention_backend)
                        for i in range(vpp)])


class ModelChunks(torch.nn.ModuleList):
    """A rank's model chunks under a virtual pipeline, as one module: parameters, train/eval
    and state dicts span every chunk. Its sharded state dict holds each chunk's under
    `model{i}` (Megatron-LM's naming); the tensors inside carry global layer indices, so a
    checkpoint saved with chunks loads into any other layout and the reverse."""

    def sharded_state_dict(self, *args, **kwargs) -> dict:
        return {f"model{i}": c.sharded_state_dict(*args, **kwargs) for i, c in enumerate(self)}

    def load_state_dict(self, state, strict: bool = True):
        missing, unexpected = [], []
        for i, c in enumerate(self):
            got = c.load_state_dict(state.get(f"model{i}", {}), strict=strict)
            missing += [f"model{i}.{k}" for k in got.missing_keys]
            unexpected += [f"model{i}.{k}" for k in got.unexpected_keys]
        return missing, unexpected
