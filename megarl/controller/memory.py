"""The dry run's per-device memory estimate of each task group, and the fit check.

Owns the formulas (``FORMULAS``, printed with the plan) and their arithmetic: trainer
(params, main grads, optimizer state, activations), reference, the logp replica, rollout
engines (weights, receive bucket, KV cache). ``check_fit`` raises ``ConfigError`` naming the
group that cannot fit. Inputs are the validated config, the model's shape (``ModelArgs``)
and the bucket plan of ``megarl.controller.dryrun``; nothing here starts anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from megarl.backends.megatron.model import ModelArgs, padded_vocab_size, recompute_settings
from megarl.cluster.topology import GroupPlan
from megarl.config import ConfigError
from megarl.convert.plan import itemsize, stage_param_counts

from .micro_batches import micro_batch_tokens

if TYPE_CHECKING:
    from .dryrun import RunPlan, StageBuckets

GiB = 1 << 30
_ARR = "actor_rollout_ref"


@dataclass(frozen=True)
class MemoryItem:
    label: str
    nbytes: int


@dataclass(frozen=True)
class GroupMemory:
    group: str
    items: tuple[MemoryItem, ...]

    @property
    def total(self) -> int:
        return sum(i.nbytes for i in self.items)


def needs_ref(cfg: DictConfig) -> bool:
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


FORMULAS = [
    "N = parameters one device holds (largest PP stage, TP-sharded, padded vocab; of a "
    "mixture of experts num_experts/EP experts, each split over ETP), "
    "e = bytes per element of params_dtype",
    "s = data.max_prompt_length + data.max_response_length, h = hidden, V = padded vocab, "
    "L = layers per PP stage",
    "trainer   = N·e (params) + N·4 (fp32 main grads) + N·(4 master if e<4 + 8 Adam m,v) "
    "/ (DP if use_distributed_optimizer else 1; the experts' share / expert-DP = devices / "
    "(PP·EP·ETP)) + activations",
    "activations = max(train, logp): train = L·s·b·h·(10 + 24/TP)·e/2, with "
    "megatron.sequence_parallel L·s·b·h·(34/TP)·e/2 "
    "[Korthikanti et al. 2022, SDPA; with gradient checkpointing "
    "L·s·b·h·e (/TP with sequence parallelism) + one such layer] × PP micro-batches in "
    "flight + 2·s·b·V/TP·4 (fp32 logits + their grad), b = actor.ppo_micro_batch_size_per_gpu; logp = s·b'·V/TP·4, "
    "b' = rollout.log_prob_micro_batch_size_per_gpu",
    "with use_dynamic_bsz (packed micro-batches) s·b is the pass's token budget "
    "(*_max_token_len_per_gpu; at least s, as a longer sequence goes alone)",
    "context parallelism (megatron.context_parallel_size = CP): s·b above is one rank's "
    "share, s·b/CP (the budget counts per CP rank: at least s/CP), and training adds the "
    "K/V all-gathered over the CP group, L·s·b·2·kv_heads·head_dim/TP·e with s·b the whole "
    "micro-batch's",
    "multi-latent attention (DeepSeek-V3): each layer's Q, K, V and attention output at "
    "their widths, s·b·(2·heads·(nope+rope) + 2·heads·v − 4h)/TP·e, in place of four h-wide "
    "tensors, plus the latents s·b·(2·(q_lora + kv_lora) + rope)·e (/TP with SP); the "
    "engine's KV cache holds L·(kv_lora + rope)·e a token on every TP rank",
    "reference = N·e (params, ref layout) + s·b·V/TP·4 (fp32 logits), "
    "b = ref.log_prob_micro_batch_size_per_gpu",
    "rollout   = gpu_memory_utilization × capacity, reserved by each engine: "
    "HF weights/TP + receive bucket (the largest bucket) + KV cache (the rest)",
    "a group's estimate is the sum of what runs on it; it must fit the capacity "
    "(--gpu-memory-gib)",
]


def estimate_memory(cfg: DictConfig, groups: list[GroupPlan], a: ModelArgs,
                    stages: list[StageBuckets], capacity: int) -> list[GroupMemory]:
    """Per-device memory of every group, by ``FORMULAS``."""
    out = []
    for g in groups:
        items = []
        if "actor-train" in g.tasks:
            items += trainer_memory(cfg, a, g.num_devices)
        elif "logp" in g.tasks:
            items += replica_memory(cfg, a, stages)
        if "ref_logp" in g.tasks and needs_ref(cfg):
            items += reference_memory(cfg, a)
        if "generate" in g.tasks:
            items += rollout_memory(cfg, a, stages, capacity)
        out.append(GroupMemory(g.name, tuple(items)))
    return out


def _rank_split(a: ModelArgs, m: DictConfig) -> tuple[int, int]:
    """(dense, expert) parameters of the largest PP stage's rank."""
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    vocab = padded_vocab_size(a.vocab_size, m.make_vocab_size_divisible_by, tp)
    ep = m.expert_model_parallel_size if a.is_moe else 1
    return max(stage_param_counts(a, tp, pp, vocab, ep, m.expert_tensor_parallel_size),
               key=sum)


def _rank_params(a: ModelArgs, m: DictConfig) -> int:
    return sum(_rank_split(a, m))


def _logits_bytes(a: ModelArgs, m: DictConfig, tokens: int) -> int:
    tp = m.tensor_model_parallel_size
    vocab = padded_vocab_size(a.vocab_size, m.make_vocab_size_divisible_by, tp)
    return tokens * vocab // tp * 4


def _activation_bytes(cfg: DictConfig, a: ModelArgs) -> int:
    arr = cfg.actor_rollout_ref
    m = arr.actor.megatron
    tp, pp, e = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, \
        itemsize(m.params_dtype)
    cp = m.context_parallel_size
    tokens = micro_batch_tokens(cfg, "actor", cp)
    sbh = tokens * a.hidden_size
    # sequence parallelism shards the norms', residuals' and dropouts' share (the 10) over TP
    sp = bool(m.sequence_parallel) and tp > 1
    layer = sbh * (34 / tp if sp else 10 + 24 / tp) * e / 2
    if a.is_mla:
        # Q, K, V and the attention output at MLA's widths (heads × (nope + rope) for Q and
        # K, heads × v for V and the output) in place of the four h-wide tensors counted
        # above, and the latents (query, key/value, RoPE key) with their norms' outputs
        n, qk = a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
        wide = 2 * n * qk + 2 * n * a.v_head_dim - 4 * a.hidden_size
        latents = 2 * (a.q_lora_rank + a.kv_lora_rank) + a.qk_rope_head_dim
        layer += tokens * (wide / tp + latents / (tp if sp else 1)) * e
    kept = sbh * e / (tp if sp else 1)  # a recomputed group's input: one [s, b, h] slice
    layers = a.num_layers // pp
    rc = recompute_settings(m.override_transformer_config,
                            arr.model.enable_gradient_checkpointing)
    if rc is None or rc["recompute_granularity"] == "selective":
        # (`layer` leaves out the attention scores already: SDPA keeps none, which is
        # what selective recompute would save)
        stack = layers * layer
    elif rc["recompute_method"] == "uniform":  # each group's input kept, one group live
        n = min(rc["recompute_num_layers"], layers)
        stack = -(-layers // n) * kept + n * layer
    else:  # block: the first n layers kept as inputs, the others whole
        n = min(rc["recompute_num_layers"], layers)
        stack = n * kept + (layers - n) * layer + layer
    if cp > 1:  # each layer keeps the K and V it gathered, of the whole sequence(s)
        stack += layers * tokens * cp * kv_width(a, tp) * e
    train = stack * pp + 2 * _logits_bytes(a, m, tokens)
    logp = _logits_bytes(a, m, micro_batch_tokens(cfg, "logp", cp))
    return int(max(train, logp))


def trainer_memory(cfg: DictConfig, a: ModelArgs, devices: int) -> list[MemoryItem]:
    m = cfg.actor_rollout_ref.actor.megatron
    (dense, experts), e = _rank_split(a, m), itemsize(m.params_dtype)
    n = dense + experts
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    # the distributed optimizer shards over DP × CP (Megatron's), i.e. devices / (TP·PP)
    dp = devices // (tp * pp)
    # the experts' state shards over their own data-parallel ranks (Megatron's expert-DP)
    edp = devices // (pp * (m.expert_model_parallel_size if a.is_moe else 1)
                      * (m.expert_tensor_parallel_size or tp))
    shard, eshard = (dp, edp) if m.use_distributed_optimizer else (1, 1)
    state = (4 if e < 4 else 0) + 8
    per = f"/ {shard}" if not experts or shard == eshard else f"/ {shard}, experts / {eshard}"
    return [MemoryItem(f"trainer params ({_count(n)} × {e} B)", n * e),
            MemoryItem("trainer fp32 main grads", n * 4),
            MemoryItem(f"trainer optimizer ({state} B/param {per})",
                       dense * state // shard + experts * state // eshard),
            MemoryItem("trainer activations", _activation_bytes(cfg, a))]


def reference_memory(cfg: DictConfig, a: ModelArgs) -> list[MemoryItem]:
    ref = cfg.actor_rollout_ref.ref
    n, e = _rank_params(a, ref.megatron), itemsize(ref.megatron.params_dtype)
    return [MemoryItem(f"reference params ({_count(n)} × {e} B)", n * e),
            MemoryItem("reference logits",
                       _logits_bytes(a, ref.megatron, micro_batch_tokens(
                           cfg, "ref", ref.megatron.context_parallel_size)))]


def replica_megatron(cfg: DictConfig) -> DictConfig:
    """The logp replica's Megatron settings: the actor's, with its own TP/PP when given."""
    m = OmegaConf.to_container(cfg.actor_rollout_ref.actor.megatron)
    logp = cfg.actor_rollout_ref.logp
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        m[key] = logp[key] or m[key]
    return OmegaConf.create(m)


def replica_memory(cfg: DictConfig, a: ModelArgs, stages: list[StageBuckets]
                   ) -> list[MemoryItem]:
    """The logp group's replica: the actor's shard, the whole HF-named copy its receiver
    holds (staged and live), and the logits of one log-prob micro-batch."""
    m = replica_megatron(cfg)
    n, e = _rank_params(a, m), itemsize(m.params_dtype)
    hf = sum(s.total for s in stages)
    return [MemoryItem(f"replica params ({_count(n)} × {e} B)", n * e),
            MemoryItem("replica receiver (HF weights, live + staged)", 2 * hf),
            MemoryItem("replica logits", _logits_bytes(
                a, m, micro_batch_tokens(cfg, "logp", m.context_parallel_size)))]


def rollout_weights(cfg: DictConfig, stages: list[StageBuckets]) -> tuple[int, int]:
    """(HF weights per engine device, receive bucket) in bytes."""
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    return sum(s.total for s in stages) // tp, max(s.largest for s in stages)


def kv_width(a: ModelArgs, tp: int) -> int:
    """Elements of one token's K and V in one layer on one of TP ranks (KV heads shard over
    TP, replicate beyond it; MLA's are per head, heads × (nope + rope) and heads × v)."""
    if a.is_mla:
        return a.num_heads // tp * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
    return 2 * max(1, a.num_kv_heads // tp) * a.head_dim


def kv_bytes_per_token(a: ModelArgs, tp: int, e: int) -> int:
    """The KV cache of one token on one engine device: K and V (`kv_width`); with MLA,
    SGLang caches the latent and the RoPE key instead (kv_lora_rank + qk_rope_head_dim a
    layer, the same on every TP rank)."""
    if a.is_mla:
        return a.num_layers * (a.kv_lora_rank + a.qk_rope_head_dim) * e
    return a.num_layers * kv_width(a, tp) * e


def rollout_memory(cfg: DictConfig, a: ModelArgs, stages: list[StageBuckets],
                   capacity: int) -> list[MemoryItem]:
    r = cfg.actor_rollout_ref.rollout
    weights, bucket = rollout_weights(cfg, stages)
    reserve = int(r.gpu_memory_utilization * capacity)
    kv = max(0, reserve - weights - bucket)
    per_token = kv_bytes_per_token(a, r.tensor_model_parallel_size,
                                   itemsize(cfg.actor_rollout_ref.actor.megatron.params_dtype))
    return [MemoryItem(f"rollout weights/TP{r.tensor_model_parallel_size}", weights),
            MemoryItem("rollout receive bucket", bucket),
            MemoryItem(f"rollout KV cache (~{kv // per_token:,} tokens)", kv)]


def check_fit(cfg: DictConfig, plan: RunPlan, groups: list[GroupPlan]) -> None:
    """``ConfigError`` naming the group, its estimate and the capacity when it cannot fit."""
    cap = plan.capacity
    for g, mem in zip(groups, plan.memory):
        if "generate" in g.tasks:
            _check_rollout_fit(cfg, plan, g.name, cap)
        if mem.total > cap:
            parts = ", ".join(f"{i.label} {gib(i.nbytes)}" for i in mem.items)
            raise ConfigError(
                f"group '{g.name}' does not fit: estimated {gib(mem.total)} per GPU "
                f"({parts}) exceeds the capacity {gib(cap)} (megarl train --gpu-memory-gib)")


def _check_rollout_fit(cfg: DictConfig, plan: RunPlan, name: str, cap: int) -> None:
    r = cfg.actor_rollout_ref.rollout
    weights, bucket = rollout_weights(cfg, plan.stages)
    share = r.gpu_memory_utilization * cap
    if weights + bucket > share:
        raise ConfigError(
            f"group '{name}' does not fit: rollout weights/TP{r.tensor_model_parallel_size} "
            f"{gib(weights)} + receive bucket {gib(bucket)} = {gib(weights + bucket)} per GPU "
            f"exceed {_ARR}.rollout.gpu_memory_utilization={r.gpu_memory_utilization} × "
            f"capacity {gib(cap)} = {gib(share)} (raise the rollout TP, the utilization or "
            "--gpu-memory-gib)")



def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
