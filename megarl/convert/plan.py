"""Validate a conversion and predict its sizes without a torch.distributed world (the dry run).

Everything here reads only metadata: config.json, safetensors headers, megarl_meta.json and the
dist-checkpoint's `.metadata`. The shapes of every tensor on both sides follow from `ModelArgs`
(see mapping.py for the names), so the sizes are exact, not estimates:

- tensors / parameters: HF-named tensors and their element count (vocab unpadded);
- source bytes: the weight files on disk, and the tensor payload inside them;
- output tensor bytes: the payload the conversion writes, in the output dtype (a Megatron
  checkpoint stores the padded vocabulary, an HF one the real one). File sizes add a small
  header/metadata overhead on top;
- per-rank bytes: the parameters one rank of the TP×PP layout holds (every TP rank of a stage
  holds the same amount; with tied embeddings and PP>1 the last stage keeps its own copy of the
  output layer); of a mixture of experts, num_experts / EP of each layer's experts, each split
  over ETP ranks.

The same checks run before a real conversion, so a bad TP/PP/EP or a missing tensor fails
before any rank starts, with an error naming the flag, field, file or tensor (inputs.py holds
the checks). `world_size` is the number of ranks a layout runs on.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import torch

from megarl.backends.megatron.model import DTYPES, ModelArgs, padded_vocab_size

from megarl.backends.megatron.hf import mapping

from . import inputs
from .inputs import META, SAFETENSORS_ITEMSIZE, ConvertError, read_meta

__all__ = ["META", "ConvertError", "check_layout", "plan_hf2mcore", "plan_mcore2hf",
           "plan_reshard", "read_meta", "world_size"]

logger = logging.getLogger(__name__)


def itemsize(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


# ------------------------------------------------------------------------- shapes from args
def hf_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor, in mapping.hf_names order."""
    q, kv, h, f = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.hidden_size, \
        a.ffn_hidden_size
    per_layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.q_proj.bias": (q,),
                 "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
                 "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (f, h),
                 "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
                 "self_attn.q_norm.weight": (a.head_dim,), "self_attn.k_norm.weight": (a.head_dim,)}
    if a.is_mla:
        qk, n = a.qk_nope_head_dim + a.qk_rope_head_dim, a.num_heads
        per_layer.update({
            "self_attn.q_proj.weight": (n * qk, h), "self_attn.q_a_proj.weight": (a.q_lora_rank, h),
            "self_attn.q_a_layernorm.weight": (a.q_lora_rank,),
            "self_attn.q_b_proj.weight": (n * qk, a.q_lora_rank),
            "self_attn.kv_a_proj_with_mqa.weight": (a.kv_lora_rank + a.qk_rope_head_dim, h),
            "self_attn.kv_a_layernorm.weight": (a.kv_lora_rank,),
            "self_attn.kv_b_proj.weight": (n * (a.qk_nope_head_dim + a.v_head_dim),
                                           a.kv_lora_rank),
            "self_attn.o_proj.weight": (h, n * a.v_head_dim)})
    fm, fs = a.moe_ffn_hidden_size, a.moe_shared_ffn_hidden_size
    per_layer.update({"mlp.gate.weight": (a.num_experts, h), "expert.gate_proj.weight": (fm, h),
                      "expert.up_proj.weight": (fm, h), "expert.down_proj.weight": (h, fm),
                      "mlp.gate.e_score_correction_bias": (a.num_experts,),
                      "mlp.shared_experts.gate_proj.weight": (fs, h),
                      "mlp.shared_experts.up_proj.weight": (fs, h),
                      "mlp.shared_experts.down_proj.weight": (h, fs)})
    out = {}
    for name in mapping.hf_names(a):
        layer = name.split(".", 3)
        if name.startswith("model.layers."):
            suffix = layer[3]
            if suffix.startswith("mlp.experts."):  # mlp.experts.<e>.<proj>.weight
                suffix = "expert." + suffix.split(".", 3)[3]
            out[name] = per_layer[suffix]
        elif name == "model.norm.weight":
            out[name] = (h,)
        else:  # embed_tokens, lm_head
            out[name] = (a.vocab_size, h)
    return out


def mcore_params(a: ModelArgs, pp: int, padded_vocab: int) -> list[tuple[str, tuple, int]]:
    """(global Megatron name, full shape, PP stage) of every model parameter on some rank.

    With tied embeddings and PP>1 the last stage holds its own `output_layer.weight` (a copy
    kept in sync with the embedding); with PP=1 the output layer reuses the embedding.
    """
    h, qkv = a.hidden_size, (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    per_stage = a.num_layers // pp
    out = [("embedding.word_embeddings.weight", (padded_vocab, h), 0)]
    for i in range(a.num_layers):
        s, p = i // per_stage, f"decoder.layers.{i}."
        out.append((p + "input_layernorm.weight", (h,), s))
        if a.is_mla:
            out += [(p + m, shape, s) for m, shape in _mla_params(a)]
        else:
            out.append((p + "self_attention.linear_qkv.weight", (qkv, h), s))
        if a.qkv_bias:
            out.append((p + "self_attention.linear_qkv.bias", (qkv,), s))
        if a.qk_norm:
            out += [(p + f"self_attention.{x}_layernorm.weight", (a.head_dim,), s) for x in "qk"]
        v_width = a.num_heads * (a.v_head_dim if a.is_mla else a.head_dim)
        out += [(p + "self_attention.linear_proj.weight", (h, v_width), s),
                (p + "pre_mlp_layernorm.weight", (h,), s)]
        if a.is_moe and i >= a.first_k_dense:
            fm, fs = a.moe_ffn_hidden_size, a.moe_shared_ffn_hidden_size
            out.append((p + "mlp.router.weight", (a.num_experts, h), s))
            if a.moe_expert_bias:  # a buffer, fp32 (mapping.FP32_BUFFERS)
                out.append((p + "mlp.router.expert_bias", (a.num_experts,), s))
            for e in range(a.num_experts):
                x = f"{p}mlp.experts.local_experts.{e}."
                out += [(x + "linear_fc1.weight", (2 * fm, h), s),
                        (x + "linear_fc2.weight", (h, fm), s)]
            if fs:
                out += [(p + "mlp.shared_experts.linear_fc1.weight", (2 * fs, h), s),
                        (p + "mlp.shared_experts.linear_fc2.weight", (h, fs), s)]
        else:
            out += [(p + "mlp.linear_fc1.weight", (2 * a.ffn_hidden_size, h), s),
                    (p + "mlp.linear_fc2.weight", (h, a.ffn_hidden_size), s)]
    out.append(("decoder.final_layernorm.weight", (h,), pp - 1))
    if not a.tie_word_embeddings or pp > 1:
        out.append(("output_layer.weight", (padded_vocab, h), pp - 1))
    return out


def _mla_params(a: ModelArgs) -> list[tuple[str, tuple]]:
    """Megatron's multi-latent attention tensors of one layer (in-layer name, full shape)."""
    h, n, qk = a.hidden_size, a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
    q = [("self_attention.linear_q_down_proj.weight", (a.q_lora_rank, h)),
         ("self_attention.q_layernorm.weight", (a.q_lora_rank,)),
         ("self_attention.linear_q_up_proj.weight", (n * qk, a.q_lora_rank))] \
        if a.q_lora_rank else [("self_attention.linear_q_proj.weight", (n * qk, h))]
    return q + [("self_attention.linear_kv_down_proj.weight",
                 (a.kv_lora_rank + a.qk_rope_head_dim, h)),
                ("self_attention.kv_layernorm.weight", (a.kv_lora_rank,)),
                ("self_attention.linear_kv_up_proj.weight",
                 (n * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank))]


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def stage_param_counts(a: ModelArgs, tp: int, pp: int, padded_vocab: int, ep: int = 1,
                       etp: int | None = None) -> list[tuple[int, int]]:
    """(dense, routed-expert) parameter elements one rank of each PP stage holds: every TP
    rank of a stage holds the same dense share (validation makes the shards equal), and every
    EP rank num_experts / EP experts, each split over ETP ranks (None: TP). Apart because
    Megatron's distributed optimizer shards them over different data-parallel widths."""
    etp = tp if etp is None else etp
    local_experts = a.num_experts // ep if a.is_moe else 0
    out = [[0, 0] for _ in range(pp)]
    for name, shape, stage in mcore_params(a, pp, padded_vocab):
        n = numel(shape)
        expert = mapping.expert_index(mapping.split_layer_name(name)[1])
        if expert is None:
            out[stage][0] += n // tp if mapping.partition_dim(name) is not None else n
        elif expert < local_experts:  # EP rank 0's experts; every EP rank holds as many
            out[stage][1] += n // etp
    return [(d, e) for d, e in out]


def stage_param_bytes(a: ModelArgs, tp: int, pp: int, padded_vocab: int, dtype: str,
                      ep: int = 1, etp: int | None = None) -> list[int]:
    """Parameter bytes one rank of each PP stage holds (`stage_param_counts`, summed)."""
    return [(d + e) * itemsize(dtype)
            for d, e in stage_param_counts(a, tp, pp, padded_vocab, ep, etp)]


def world_size(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> int:
    """The fewest ranks Megatron builds a TP×PP(×EP×ETP) layout on: each stage's ranks must
    be a multiple of TP (the dense layers' groups) and of EP×ETP (the experts' groups, taken
    from the same ranks); ranks beyond TP are data-parallel replicas of the dense layers."""
    return pp * math.lcm(tp, ep * (tp if etp is None else etp))


def mcore_checkpoint_bytes(a: ModelArgs, padded_vocab: int, dtype: str) -> int:
    """Tensor payload of a Megatron checkpoint: unique tensors (a tied output layer is the
    embedding's replica and is stored once)."""
    names = mcore_params(a, 1, padded_vocab)
    return sum(numel(s) for _, s, _ in names) * itemsize(dtype)


# ------------------------------------------------------------------------- validation
def check_layout(a: ModelArgs, tp: int, pp: int, divisible_by: int,
                 where: str = "config.json", ep: int = 1, etp: int | None = None) -> int:
    """Raise ConvertError unless the model splits over TP×PP and its experts over EP×ETP
    (inputs.check_layout, the rules the Megatron worker applies too); returns the padded vocab.
    The expert flags are checked first, in the converter's words (`--ep`, `--etp`)."""
    if divisible_by < 1:
        raise ConvertError(f"--make-vocab-size-divisible-by {divisible_by}: must be at least 1")
    _check_expert_flags(a, tp, ep, etp, where)
    inputs.check_layout(a, tp, pp, where, ep, etp)
    # The vocabulary never blocks a split: Megatron pads it to a multiple of divisible_by×TP.
    return padded_vocab_size(a.vocab_size, divisible_by, tp)


def _check_expert_flags(a: ModelArgs, tp: int, ep: int, etp: int | None, where: str) -> None:
    if ep < 1:
        raise ConvertError(f"--ep {ep}: must be at least 1")
    if etp is not None and etp < 1:
        raise ConvertError(f"--etp {etp}: must be at least 1")
    if not a.is_moe:
        if ep > 1:
            raise ConvertError(f"--ep {ep}: expert parallelism needs a mixture-of-experts "
                               f"model, but {where} is a dense {a.arch} (no num_experts)")
        if etp is not None and etp != tp:
            raise ConvertError(f"--etp {etp}: expert tensor parallelism needs a "
                               f"mixture-of-experts model, but {where} is a dense {a.arch}")
        return
    if a.num_experts % ep:
        raise ConvertError(f"--ep {ep}: does not divide num_experts={a.num_experts} of {where} "
                           f"(each EP rank holds the same number of experts)")
    if etp is not None and a.moe_ffn_hidden_size % etp:
        raise ConvertError(f"--etp {etp}: does not divide moe_intermediate_size="
                           f"{a.moe_ffn_hidden_size} of {where}")


def _check_out(out: Path, source: Path) -> None:
    if out.resolve() == source.resolve():
        raise ConvertError(f"--out {out}: must differ from the source directory")
    inputs.check_out_dir(out)


# ------------------------------------------------------------------------- the report
@dataclasses.dataclass
class Plan:
    command: str
    source: str
    out: str
    arch: str
    tp: int
    pp: int
    out_dtype: str
    vocab_size: int
    padded_vocab: int
    hf_tensors: int
    mcore_tensors: int
    parameters: int
    source_file_bytes: int
    source_tensor_bytes: int
    output_tensor_bytes: int
    stage_rank_bytes: list[int]
    notes: list[str] = dataclasses.field(default_factory=list)
    ep: int = 1
    etp: int | None = None
    """None: the experts split over TP (Megatron's default)."""

    @property
    def max_rank_bytes(self) -> int:
        return max(self.stage_rank_bytes)

    @property
    def ranks(self) -> int:
        """The world the conversion runs in (`world_size`)."""
        return world_size(self.tp, self.pp, self.ep, self.etp)

    def layout(self) -> str:
        text = f"TP={self.tp} PP={self.pp}"
        if self.ep > 1 or self.etp not in (None, self.tp):
            etp = self.tp if self.etp is None else self.etp
            text += f" EP={self.ep} ETP={etp}"
        extra = self.ranks // (self.tp * self.pp)
        dp = f", {extra} data-parallel replicas of the dense layers" if extra > 1 else ""
        return f"{text} ({self.ranks} ranks{dp})"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["etp"] = self.tp if self.etp is None else self.etp
        d["ranks"] = self.ranks
        d["max_rank_bytes"] = self.max_rank_bytes
        return d

    def table(self) -> str:
        rows = [
            ("source", self.source),
            ("output", f"{self.out} (not written: dry run)"),
            ("architecture", (f"{self.arch}, vocab {self.vocab_size} "
                              f"(padded to {self.padded_vocab} on the Megatron side)")),
            ("tensors", f"{self.hf_tensors} HF / {self.mcore_tensors} Megatron"),
            ("parameters", f"{self.parameters:,}"),
            ("source bytes", (f"{human(self.source_file_bytes)} on disk, "
                              f"{human(self.source_tensor_bytes)} of tensors")),
            ("output bytes", f"{human(self.output_tensor_bytes)} of tensors in {self.out_dtype}"),
            ("layout", self.layout()),
            ("largest rank", f"{human(self.max_rank_bytes)} of parameters"),
        ]
        if self.pp > 1:
            rows += [(f"  stage {s}", f"{human(b)} per rank")
                     for s, b in enumerate(self.stage_rank_bytes)]
        rows += [("note", n) for n in self.notes]
        width = max(len(k) for k, _ in rows)
        head = f"megarl convert {self.command} --dry-run"
        return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _hf_source(hf_dir: Path, a: ModelArgs) -> tuple[int, int]:
    """Check every weight file and expected tensor; (file bytes, tensor bytes)."""
    _, weights = inputs.check_hf_dir(hf_dir, what="--hf-dir")
    tensor_bytes = sum(numel(shape) * SAFETENSORS_ITEMSIZE[dtype]
                       for _, dtype, shape in weights.values())
    files = sum(p.stat().st_size for p in {path for path, _, _ in weights.values()})
    return files, tensor_bytes


def mcore_tensor_bytes(md) -> int:
    """Tensor payload recorded in a dist-checkpoint's metadata (no tensor is read); `md` is
    the metadata, or the checkpoint directory (then checked and read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if isinstance(md, (str, Path)):
        md = inputs.dist_checkpoint_metadata(Path(md))
    return sum(numel(v.size) * v.properties.dtype.itemsize
               for v in md.state_dict_metadata.values()
               if isinstance(v, TensorStorageMetadata))


def _mcore_source(ckpt: Path, tp: int, pp: int, ep: int, etp: int | None
                  ) -> tuple[dict, ModelArgs, int, int, int]:
    """(meta, args, padded vocab at tp, weight file bytes, tensor bytes), layout checked first."""
    meta = read_meta(ckpt)
    a = inputs.read_model_args(ckpt / "hf", "--ckpt")
    padded = check_layout(a, tp, pp, meta.get("make_vocab_size_divisible_by", 128),
                          str(ckpt / "hf" / "config.json"), ep, etp)
    md = inputs.check_dist_checkpoint(ckpt)
    # Weights only: the optimizer state and the hf/ side copy are not model tensors.
    files = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file() and p.name != META)
    return meta, a, padded, files, mcore_tensor_bytes(md)


def _ckpt_dtype(meta: dict, ckpt: Path) -> str:
    return meta.get("params_dtype", "float32")  # checked by inputs.read_meta


def _counts(a: ModelArgs) -> tuple[int, int, int]:
    shapes = hf_shapes(a)
    return len(shapes), len(mcore_params(a, 1, a.vocab_size)), \
        sum(numel(s) for s in shapes.values())


def plan_hf2mcore(hf_dir, out, tp: int = 1, pp: int = 1, params_dtype: str = "float32",
                  make_vocab_size_divisible_by: int = 128, ep: int = 1,
                  etp: int | None = None) -> Plan:
    hf_dir, out = Path(hf_dir), Path(out)
    a = inputs.read_model_args(hf_dir, "--hf-dir")
    padded = check_layout(a, tp, pp, make_vocab_size_divisible_by, str(hf_dir / "config.json"),
                          ep, etp)
    _check_out(out, hf_dir)
    files, tensors = _hf_source(hf_dir, a)
    n_hf, n_mc, params = _counts(a)
    return Plan("hf2mcore", str(hf_dir), str(out), a.arch, tp, pp, params_dtype, a.vocab_size,
                padded, n_hf, n_mc, params, files, tensors,
                mcore_checkpoint_bytes(a, padded, params_dtype),
                stage_param_bytes(a, tp, pp, padded, params_dtype, ep, etp), ep=ep, etp=etp)


def plan_mcore2hf(ckpt, out, tp: int = 1, pp: int = 1, dtype: str | None = None,
                  ep: int = 1, etp: int | None = None) -> Plan:
    ckpt, out = Path(ckpt), Path(out)
    meta, a, padded, files, tensors = _mcore_source(ckpt, tp, pp, ep, etp)
    src_dtype = _ckpt_dtype(meta, ckpt)
    _check_out(out, ckpt)
    n_hf, n_mc, params = _counts(a)
    out_dtype = dtype or src_dtype
    notes = []
    if (ckpt / "optim").is_dir():
        notes.append("optimizer state in the checkpoint is not exported (HF holds weights only)")
    return Plan("mcore2hf", str(ckpt), str(out), a.arch, tp, pp, out_dtype, a.vocab_size, padded,
                n_hf, n_mc, params, files, tensors, params * itemsize(out_dtype),
                stage_param_bytes(a, tp, pp, padded, src_dtype, ep, etp), notes, ep=ep, etp=etp)


def saved_layout(meta: dict) -> str:
    """The layout a checkpoint was written at, from its megarl_meta.json (EP only when a
    mixture of experts was split over it)."""
    text = f"TP={meta.get('tp')} PP={meta.get('pp')}"
    if meta.get("ep", 1) > 1 or meta.get("etp", meta.get("tp")) != meta.get("tp"):
        text += f" EP={meta.get('ep', 1)} ETP={meta.get('etp', meta.get('tp'))}"
    return text


def plan_reshard(ckpt, out, tp: int = 1, pp: int = 1, ep: int = 1,
                 etp: int | None = None) -> Plan:
    ckpt, out = Path(ckpt), Path(out)
    meta, a, padded, files, tensors = _mcore_source(ckpt, tp, pp, ep, etp)
    dtype = _ckpt_dtype(meta, ckpt)
    _check_out(out, ckpt)
    n_hf, n_mc, params = _counts(a)
    notes = []
    if (ckpt / "optim").is_dir():
        notes.append(f"optimizer state ({ckpt / 'optim'}) is dropped: it is per rank of the "
                     f"old layout ({saved_layout(meta)})")
    return Plan("reshard", str(ckpt), str(out), a.arch, tp, pp, dtype, a.vocab_size, padded,
                n_hf, n_mc, params, files, tensors, mcore_checkpoint_bytes(a, padded, dtype),
                stage_param_bytes(a, tp, pp, padded, dtype, ep, etp), notes, ep=ep, etp=etp)
