"""The dry run's per-device memory estimate of each task group, and the fit check.

Owns the formulas (``FORMULAS``, printed with the plan) and their arithmetic: trainer
(params, gradients and optimizer state by their real dtypes, activations by what the layers and
the log-prob path keep, the weight-sync sender's buffers), reference, the logp replica, rollout
engines (weights, receive bucket, KV cache). ``check_fit`` raises ``ConfigError`` naming the
group that cannot fit. Inputs are the validated config, the model's shape (``ModelArgs``)
and the bucket plan (``megarl.controller.plan_records``, computed by the dry run); nothing
here starts anything. tools/bench_memory_estimate.py compares the trainer's estimate with the
peak of a real CPU train step.
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from megarl.backends.megatron.model import ModelArgs, padded_vocab_size, recompute_settings
from megarl.cluster.topology import GroupPlan
from megarl.config import ConfigError
from megarl.convert.plan import itemsize, stage_param_counts

from .micro_batches import micro_batch_tokens
from .plan_records import GroupMemory, MemoryItem, StageBuckets

GiB = 1 << 30
_ARR = "actor_rollout_ref"


def needs_ref(cfg: DictConfig) -> bool:
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


FORMULAS = [
    "N = parameters one device holds (largest PP stage, TP-sharded, padded vocab; of a "
    "mixture of experts num_experts/EP experts, each split over ETP), "
    "e = bytes per element of params_dtype",
    "s = data.max_prompt_length + data.max_response_length, h = hidden, V = padded vocab, "
    "L = layers per PP stage",
    "trainer   = N·e (params) + grads + optimizer + activations [+ sender buffers]; "
    "megatron.optimizer=megatron: grads N·4 (fp32 grad buffer), optimizer N·(4 fp32 main "
    "params if e<4 + 8 Adam m,v) / (DP if use_distributed_optimizer else 1; the experts' "
    "share / expert-DP = devices / (PP·EP·ETP)); optimizer=torch: grads N·e, AdamW N·2e",
    "sender buffers (the weight sync's sender, when its group is NCCL, i.e. on the GPU): "
    "rollout.enable_dual_buffer: the largest stage's HF bytes (snapshot), else its largest "
    "bucket (packing buffer)",
    "activations = max(train, logp): train = L·s·b·(6h (/TP with megatron.sequence_parallel)"
    " + 2·(heads + kv_heads)·head_dim/TP + 5·F/TP)·e [what the local layers save: norms' "
    "inputs and outputs, SDPA's q and output, K/V at the query groups' heads (under CP "
    "repeated to every head: 4·heads·head_dim/TP), SwiGLU; a mixture of experts 5·F_moe·k + 2·k·h + "
    "5·F_shared for the MLP; with gradient checkpointing each recomputed group keeps its "
    "input L·s·b·h·e (/TP with sequence parallelism) + one group live, alive in backward once "
    "the log-prob path is freed] + c_train·s·b·V/TP·4 on the last PP stage, the layers' term "
    "× PP micro-batches in flight on the first, b = actor.ppo_micro_batch_size_per_gpu; logp = "
    "c_logp·s·b'·V/TP·4, b' = rollout.log_prob_micro_batch_size_per_gpu; c = the fp32 vocab "
    "tensors the log-prob path holds at once (memory.logit_copies: training with entropy "
    "e/4 + 6.25, forward without e/4 + 3; with actor.entropy_from_logits_with_chunking "
    "the logits (and their gradient when training) in e/4 each + 2 fp32 chunks of "
    "entropy_from_logits_chunk_size tokens)",
    "with use_dynamic_bsz (packed micro-batches) s·b is the pass's token budget "
    "(*_max_token_len_per_gpu; at least s, as a longer sequence goes alone)",
    "context parallelism (megatron.context_parallel_size = CP): s·b above is one rank's "
    "share, s·b/CP (the budget counts per CP rank: at least s/CP), and training adds the "
    "K/V all-gathered over the CP group and repeated to every query head (CUDA's masked "
    "SDPA takes no GQA), L·s·b·2·heads·head_dim/TP·e with s·b the whole "
    "micro-batch's",
    "multi-latent attention (DeepSeek-V3): each layer's Q, K, V and attention output at "
    "their widths, s·b·(2·heads·(nope+rope) + 2·heads·v)/TP·e, in place of the attention "
    "term above, plus the latents s·b·(2·(q_lora + kv_lora) + rope)·e (/TP with SP); the "
    "engine's KV cache holds L·(kv_lora + rope)·e a token on every TP rank",
    "reference = N·e (params, ref layout) + c_logp·s·b·V/TP·4 (log-prob path), "
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
            items += trainer_memory(cfg, a, g.num_devices, stages)
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
    """One fp32 [tokens, V/TP] tensor."""
    tp = m.tensor_model_parallel_size
    vocab = padded_vocab_size(a.vocab_size, m.make_vocab_size_divisible_by, tp)
    return tokens * vocab // tp * 4


def logit_copies(training: bool, with_entropy: bool, e: int,
                 chunk_frac: float | None = None) -> float:
    """fp32 [tokens, V/TP] tensors alive at once at the peak of the log-prob path the worker
    takes (backends/megatron/logprobs.py), in units of one such tensor.

    The whole-micro-batch path (``vocab_parallel_logprobs``), counted from its code: the
    logits themselves (in the params' dtype, e/4 of an fp32 copy), z = logits.float() / T,
    z - max, and:

    - without entropy: exp(z - max) (kept for backward when training, else a temporary);
    - with entropy, forward only: p, its finite mask's zero-filled copy, p · finite, and
      isfinite's bool mask (1/4);
    - with entropy, training: exp(z - max) kept for backward besides those.

    Measured on CPU in fp32 (tools/bench_memory_estimate.py): 7.2 copies for a train step with
    entropy, against 7.25 here.

    The token-chunked path (``actor.entropy_from_logits_with_chunking``; `chunk_frac` = chunk
    size / tokens, at most 1) keeps no vocabulary-wide fp32 tensor for backward: the logits,
    their gradient when training (both in the params' dtype), and two fp32 chunks (a chunk's
    softmax and its product) at a time."""
    if chunk_frac is not None:
        return e / 4 * (2 if training else 1) + 2 * min(chunk_frac, 1.0)
    copies = e / 4 + 2  # logits, z, z - max
    if not with_entropy:
        return copies + 1
    return copies + 3.25 + (1 if training else 0)


def _pass_logits_bytes(cfg: DictConfig, a: ModelArgs, m: DictConfig, role: str, cp: int,
                       e: int) -> int:
    """The log-prob path's vocabulary tensors in a forward-only pass (no entropy) of `role`."""
    tokens = micro_batch_tokens(cfg, role, cp)
    return int(logit_copies(False, False, e, chunk_frac(cfg, tokens)) * _logits_bytes(a, m, tokens))


def chunk_frac(cfg: DictConfig, tokens: int) -> float | None:
    """The log-prob chunk's share of a pass's tokens, or None on the whole-micro-batch path
    (the actor's key, which the reference and the logp replica read too)."""
    actor = cfg.actor_rollout_ref.actor
    if not actor.entropy_from_logits_with_chunking:
        return None
    return min(1.0, int(actor.entropy_from_logits_chunk_size) / max(tokens, 1))


def layer_activation_elements(a: ModelArgs, tp: int, sp: bool) -> float:
    """Elements per token one transformer layer keeps for backward on one TP rank, counted
    from what megarl's local layers save (torch autograd's saved tensors of a Qwen2 layer,
    checked with saved-tensor hooks): each RMSNorm its input and its normalised input, each
    norm's output as the next linear's input (6·h, all sequence-parallel); SDPA its q and the
    attention output at every query head, K/V at the query groups' heads (``enable_gqa``); the
    attention output as the projection's input ((2·heads + 2·kv_heads)·head_dim / TP; under
    context parallelism see ``_activation_bytes``); the SwiGLU MLP fc1's
    gate+up output, silu(gate), the product as fc2's input and one more F-wide copy (5·F / TP).
    A mixture of experts: each token's top-k experts' 5·F_moe and the routed hidden states
    permuted in and out (2·k·h), plus a shared expert's 5·F_shared (not measured)."""
    attn = 2 * (a.num_heads + a.num_kv_heads) * a.head_dim / tp
    if a.is_mla:
        # Q and K at heads × (nope + rope), V and the output at heads × v (measured for the
        # plain layers only), and the latents (query, key/value, RoPE key) with their norms'
        # outputs
        n = a.num_heads
        attn = (2 * n * (a.qk_nope_head_dim + a.qk_rope_head_dim) + 2 * n * a.v_head_dim) / tp
        attn += (2 * (a.q_lora_rank + a.kv_lora_rank) + a.qk_rope_head_dim) / (tp if sp else 1)
    if a.is_moe:
        mlp = (5 * a.moe_ffn_hidden_size + 2 * a.hidden_size) * a.moe_topk \
            + 5 * a.moe_shared_ffn_hidden_size
    else:
        mlp = 5 * a.ffn_hidden_size
    return 6 * a.hidden_size / (tp if sp else 1) + attn + mlp / tp


def _activation_bytes(cfg: DictConfig, a: ModelArgs) -> int:
    arr = cfg.actor_rollout_ref
    m = arr.actor.megatron
    tp, pp, e = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, \
        itemsize(m.params_dtype)
    cp = m.context_parallel_size
    tokens = micro_batch_tokens(cfg, "actor", cp)
    # sequence parallelism shards the norms' and the residual stream's share over TP
    sp = bool(m.sequence_parallel) and tp > 1
    layer = tokens * layer_activation_elements(a, tp, sp) * e
    kept = tokens * a.hidden_size * e / (tp if sp else 1)  # a recomputed group's input
    layers = a.num_layers // pp
    rc = recompute_settings(m.override_transformer_config,
                            arr.model.enable_gradient_checkpointing)
    # training always computes the entropy (a metric even at entropy_coeff 0)
    logits = logit_copies(True, True, e, chunk_frac(cfg, tokens)) * _logits_bytes(a, m, tokens)
    full = rc is not None and rc["recompute_granularity"] == "full"
    if not full:
        # (SDPA keeps no attention scores, which is what selective recompute would save)
        stack, live = layers * layer, 0
    elif rc["recompute_method"] == "uniform":  # each group's input kept, one group live
        n = min(rc["recompute_num_layers"], layers)
        stack, live = -(-layers // n) * kept, n * layer
    else:  # block: the first n layers kept as inputs, the others whole, one recomputed live
        n = min(rc["recompute_num_layers"], layers)
        stack, live = n * kept + (layers - n) * layer, layer
    if cp > 1:
        # each layer keeps the K and V it gathered, of the whole sequence(s), repeated to every
        # query head: on CUDA the masked chunk calls cannot take enable_gqa (attention.py)
        stack += layers * tokens * cp * e * (kv_width(a, tp) if a.is_mla else
                                             2 * max(1, a.num_heads // tp) * a.head_dim)
    # the last stage: its micro-batch's layers beside the log-prob path; a recomputed group
    # comes alive in backward, once that path is freed
    last = stack + max(live, logits)
    # 1F1B: the first stage holds PP micro-batches in flight (and no log-prob path)
    train = max(last, pp * stack + live) if pp > 1 else last
    return int(max(train, _pass_logits_bytes(cfg, a, m, "logp", cp, e)))


def trainer_memory(cfg: DictConfig, a: ModelArgs, devices: int,
                   stages: list[StageBuckets] = ()) -> list[MemoryItem]:
    """The actor trainer's largest device: params, gradients and optimizer state by their
    real dtypes (``optimizer_state``), activations, and the weight-sync sender's buffers
    (``sender_buffers``) when they sit on the device."""
    m = cfg.actor_rollout_ref.actor.megatron
    (dense, experts), e = _rank_split(a, m), itemsize(m.params_dtype)
    n = dense + experts
    items = [MemoryItem(f"trainer params ({_count(n)} × {e} B)", n * e)]
    items += optimizer_state(m, dense, experts, devices, a.is_moe)
    items.append(MemoryItem("trainer activations", _activation_bytes(cfg, a)))
    return items + sender_buffers(cfg, stages)


def optimizer_state(m: DictConfig, dense: int, experts: int, devices: int,
                    is_moe: bool) -> list[MemoryItem]:
    """Gradients and optimizer state of one rank holding `dense` + `experts` parameters.

    ``optimizer: megatron`` (backends/megatron/optim.py): Megatron's DDP reduces into an fp32
    grad buffer of every parameter (grad_reduce_in_fp32); Adam's two fp32 moments and, for
    bf16/fp16 params, fp32 main params (in fp32 the params are their own main params), sharded
    over DP × CP with the distributed optimizer (the experts' over expert-DP).
    ``optimizer: torch``: AdamW on the model's own params: grads and both moments in the
    params' dtype, unsharded."""
    e, n = itemsize(m.params_dtype), dense + experts
    if m.optimizer == "torch":
        return [MemoryItem(f"trainer grads ({e} B, params' dtype)", n * e),
                MemoryItem(f"trainer optimizer (AdamW m, v: 2 × {e} B/param)", 2 * e * n)]
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    # the distributed optimizer shards over DP × CP (Megatron's), i.e. devices / (TP·PP)
    dp = devices // (tp * pp)
    # the experts' state shards over their own data-parallel ranks (Megatron's expert-DP)
    edp = devices // (pp * (m.expert_model_parallel_size if is_moe else 1)
                      * (m.expert_tensor_parallel_size or tp))
    shard, eshard = (dp, edp) if m.use_distributed_optimizer else (1, 1)
    state = (4 if e < 4 else 0) + 8
    per = f"/ {shard}" if not experts or shard == eshard else f"/ {shard}, experts / {eshard}"
    return [MemoryItem("trainer fp32 main grads", n * 4),
            MemoryItem(f"trainer optimizer ({state} B/param {per})",
                       dense * state // shard + experts * state // eshard)]


def sender_buffers(cfg: DictConfig, stages: list[StageBuckets]) -> list[MemoryItem]:
    """What the weight sync's sender (TP rank 0 of each pipeline stage's first DP replica,
    weight_sync/trainer.py) keeps between versions, where its update group is NCCL (its
    buffers are then on the GPU; under gloo they are host memory): with the dual buffer the
    whole stage packed into snapshot buffers (producer.py ``snapshot``, the largest stage's
    bytes), else one reusable packing buffer of the largest bucket (``stream``)."""
    r = cfg.actor_rollout_ref.rollout
    backend = r.update_group_backend
    if backend == "auto":  # not resolved by the loader: its CPU/GPU default
        backend = "nccl" if cfg.trainer.device == "cuda" else "gloo"
    if backend != "nccl" or not stages:
        return []
    if r.enable_dual_buffer:
        return [MemoryItem("weight-sync snapshot (dual buffer)",
                           max(s.total for s in stages))]
    return [MemoryItem("weight-sync packing buffer",
                       max(s.largest for s in stages))]


def reference_memory(cfg: DictConfig, a: ModelArgs) -> list[MemoryItem]:
    ref = cfg.actor_rollout_ref.ref
    n, e = _rank_params(a, ref.megatron), itemsize(ref.megatron.params_dtype)
    return [MemoryItem(f"reference params ({_count(n)} × {e} B)", n * e),
            MemoryItem("reference logits", _pass_logits_bytes(
                cfg, a, ref.megatron, "ref", ref.megatron.context_parallel_size, e))]


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
            MemoryItem("replica logits", _pass_logits_bytes(
                cfg, a, m, "logp", m.context_parallel_size, e))]


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


def check_fit(cfg: DictConfig, groups: list[GroupPlan], memory: list[GroupMemory],
              stages: list[StageBuckets], cap: int) -> None:
    """``ConfigError`` naming the group, its estimate and the capacity `cap` (bytes) when it
    cannot fit; `memory` is ``estimate_memory``'s, group by group."""
    for g, mem in zip(groups, memory):
        if "generate" in g.tasks:
            _check_rollout_fit(cfg, stages, g.name, cap)
        if mem.total > cap:
            parts = ", ".join(f"{i.label} {gib(i.nbytes)}" for i in mem.items)
            raise ConfigError(
                f"group '{g.name}' does not fit: estimated {gib(mem.total)} per GPU "
                f"({parts}) exceeds the capacity {gib(cap)} (megarl train --gpu-memory-gib)")


def _check_rollout_fit(cfg: DictConfig, stages: list[StageBuckets], name: str,
                       cap: int) -> None:
    r = cfg.actor_rollout_ref.rollout
    weights, bucket = rollout_weights(cfg, stages)
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
