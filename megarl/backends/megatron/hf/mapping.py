"""Pure HF <-> Megatron name and layout maps for the Llama, Qwen2, Qwen3, GLM-4.5 and
DeepSeek-V3 families.

"Full" Megatron tensors are unsharded and carry global layer indices; the TP split of a full
tensor is `shard()`, its inverse `unshard()`. The families share HF names; they differ only in
QKV bias, tied embeddings and Qwen3's per-head query/key norms (`q_norm`, `k_norm`: one
head_dim-sized weight each, replicated over TP like every norm), which `ModelArgs` records.
Megatron's fused QKV interleaves per query group — [q heads of the group, k, v] for each
group — so TP can split on groups. The vocabulary is padded on the Megatron side (see
model.padded_vocab_size) and trimmed back on the way out.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from megarl.backends.megatron.model import ModelArgs

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron suffix within a layer -> HF suffix within a layer (one-to-one tensors).
_LAYER_1TO1 = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    # Qwen3-MoE's router: [experts, hidden], replicated over TP
    "mlp.router.weight": "mlp.gate.weight",
    # a sigmoid router's score-correction bias (GLM-4.5): a Megatron buffer, fp32
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
# Buffers (not parameters) the maps carry, kept fp32 on both sides.
FP32_BUFFERS = ("mlp.router.expert_bias",)
# One routed expert's SwiGLU inside a layer (Megatron's SequentialMLP): sharded over TP like
# the dense MLP's linear_fc1 / linear_fc2, with the expert index in the name.
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
# Multi-latent attention (DeepSeek-V3, Kimi-K2, local spec): one tensor each way, same
# layout on both sides (the HF q/kv up-projections are per head [nope, rope] and [nope, v],
# Megatron's too; kv_a_proj_with_mqa is [latent, rope key], Megatron's kv down-projection
# too). Megatron's q_layernorm is the query latent's norm here, not Qwen3's per-head one.
_MLA_1TO1 = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}
_GLOBAL_1TO1 = {
    "decoder.final_layernorm.weight": "model.norm.weight",
}
# TP partition dim of each Megatron tensor kind; absent = replicated on every TP rank.
_COLUMN = ("embedding.word_embeddings.weight", "output_layer.weight",
           "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
           "mlp.linear_fc1.weight",
           # MLA's linears are all column-parallel in the local spec (the down-projections'
           # outputs are all-gathered before the latent norms)
           "self_attention.linear_q_proj.weight", "self_attention.linear_q_down_proj.weight",
           "self_attention.linear_q_up_proj.weight", "self_attention.linear_kv_down_proj.weight",
           "self_attention.linear_kv_up_proj.weight")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


# Transformer Engine's layer spec fuses each pre-norm into the linear after it, so a TE model
# holds those norms under the linear's name. Everything here speaks the local spec's names;
# `local_name` turns a TE model's into them. (Megatron's local spec maps the other way when it
# writes checkpoints, its `sharded_state_dict_keys_map`, so checkpoints of either spec agree.)
TE_FUSED_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                  "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def split_layer_name(name: str) -> tuple[int | None, str]:
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def _rename_in_layer(name: str, pairs) -> str:
    layer, suffix = split_layer_name(name)
    if layer is None:
        return name
    for old, new in pairs:
        if suffix.startswith(old):
            return f"decoder.layers.{layer}.{new}{suffix[len(old):]}"
    return name


def local_name(name: str) -> str:
    """A parameter name of the local spec for a name of either spec (TE's fused norms)."""
    return _rename_in_layer(name, [(te, loc) for loc, te in TE_FUSED_NORMS.items()])


def te_name(name: str) -> str:
    """The Transformer Engine spec's name for a local-spec parameter name."""
    return _rename_in_layer(name, TE_FUSED_NORMS.items())


def expert_index(suffix: str) -> int | None:
    """The expert index in a routed expert's in-layer name; None for any other tensor."""
    m = _EXPERT.match(suffix)
    return int(m.group(1)) if m else None


def with_expert_index(suffix: str, index: int) -> str:
    """A routed expert's in-layer name with another expert index."""
    m = _EXPERT.match(suffix)
    return f"mlp.experts.local_experts.{index}.{m.group(2)}.weight"


def _dense_kind(suffix: str) -> str:
    """A routed or shared expert's suffix as the dense MLP's (same TP layout); others
    unchanged."""
    m = _EXPERT.match(suffix)
    if m:
        return f"mlp.{m.group(2)}.weight"
    return suffix.replace("mlp.shared_experts.", "mlp.", 1)


def partition_dim(name: str) -> int | None:
    _, suffix = split_layer_name(name)
    suffix = _dense_kind(suffix)
    if suffix in _COLUMN or name in _COLUMN:
        return 0
    if suffix in _ROW:
        return 1
    return None


def shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor."""
    dim = partition_dim(name)
    if dim is None or tp == 1:
        return full
    if _dense_kind(split_layer_name(name)[1]) == "mlp.linear_fc1.weight":
        # Gated MLP: each rank holds [its gate slice; its up slice], not a slice of [gate; up].
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], dim=0)
    return full.chunk(tp, dim=dim)[rank]


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard` over all TP ranks' slices (in rank order)."""
    dim = partition_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if _dense_kind(split_layer_name(name)[1]) == "mlp.linear_fc1.weight":
        pairs = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([p[0] for p in pairs] + [p[1] for p in pairs], dim=0)
    return torch.cat(shards, dim=dim)


def _qkv_sizes(a: ModelArgs) -> tuple[int, int]:
    return a.num_heads // a.num_kv_heads, a.head_dim


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: ModelArgs) -> torch.Tensor:
    per_group, hd = _qkv_sizes(a)
    tail = q.shape[1:]
    q = q.reshape(a.num_kv_heads, per_group * hd, *tail)
    k = k.reshape(a.num_kv_heads, hd, *tail)
    v = v.reshape(a.num_kv_heads, hd, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, a: ModelArgs):
    per_group, hd = _qkv_sizes(a)
    tail = qkv.shape[1:]
    g = qkv.reshape(a.num_kv_heads, (per_group + 2) * hd, *tail)
    q, k, v = g.split([per_group * hd, hd, hd], dim=1)
    return (q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail))


def _pad_vocab(t: torch.Tensor, padded: int) -> torch.Tensor:
    if t.shape[0] == padded:
        return t
    pad = torch.zeros(padded - t.shape[0], *t.shape[1:], dtype=t.dtype)
    return torch.cat([t, pad], dim=0)


def mcore_from_hf(name: str, get_hf: Callable[[str], torch.Tensor], a: ModelArgs,
                  padded_vocab: int) -> torch.Tensor:
    """The full Megatron tensor `name` built from HF tensors fetched through `get_hf`."""
    if name == "embedding.word_embeddings.weight":
        return _pad_vocab(get_hf("model.embed_tokens.weight"), padded_vocab)
    if name == "output_layer.weight":
        src = "model.embed_tokens.weight" if a.tie_word_embeddings else "lm_head.weight"
        return _pad_vocab(get_hf(src), padded_vocab)
    if name in _GLOBAL_1TO1:
        return get_hf(_GLOBAL_1TO1[name])
    layer, suffix = split_layer_name(name)
    if layer is None:
        raise KeyError(f"{name}: no HF counterpart")
    pre = f"model.layers.{layer}."
    if a.is_mla and suffix in _MLA_1TO1:
        return get_hf(pre + _MLA_1TO1[suffix])
    if suffix in _LAYER_1TO1:
        return get_hf(pre + _LAYER_1TO1[suffix])
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        return fuse_qkv(*(get_hf(f"{pre}self_attn.{p}_proj.{kind}") for p in "qkv"), a)
    if suffix in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
        mlp = suffix[: -len("linear_fc1.weight")]
        return torch.cat([get_hf(f"{pre}{mlp}gate_proj.weight"),
                          get_hf(f"{pre}{mlp}up_proj.weight")], dim=0)
    expert = _EXPERT.match(suffix)
    if expert:
        e = f"{pre}mlp.experts.{int(expert.group(1))}."
        if expert.group(2) == "linear_fc1":
            return torch.cat([get_hf(e + "gate_proj.weight"), get_hf(e + "up_proj.weight")],
                             dim=0)
        return get_hf(e + "down_proj.weight")
    raise KeyError(f"{name}: no HF counterpart")


VALUE_HEAD = {"output_layer.weight": "score.weight", "output_layer.bias": "score.bias"}
"""A critic's value head (replicated over TP, never sharded) and its HF name in
`{Arch}ForTokenClassification` (num_labels=1), the form verl loads a critic in."""


def hf_from_mcore(name: str, full: torch.Tensor, a: ModelArgs) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one full Megatron tensor; [] for a tied output layer."""
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", full[: a.vocab_size])]
    if name == "output_layer.weight":
        return [] if a.tie_word_embeddings else [("lm_head.weight", full[: a.vocab_size])]
    if name in _GLOBAL_1TO1:
        return [(_GLOBAL_1TO1[name], full)]
    layer, suffix = split_layer_name(name)
    if layer is None:
        raise KeyError(f"{name}: no HF counterpart")
    pre = f"model.layers.{layer}."
    if a.is_mla and suffix in _MLA_1TO1:
        return [(pre + _MLA_1TO1[suffix], full)]
    if suffix in _LAYER_1TO1:
        return [(pre + _LAYER_1TO1[suffix], full)]
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        return [(f"{pre}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", split_qkv(full, a))]
    if suffix in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
        mlp = suffix[: -len("linear_fc1.weight")]
        gate, up = full.chunk(2, dim=0)
        return [(f"{pre}{mlp}gate_proj.weight", gate), (f"{pre}{mlp}up_proj.weight", up)]
    expert = _EXPERT.match(suffix)
    if expert:
        e = f"{pre}mlp.experts.{int(expert.group(1))}."
        if expert.group(2) == "linear_fc1":
            gate, up = full.chunk(2, dim=0)
            return [(e + "gate_proj.weight", gate), (e + "up_proj.weight", up)]
        return [(e + "down_proj.weight", full)]
    raise KeyError(f"{name}: no HF counterpart")


def hf_names(a: ModelArgs) -> list[str]:
    """Every tensor name an HF checkpoint of this architecture holds, in a stable order."""
    names = ["model.embed_tokens.weight"]
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight"]
        if a.is_mla:
            q = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if a.q_lora_rank else ["q_proj"]
            names += [f"{p}self_attn.{x}.weight"
                      for x in q + ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"]]
        else:
            for x in "qkv":
                names.append(f"{p}self_attn.{x}_proj.weight")
                if a.qkv_bias:
                    names.append(f"{p}self_attn.{x}_proj.bias")
        if a.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight"]
        if a.is_moe and i >= a.first_k_dense:
            names.append(p + "mlp.gate.weight")
            if a.moe_expert_bias:
                names.append(p + "mlp.gate.e_score_correction_bias")
            for e in range(a.num_experts):
                names += [f"{p}mlp.experts.{e}.{x}_proj.weight" for x in ("gate", "up", "down")]
            if a.moe_shared_ffn_hidden_size:
                names += [f"{p}mlp.shared_experts.{x}_proj.weight"
                          for x in ("gate", "up", "down")]
        else:
            names += [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                      p + "mlp.down_proj.weight"]
    names.append("model.norm.weight")
    if not a.tie_word_embeddings:
        names.append("lm_head.weight")
    return names
