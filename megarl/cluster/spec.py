"""What each worker is told: its own frozen, typed spec, resolved once on the driver.

A worker process never receives the run's config. The driver resolves, once, what each kind
of worker needs (its model and layout, its loss settings, its weight-sync settings, a launched
server's arguments), with every default that depends on another key settled here (a null
`loss_scale_factor` is the response budget, a critic's null `loss_agg_mode` the actor's; the
loader has already given a null logp layout the actor's). What crosses the process boundary
is then small and explicit, and a key a worker does not read cannot change what it does.
"""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from megarl.algo.actor_loss import ActorLossSettings
from megarl.backends.megatron import model as mmodel
from megarl.backends.megatron.model import MoESettings, recompute_settings
from megarl.backends.megatron.optim import OptimConfig
from megarl.backends.sglang.launcher import ServerArgs, module_for, replica_server_args
from megarl.utils.errors import ConfigError
from megarl.weight_sync.protocol import SyncConfig

ROLES = ("actor", "ref", "logp", "critic")


@dataclass(frozen=True)
class ModelSpec:
    """What a `MegatronWorker` is built from."""

    path: str
    tp: int
    pp: int
    params_dtype: str
    make_vocab_size_divisible_by: int
    seed: int
    optim: OptimConfig | None  # None: frozen (ref, logp replica)
    value_model: bool = False  # the critic: a value head instead of the LM head
    transformer_impl: str = "auto"  # auto | local | transformer_engine
    collective_timeout_s: float = 1800.0  # its process groups' (trainer.state_timeout_s)
    moe: MoESettings = MoESettings()  # expert layout and routing (a mixture of experts only)
    recompute: dict | None = None  # Megatron's recompute settings (a model that trains)
    sequence_parallel: bool = False  # Megatron's SP (`<section>.megatron.sequence_parallel`)
    context_parallel: int = 1  # CP ranks (`<section>.megatron.context_parallel_size`)
    vpp: int | None = None  # model chunks per stage (`<section>.megatron.virtual_pipeline_...`)
    # `<section>.megatron.override_transformer_config.attention_backend` (attention.py)
    attention_backend: str = "auto"
    # Megatron's fusions set in `override_transformer_config` ({name: bool}; unset: off)
    fusions: dict | None = None
    logprob_chunk_size: int | None = None  # tokens per log-prob chunk (None: unchunked)


@dataclass(frozen=True)
class CriticLossSpec:
    cliprange_value: float
    loss_agg_mode: str          # null in the config: the actor's
    max_response_length: int


@dataclass(frozen=True)
class MegatronSpec:
    """One Megatron model's workers (every rank of the model gets the same spec)."""

    role: str
    model: ModelSpec
    hf_path: str  # the actor's HF model: what a logp replica's weight receiver starts from
    actor_loss: ActorLossSettings | None = None  # the actor only
    critic_loss: CriticLossSpec | None = None  # the critic only
    sync: SyncConfig | None = None             # the actor only: it sends weights


@dataclass(frozen=True)
class ServerSpec:
    """A launched rollout server (one per rollout replica). `args` leave the address, port
    and GPU to the worker, which knows its node."""

    index: int
    args: ServerArgs
    module: str
    start_timeout_s: float


def _optim(cfg, section: str, schedule_steps: int | None) -> OptimConfig:
    """`section`'s optimizer; a null `optim.total_training_steps` is `schedule_steps`."""
    node = OmegaConf.select(cfg, section)
    optim = node.optim
    steps = optim.total_training_steps or schedule_steps
    if optim.lr_decay_style != "constant" and (steps or 0) <= optim.lr_warmup_steps:
        raise ConfigError(
            f"{section}.optim.lr_decay_style={optim.lr_decay_style} decays over the run's "
            f"{steps} training steps ({section}.optim.total_training_steps, null: the "
            f"trainer's), which must be more than {section}.optim.lr_warmup_steps="
            f"{optim.lr_warmup_steps}")
    return OptimConfig.from_config(optim, node.megatron, schedule_steps)


def moe_settings(m, replay: bool = False) -> MoESettings:
    """A Megatron section's expert layout and router settings (`replay`: the routers take
    the rollout's experts, R3)."""
    o = m.override_transformer_config
    return MoESettings(ep=int(m.expert_model_parallel_size),
                       etp=m.expert_tensor_parallel_size,
                       aux_loss_coeff=float(o.moe_aux_loss_coeff),
                       z_loss_coeff=o.moe_z_loss_coeff,
                       token_dispatcher=o.moe_token_dispatcher_type,
                       capacity_factor=o.moe_expert_capacity_factor,
                       token_drop_policy=o.moe_token_drop_policy, routing_replay=replay)


def fusion_settings(overrides) -> dict | None:
    """Megatron's fusions a section's `override_transformer_config` sets (None: none)."""
    out = {k: bool(overrides[k]) for k in mmodel.FUSION_KEYS if overrides[k] is not None}
    return out or None


def megatron_spec(cfg, role: str, schedule_steps: int | None = None) -> MegatronSpec:
    """The spec of the `role` model's workers from the run config. `schedule_steps`: the
    trainer's total steps, the LR schedule's length where the config leaves it null (None: a
    constant schedule only, e.g. a run that does not train)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    arr = cfg.actor_rollout_ref
    if role == "critic":
        c = cfg.critic
        m = c.megatron
        model = ModelSpec(c.model.path or arr.model.path, m.tensor_model_parallel_size,
                          m.pipeline_model_parallel_size, m.params_dtype,
                          m.make_vocab_size_divisible_by, m.seed,
                          _optim(cfg, "critic", schedule_steps), value_model=True,
                          transformer_impl=m.transformer_impl,
                          collective_timeout_s=float(cfg.trainer.state_timeout_s),
                          moe=moe_settings(m),
                          recompute=recompute_settings(m.override_transformer_config, False),
                          sequence_parallel=bool(m.sequence_parallel),
                          context_parallel=int(m.context_parallel_size),
                          vpp=m.virtual_pipeline_model_parallel_size,
                          attention_backend=m.override_transformer_config.attention_backend,
                          fusions=fusion_settings(m.override_transformer_config))
        loss = CriticLossSpec(float(c.cliprange_value),
                              c.loss_agg_mode or arr.actor.loss_agg_mode,
                              int(cfg.data.max_response_length))
        return MegatronSpec(role, model, arr.model.path, critic_loss=loss)
    m = arr.ref.megatron if role == "ref" else arr.actor.megatron
    # the replica's own layout: actor_rollout_ref.logp, whose nulls the loader resolved
    layout = arr.logp if role == "logp" else m
    tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    trains = role == "actor"
    optim = _optim(cfg, "actor_rollout_ref.actor", schedule_steps) if trains else None
    # R3: the actor and its logp replica route as the engines did; the reference routes
    # by itself (its KL is against its own computation)
    replay = role != "ref" and arr.actor.router_replay.mode == "R3"
    model = ModelSpec(arr.model.path, tp, pp, m.params_dtype, m.make_vocab_size_divisible_by,
                      m.seed, optim, transformer_impl=m.transformer_impl,
                      collective_timeout_s=float(cfg.trainer.state_timeout_s),
                      moe=moe_settings(m, replay),
                      recompute=recompute_settings(m.override_transformer_config,
                                                   arr.model.enable_gradient_checkpointing)
                      if trains else None,
                      # a logp replica runs the actor's setting at its own TP
                      sequence_parallel=bool(m.sequence_parallel),
                      context_parallel=int(m.context_parallel_size),
                      # a logp replica has its own PP (actor_rollout_ref.logp), no chunks
                      vpp=None if role == "logp" else m.virtual_pipeline_model_parallel_size,
                      attention_backend=m.override_transformer_config.attention_backend,
                      fusions=fusion_settings(m.override_transformer_config),
                      # verl's ref follows the actor's key by default; megarl reads it for all
                      logprob_chunk_size=int(arr.actor.entropy_from_logits_chunk_size)
                      if arr.actor.entropy_from_logits_with_chunking else None)
    if not trains:
        return MegatronSpec(role, model, arr.model.path)
    loss = ActorLossSettings.from_config(arr.actor, cfg.data.max_response_length,
                                         cfg.algorithm.rollout_correction)
    return MegatronSpec(role, model, arr.model.path, actor_loss=loss,
                        sync=SyncConfig.from_rollout_config(arr.rollout))


def server_spec(cfg, index: int, load_format: str = "dummy") -> ServerSpec:
    """Rollout replica `index`'s launched server; `load_format` dummy when a trainer sends
    the weights before the first rollout, auto when it loads the model's files."""
    r = cfg.actor_rollout_ref.rollout
    # host, port and GPU are the worker's to fill in (dataclasses.replace)
    args = replica_server_args(cfg, index, host="", port=0, base_gpu_id=None,
                               load_format=load_format)
    return ServerSpec(index, args, module_for(r), float(r.server_start_timeout_s))
