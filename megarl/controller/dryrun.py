"""`megarl train --dry-run`: the plan of a run, computed without starting anything.

This module owns the dry run: from a validated config and the model's HF ``config.json`` alone
(no weights, no Ray, no GPU), it works out

- placement: which nodes and devices each task group holds and what runs there (trainer with
  its TP/PP/DP, reference, one rollout server per replica with its node and GPUs; of a mixture
  of experts, each Megatron model's EP/ETP, experts per EP rank and expert-data-parallel width);
- each rollout server's command line (``megarl.backends.sglang.launcher.build_command``);
- the weight-update group ranks (``megarl.weight_sync.protocol.update_group_ranks``), one
  group per pipeline stage;
- the bucket plan per pipeline stage (``megarl.weight_sync.buckets.plan_buckets`` over the HF
  tensors each stage exports, in export order, which for experts depends on the actor's EP);
- a per-device memory estimate per group (``megarl.controller.memory``), whose formulas
  ``format_plan`` prints with it.

``plan_run`` returns a ``RunPlan`` or raises ``ConfigError`` when the plan cannot work (a
group over the device capacity, rollout weights over their memory share, a replica that would
span nodes). ``format_plan`` renders the plan as text. Nothing here prints.
"""
from __future__ import annotations

import json
import logging
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from megarl.backends.megatron.model import ModelArgs
from megarl.cluster.topology import GroupPlan
from megarl.config import ConfigError, plan_task_groups
from megarl.convert.plan import ConvertError, check_layout, hf_shapes
from megarl.weight_sync.buckets import plan_buckets
from megarl.weight_sync.protocol import MiB, TensorSpec, update_group_ranks

from .memory import FORMULAS, GiB, check_fit, estimate_memory, gib, needs_ref, replica_megatron
from .plan_records import GroupMemory, StageBuckets

logger = logging.getLogger(__name__)

_ARR = "actor_rollout_ref"
PORT_BASE = 30000  # placeholder ports in the printed commands: real ones are chosen at launch
UPDATE_GROUP_NAME = "megarl-weights"  # as megarl.weight_sync.trainer names it, + "-pp<stage>"
# Norm weights stay float32 in megarl's Megatron model (the local spec's torch RMSNorm takes
# no dtype), and the producer sends them as they are.
# (Qwen3's per-head q_norm / k_norm included.)
_FP32_SUFFIXES = ("norm.weight", "e_score_correction_bias")


# ------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Server:
    index: int
    node: int
    gpus: tuple[int, ...]
    """Local device ids on ``node``; ``gpus[0]`` is the server's ``--base-gpu-id``."""
    command: tuple[str, ...] = ()
    url: str | None = None
    """Set instead of ``command`` when ``rollout.server_urls`` names running servers."""


@dataclass(frozen=True)
class Placement:
    group: GroupPlan
    devices_per_node: int
    roles: tuple[str, ...]
    """What runs on the group, one line each."""

    def local_devices(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for d in self.group.devices:
            out.setdefault(d // self.devices_per_node, []).append(d % self.devices_per_node)
        return out


@dataclass(frozen=True)
class UpdateGroup:
    stage: int
    name: str
    offsets: tuple[int, ...]
    world_size: int
    sender_device: int
    """Global device of the stage's sender (TP rank 0 of the stage, first DP replica)."""


@dataclass
class RunPlan:
    hf_config: str
    model: ModelArgs
    device: str
    launcher: str
    placements: list[Placement]
    rollout_name: str
    servers: list[Server]
    rollout_tp: int
    update_groups: list[UpdateGroup]
    stages: list[StageBuckets]
    produce_mb: int
    consume_mb: int
    memory: list[GroupMemory]
    capacity: int
    """Bytes of one device (``--gpu-memory-gib``)."""
    formulas: list[str]
    notes: list[str] = field(default_factory=list)


def plan_run(cfg: DictConfig, gpu_memory_gib: float = 80.0) -> RunPlan:
    """The run's plan; raises ``ConfigError`` when it cannot fit or cannot be placed."""
    arr, t = cfg.actor_rollout_ref, cfg.trainer
    groups = plan_task_groups(cfg)
    hf, source = load_hf_config(cfg)
    a = _model_args(hf, source)
    actor = arr.actor.megatron
    _check_layout(a, actor, f"{_ARR}.actor.megatron", source)
    if needs_ref(cfg):
        _check_layout(a, arr.ref.megatron, f"{_ARR}.ref.megatron", source)
    if "actor-train" not in _hosting(groups, "logp").tasks:
        # the replica's own TP/PP, the actor's expert layout
        _check_layout(a, replica_megatron(cfg), f"{_ARR}.logp", source,
                      f"{_ARR}.actor.megatron")
    gen = _hosting(groups, "generate")
    servers = plan_servers(cfg, gen)
    stages = plan_stage_buckets(a, actor.pipeline_model_parallel_size, actor.params_dtype,
                                arr.rollout.param_update_consume_bucket_size_mb * MiB,
                                _expert_parallel(a, actor))
    capacity = int(gpu_memory_gib * GiB)
    plan = RunPlan(
        hf_config=source, model=a, device=t.device, launcher=t.launcher,
        placements=[Placement(g, t.n_gpus_per_node, roles(cfg, g, a)) for g in groups],
        rollout_name=arr.rollout.name, servers=servers,
        rollout_tp=arr.rollout.tensor_model_parallel_size,
        update_groups=plan_update_groups(cfg, groups, len(servers)), stages=stages,
        produce_mb=arr.rollout.param_update_preduce_bucket_size_mb,
        consume_mb=arr.rollout.param_update_consume_bucket_size_mb,
        memory=estimate_memory(cfg, groups, a, stages, capacity), capacity=capacity,
        formulas=list(FORMULAS), notes=_notes(cfg))
    check_fit(cfg, groups, plan.memory, stages, capacity)
    logger.debug("dry run: %d group(s), %d rollout server(s), %d pipeline stage(s)",
                 len(groups), len(servers), len(stages))
    return plan


def _hosting(groups: list[GroupPlan], task: str) -> GroupPlan:
    return next(g for g in groups if task in g.tasks)


def _notes(cfg: DictConfig) -> list[str]:
    notes = []
    from megarl.backends.megatron.model import recompute_settings

    arr = cfg.actor_rollout_ref
    rc = recompute_settings(arr.actor.megatron.override_transformer_config,
                            arr.model.enable_gradient_checkpointing)
    if rc is not None:
        notes.append("the actor recomputes activations in backward: " +
                     ", ".join(f"{k.removeprefix('recompute_')}={v}" for k, v in rc.items()))
    if cfg.trainer.launcher == "torchrun":
        notes.append("trainer.launcher=torchrun: one process per device, started by "
                     "launch/torchrun.sh; global rank = device index")
    return notes


# ------------------------------------------------------------------------------ the model
def load_hf_config(cfg: DictConfig) -> tuple[dict, str]:
    """The model's HF config (with ``model.override_config`` applied) and where it came from:
    ``model.hf_config_path``, else ``model.path``/config.json, else (``model.make_tiny``) the
    tiny model's, made in a temporary directory."""
    model = cfg.actor_rollout_ref.model
    path = Path(model.hf_config_path or Path(model.path) / "config.json")
    if path.is_file():
        hf, source = _read_json(path), str(path)
    elif model.make_tiny and not model.hf_config_path:
        hf, source = _tiny_config(model.make_tiny), f"tiny {model.make_tiny} model (made at run)"
    else:
        key = "hf_config_path" if model.hf_config_path else "path"
        raise ConfigError(f"{_ARR}.model.{key}: no config.json at {path} (set {_ARR}.model."
                          "hf_config_path to plan without the model's files)")
    hf.update(OmegaConf.to_container(model.override_config))
    return hf, source


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{_ARR}.model: {path} is not valid JSON ({err})") from None


def _tiny_config(arch: str) -> dict:
    """The config.json ``make_tiny_model`` writes (its vocabulary is the trained tokenizer's)."""
    from megarl.utils.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="megarl-dryrun-") as tmp:
        out = make_tiny_model(Path(tmp) / "model", arch)
        return _read_json(out / "config.json")


def _model_args(hf: dict, source: str) -> ModelArgs:
    try:
        return ModelArgs.from_hf(hf)
    except KeyError as err:
        raise ConfigError(f"{_ARR}.model: {source}: missing field {err.args[0]!r}") from None
    except ValueError as err:
        raise ConfigError(f"{_ARR}.model: {source}: {err}") from None


def _check_layout(a: ModelArgs, megatron: DictConfig, key: str, source: str,
                  expert_key: str | None = None) -> None:
    """The converter's layout check of the model from `source`, its flags named as `key`'s
    config keys (the expert ones as `expert_key`'s: a logp replica runs the actor's)."""
    expert_key = expert_key or key
    try:
        check_layout(a, megatron.tensor_model_parallel_size,
                     megatron.pipeline_model_parallel_size, megatron.make_vocab_size_divisible_by,
                     source, ep=megatron.expert_model_parallel_size,
                     etp=megatron.expert_tensor_parallel_size)
    except ConvertError as err:
        text = str(err)
        for flag, k in (("--etp ", f"{expert_key}.expert_tensor_parallel_size="),
                        ("--ep ", f"{expert_key}.expert_model_parallel_size=")):
            if text.startswith(flag):  # the converter's flag check: it names the key
                raise ConfigError(k + text[len(flag):]) from None
        raise ConfigError(f"{key}: {text}") from None


def _expert_parallel(a: ModelArgs, m: DictConfig) -> int:
    """A Megatron section's EP for model `a` (1 for a dense model, whatever the key says)."""
    return m.expert_model_parallel_size if a.is_moe else 1


# ------------------------------------------------------------------------------ placement
def roles(cfg: DictConfig, g: GroupPlan, a: ModelArgs | None = None) -> tuple[str, ...]:
    """What runs on a group, one line per role (with `a` a mixture of experts: each Megatron
    model's expert placement too)."""
    arr = cfg.actor_rollout_ref
    out = []
    if "actor-train" in g.tasks:
        out.append("trainer (" + "+".join(x for x in g.tasks if x in ("logp", "actor-train"))
                   + "): " + _parallel(arr.actor.megatron, g.num_devices, a))
    elif "logp" in g.tasks:
        out.append("actor replica (logp, fed by the weight sync): "
                   + _parallel(replica_megatron(cfg), g.num_devices, a))
    if "ref_logp" in g.tasks and needs_ref(cfg):
        out.append("reference (ref_logp): " + _parallel(arr.ref.megatron, g.num_devices, a))
    elif "ref_logp" in g.tasks:
        out.append("reference (ref_logp): not run (no actor.use_kl_loss or "
                   "algorithm.use_kl_in_reward)")
    if cfg.algorithm.adv_estimator == "gae":
        from megarl.config.validate import critic_hosted, plan_task_groups

        if critic_hosted(plan_task_groups(cfg)).name == g.name:
            out.append("critic (values, value-loss training): "
                       + _parallel(cfg.critic.megatron, g.num_devices, a))
    if "generate" in g.tasks:
        tp = arr.rollout.tensor_model_parallel_size
        out.append(f"rollout (generate): {arr.rollout.name}, {g.num_devices // tp} "
                   f"replica(s) × TP{tp}")
    if "reward" in g.tasks:
        out.append(f"reward: CPU pool of {cfg.reward.num_workers} processes")
    return tuple(out)


def _parallel(m: DictConfig, devices: int, a: ModelArgs | None = None) -> str:
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    cp = m.get("context_parallel_size") or 1
    dist = ", distributed optimizer" if m.use_distributed_optimizer else ""
    # Megatron turns sequence parallelism off at TP1 (model.transformer_config)
    sp = " + SP" if m.get("sequence_parallel") and tp > 1 else ""
    # CP ranks hold the same weights but split each sequence, so they are not data-parallel
    # replicas: DP is what is left of the group after TP × CP × PP
    cps = f" × CP{cp}" if cp > 1 else ""
    text = f"TP{tp}{sp}{cps} × PP{pp} × DP{devices // (tp * cp * pp)}, {m.params_dtype}{dist}"
    if a is None or not a.is_moe:
        return text
    return f"{text}; {_experts(m, devices, a)}"


def _experts(m: DictConfig, devices: int, a: ModelArgs) -> str:
    """Megatron's expert placement: EP ranks each holding num_experts / EP experts, each
    expert split over ETP ranks; a stage's ranks / (EP × ETP) replicas of every expert (the
    expert-data-parallel width, over which the experts' gradients reduce and, with the
    distributed optimizer, their optimizer state shards)."""
    ep, pp = m.expert_model_parallel_size, m.pipeline_model_parallel_size
    etp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
    return (f"experts EP{ep} × ETP{etp}: {a.num_experts // ep} of {a.num_experts} per EP rank, "
            f"expert-DP{devices // (pp * ep * etp)}")


def plan_servers(cfg: DictConfig, gen: GroupPlan) -> list[Server]:
    """One server per rollout replica of the generate group, or the configured URLs."""
    r, per_node = cfg.actor_rollout_ref.rollout, cfg.trainer.n_gpus_per_node
    tp = r.tensor_model_parallel_size
    urls = list(r.server_urls or [])
    if urls:
        return [Server(i, -1, (), url=u) for i, u in enumerate(urls)]
    servers = []
    for i in range(gen.num_devices // tp):
        devices = gen.devices[i * tp:(i + 1) * tp]
        nodes = sorted({d // per_node for d in devices})
        if len(nodes) > 1:
            raise ConfigError(
                f"{_ARR}.rollout.tensor_model_parallel_size: replica {i} of group "
                f"'{gen.name}' would span nodes {nodes} (TP{tp} does not divide "
                f"trainer.n_gpus_per_node={per_node})")
        gpus = tuple(d % per_node for d in devices)
        servers.append(Server(i, nodes[0], gpus, tuple(server_command(cfg, i, gpus[0]))))
    return servers


def server_command(cfg: DictConfig, index: int, base_gpu_id: int) -> list[str]:
    """The command line megarl's launcher runs for replica `index` (port: a placeholder)."""
    from megarl.backends.sglang.launcher import (EMBEDDED_MODULE, build_command, module_for,
                                                 replica_server_args)

    r = cfg.actor_rollout_ref.rollout
    module = module_for(r) if r.name == "sglang" else EMBEDDED_MODULE
    # Several nodes: the server binds its node's own address, known only at launch.
    host = "127.0.0.1" if cfg.trainer.nnodes == 1 else "NODE_ADDRESS"
    args = replica_server_args(cfg, index, host=host, port=PORT_BASE + index,
                               base_gpu_id=base_gpu_id)
    return build_command(args, module=module)


def plan_update_groups(cfg: DictConfig, groups: list[GroupPlan],
                       num_engines: int) -> list[UpdateGroup]:
    """One weight-update group per pipeline stage, each over the same engine ranks."""
    m = cfg.actor_rollout_ref.actor.megatron
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    trainer = _hosting(groups, "actor-train")
    dp = trainer.num_devices // (tp * pp)
    offsets, world = update_group_ranks([cfg.actor_rollout_ref.rollout
                                         .tensor_model_parallel_size] * num_engines)
    # Megatron's rank order is tp-dp-pp (pp outermost): stage s starts at rank s·TP·DP.
    return [UpdateGroup(s, f"{UPDATE_GROUP_NAME}-pp{s}", tuple(offsets), world,
                        trainer.devices[s * tp * dp]) for s in range(pp)]


# ------------------------------------------------------------------------------ buckets
def stage_specs(a: ModelArgs, pp: int, params_dtype: str,
                ep: int = 1) -> list[list[TensorSpec]]:
    """The HF tensors each pipeline stage exports, in export order (Megatron's
    ``named_parameters``: embedding, then per layer norm, o_proj, q/k/v weights, q/k/v
    biases, q/k norms, norm, gate, up, down, or the router and the experts in the order
    `ep` EP ranks export them; then the final norm and lm_head). A tied lm_head is not
    sent; layers split evenly over the stages."""
    shapes = hf_shapes(a)
    per_stage = a.num_layers // pp
    stages: list[list[str]] = [[] for _ in range(pp)]
    stages[0].append("model.embed_tokens.weight")
    for i in range(a.num_layers):
        stages[i // per_stage] += _layer_export_order(a, i, ep)
    stages[-1].append("model.norm.weight")
    if not a.tie_word_embeddings:
        stages[-1].append("lm_head.weight")
    if a.moe_expert_bias:  # buffers, exported after every parameter (hf/live.named_tensors)
        for i in range(a.first_k_dense, a.num_layers):
            stages[i // per_stage].append(f"model.layers.{i}.mlp.gate.e_score_correction_bias")
    return [[TensorSpec(n, _dtype_of(n, params_dtype), shapes[n]) for n in names]
            for names in stages]


def _layer_export_order(a: ModelArgs, i: int, ep: int = 1) -> list[str]:
    p = f"model.layers.{i}."
    names = [p + "input_layernorm.weight", p + "self_attn.o_proj.weight"]
    if a.is_mla:  # Megatron's MLA order: the linears, then the latent norms
        q = ["q_a_proj", "q_b_proj"] if a.q_lora_rank else ["q_proj"]
        names += [f"{p}self_attn.{x}.weight" for x in q + ["kv_a_proj_with_mqa", "kv_b_proj"]]
        names += [f"{p}self_attn.{x}.weight"
                  for x in (["q_a_layernorm"] if a.q_lora_rank else []) + ["kv_a_layernorm"]]
    else:
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
    if a.qkv_bias:
        names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
    if a.qk_norm:
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    names.append(p + "post_attention_layernorm.weight")
    if a.is_moe and i >= a.first_k_dense:
        names.append(p + "mlp.gate.weight")  # the router
        names += _expert_export_order(a, p, ep)
        if a.moe_shared_ffn_hidden_size:
            names += [f"{p}mlp.shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")]
        return names
    return names + [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                    p + "mlp.down_proj.weight"]


def _expert_export_order(a: ModelArgs, p: str, ep: int) -> list[str]:
    """A layer's experts as hf/live.py's export yields them: each EP rank holds L = num_experts
    / EP consecutive experts (global index rank·L + i), and for each local index i, in
    Megatron's parameter order (local_experts.i.linear_fc1, then .linear_fc2), the EP group
    gathers that parameter of every rank: fc1 gives experts i, i+L, i+2L, ... each as gate then
    up, fc2 the same experts' down. At EP=1: each expert's gate, up, down."""
    local = a.num_experts // ep
    names = []
    for i in range(local):
        experts = [r * local + i for r in range(ep)]
        names += [f"{p}mlp.experts.{e}.{x}_proj.weight" for e in experts for x in ("gate", "up")]
        names += [f"{p}mlp.experts.{e}.down_proj.weight" for e in experts]
    return names


def _dtype_of(name: str, params_dtype: str) -> str:
    return "float32" if name.endswith(_FP32_SUFFIXES) else params_dtype


def plan_stage_buckets(a: ModelArgs, pp: int, params_dtype: str,
                       bucket_bytes: int, ep: int = 1) -> list[StageBuckets]:
    per_stage = a.num_layers // pp
    return [StageBuckets(s, range(s * per_stage, (s + 1) * per_stage),
                         tuple(plan_buckets(specs, bucket_bytes, stage=s)))
            for s, specs in enumerate(stage_specs(a, pp, params_dtype, ep))]


# ------------------------------------------------------------------------------ text
def mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def format_plan(plan: RunPlan) -> str:
    """The plan as text, one section per question a user asks before a run."""
    sections = [_header(plan), _placement(plan), _servers(plan), _update_groups(plan),
                _buckets(plan), _memory(plan)]
    if plan.notes:
        sections.append("\n".join(["Notes:"] + [f"  - {n}" for n in plan.notes]))
    return "\n\n".join(sections) + "\n"


def _header(plan: RunPlan) -> str:
    a = plan.model
    ffn = (f"{a.num_experts} experts (top-{a.moe_topk}, ffn {a.moe_ffn_hidden_size})"
           if a.is_moe else f"ffn {a.ffn_hidden_size}")
    heads = (f"{a.num_heads} heads, multi-latent attention (q/kv latents "
             f"{a.q_lora_rank or '-'}/{a.kv_lora_rank}, qk {a.qk_nope_head_dim}+"
             f"{a.qk_rope_head_dim} rope, v {a.v_head_dim})" if a.is_mla else
             f"heads {a.num_heads}/{a.num_kv_heads} kv")
    return "\n".join([
        "megarl train --dry-run: nothing is started",
        f"  model: {a.arch}, {a.num_layers} layers, hidden {a.hidden_size}, {heads}, {ffn}, "
        f"vocab {a.vocab_size}"
        f"{', tied embeddings' if a.tie_word_embeddings else ''} (from {plan.hf_config})",
        f"  device: {plan.device}, launcher: {plan.launcher}"])


def _placement(plan: RunPlan) -> str:
    lines = ["Placement:"]
    for p in plan.placements:
        g = p.group
        where = "; ".join(f"node {n} GPUs {_span(ids)}" for n, ids in p.local_devices().items())
        lines.append(f"  group '{g.name}': {g.num_devices} device(s) "
                     f"{_span(list(g.devices))}: {where}")
        lines += [f"    {r}" for r in p.roles]
    if not any("reward" in p.group.tasks for p in plan.placements):
        lines.append("  reward: CPU process pool on the driver")
    return "\n".join(lines)


def _span(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


def _servers(plan: RunPlan) -> str:
    tp = plan.rollout_tp
    if plan.servers and plan.servers[0].url is not None:
        lines = [f"Rollout servers: {len(plan.servers)} given by rollout.server_urls "
                 f"(TP{tp} each), none launched:"]
        return "\n".join(lines + [f"  engine {s.index}: {s.url}" for s in plan.servers])
    lines = [f"Rollout servers: {len(plan.servers)} × TP{tp} ({plan.rollout_name}); "
             f"ports {PORT_BASE}+i are placeholders, chosen free at launch"]
    if plan.rollout_name == "embedded":
        lines.append("  (embedded: each engine is served in-process by its worker; the "
                     "command is the equivalent standalone server)")
    for s in plan.servers:
        lines.append(f"  server {s.index}: node {s.node}, GPUs {_span(list(s.gpus))}, "
                     f"base_gpu_id {s.gpus[0]}")
        lines.append("    " + " ".join(s.command))
    return "\n".join(lines)


def _update_groups(plan: RunPlan) -> str:
    lines = ["Weight-update groups, one per pipeline stage (rank 0 is the stage's sender; "
             "engine i's TP rank r joins as offset_i + r):"]
    per_node = plan.placements[0].devices_per_node
    for u in plan.update_groups:
        node, gpu = divmod(u.sender_device, per_node)
        lines.append(f"  {u.name}: world {u.world_size}, rank_offsets {list(u.offsets)}; "
                     f"sender: TP rank 0 of stage {u.stage}, device {u.sender_device} "
                     f"(node {node} GPU {gpu})")
    return "\n".join(lines)


def _buckets(plan: RunPlan) -> str:
    lines = [f"Weight buckets: receive buckets of ≤ {plan.consume_mb} MiB "
             f"(param_update_consume_bucket_size_mb; a larger tensor travels alone), "
             f"trainer-side gather window {plan.produce_mb} MiB "
             "(param_update_preduce_bucket_size_mb)"]
    for s in plan.stages:
        dtypes = sorted({sp.dtype for b in s.buckets for sp in b.specs})
        lines.append(f"  stage {s.stage} (layers {s.layers.start}-{s.layers.stop - 1}): "
                     f"{s.num_tensors} tensors, {len(s.buckets)} bucket(s), largest "
                     f"{mib(s.largest)}, total {mib(s.total)} ({', '.join(dtypes)})")
    return "\n".join(lines)


def _memory(plan: RunPlan) -> str:
    cap = plan.capacity
    lines = [f"Memory per GPU (estimate; capacity {gib(cap)}, --gpu-memory-gib):"]
    for m in plan.memory:
        lines.append(f"  group '{m.group}': {gib(m.total)} of {gib(cap)}"
                     f"{'' if m.items else ' (no model)'}")
        lines += [f"    {i.label:<40} {gib(i.nbytes):>10}" for i in m.items]
    lines.append("  formulas:")
    for f in plan.formulas:
        lines += textwrap.wrap(f, 100, initial_indent="    ", subsequent_indent="        ",
                               break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)
