"""Cross-field validation of a merged megarl config.

This module owns the rules no single field's type can express: enum values, positive sizes,
bucket ordering, and the task-group layout (via ``megarl.cluster.topology``) including that
each group's device count is a multiple of the model parallelism of every task it hosts.
Every ``ConfigError`` it raises starts with the dotted key at fault.
"""
from __future__ import annotations

import difflib
import re

from omegaconf import DictConfig, OmegaConf

from megarl.cluster.topology import GroupPlan, TopologyError, plan_groups
from megarl.config.errors import ConfigError
from megarl.config.schema import CHOICES

_ARR = "actor_rollout_ref"

# Integer fields that are counts or sizes: zero or less is never meaningful.
_POSITIVE = (
    "data.max_prompt_length", "data.max_response_length",
    "data.train_batch_size", "data.val_batch_size",
    f"{_ARR}.actor.ppo_mini_batch_size", f"{_ARR}.actor.ppo_micro_batch_size_per_gpu",
    f"{_ARR}.actor.ppo_epochs",
    f"{_ARR}.actor.megatron.tensor_model_parallel_size",
    f"{_ARR}.actor.megatron.pipeline_model_parallel_size",
    f"{_ARR}.ref.megatron.tensor_model_parallel_size",
    f"{_ARR}.ref.megatron.pipeline_model_parallel_size",
    f"{_ARR}.ref.log_prob_micro_batch_size_per_gpu",
    f"{_ARR}.rollout.tensor_model_parallel_size", f"{_ARR}.rollout.n",
    f"{_ARR}.rollout.max_new_tokens", f"{_ARR}.rollout.log_prob_micro_batch_size_per_gpu",
    f"{_ARR}.rollout.param_update_preduce_bucket_size_mb",
    f"{_ARR}.rollout.param_update_consume_bucket_size_mb",
    "reward.num_workers", "trainer.nnodes", "trainer.n_gpus_per_node",
    "trainer.generate_ahead_steps", "trainer.total_epochs",
)

# Which model-parallel layout each task's workers run, as the keys whose product must divide
# the group's device count. ``reward`` runs no model.
_PARALLEL_KEYS = {
    "logp": (f"{_ARR}.actor.megatron.tensor_model_parallel_size",
             f"{_ARR}.actor.megatron.pipeline_model_parallel_size"),
    "actor-train": (f"{_ARR}.actor.megatron.tensor_model_parallel_size",
                    f"{_ARR}.actor.megatron.pipeline_model_parallel_size"),
    "ref_logp": (f"{_ARR}.ref.megatron.tensor_model_parallel_size",
                 f"{_ARR}.ref.megatron.pipeline_model_parallel_size"),
    "generate": (f"{_ARR}.rollout.tensor_model_parallel_size",),
    "reward": (),
}


def validate_config(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` naming the offending key if ``cfg`` cannot run."""
    _check_choices(cfg)
    _check_positive(cfg)
    _check_rollout(cfg)
    _check_actor(cfg, cfg.actor_rollout_ref.actor)
    _check_trainer(cfg.trainer, cfg.data)
    _check_reward(cfg.reward)
    _check_staleness(cfg)
    for plan in plan_task_groups(cfg):
        _check_group_parallelism(cfg, plan)


def plan_task_groups(cfg: DictConfig) -> list[GroupPlan]:
    """The config's task groups on devices; topology errors become ``ConfigError``s."""
    t = cfg.trainer
    try:
        return plan_groups(OmegaConf.to_container(t.separated_node_tasks),
                           list(t.separated_node_ratios), t.nnodes, t.n_gpus_per_node)
    except TopologyError as err:
        raise ConfigError(f"trainer.separated_node_{err.field}: {err}") from None


def _get(cfg: DictConfig, key: str):
    return OmegaConf.select(cfg, key, throw_on_missing=True)


def _check_choices(cfg: DictConfig) -> None:
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise ConfigError(
                f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}{hint}")


def _check_positive(cfg: DictConfig) -> None:
    for key in _POSITIVE:
        value = _get(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")


def _check_rollout(cfg: DictConfig) -> None:
    r = cfg.actor_rollout_ref.rollout
    if r.param_update_consume_bucket_size_mb > r.param_update_preduce_bucket_size_mb:
        raise ConfigError(
            f"{_ARR}.rollout.param_update_consume_bucket_size_mb: "
            f"{r.param_update_consume_bucket_size_mb} MiB is larger than the producer bucket "
            f"{_ARR}.rollout.param_update_preduce_bucket_size_mb="
            f"{r.param_update_preduce_bucket_size_mb} MiB; a received bucket is consumed in "
            "pieces no larger than itself")
    if not 0 < r.gpu_memory_utilization <= 1:
        raise ConfigError(f"{_ARR}.rollout.gpu_memory_utilization: must be in (0, 1], "
                          f"got {r.gpu_memory_utilization}")
    _check_servers(r)


def _check_servers(r) -> None:
    """The launched or given rollout servers (rollout.name=sglang)."""
    key = f"{_ARR}.rollout"
    if r.name != "sglang":
        for name in ("server_urls", "server_module"):
            if r[name]:
                raise ConfigError(f"{key}.{name}: set, but {key}.name is {r.name!r}; it applies "
                                  "to rollout.name=sglang only")
        return
    for i, url in enumerate(r.server_urls or []):
        if not re.fullmatch(r"https?://[^/\s:]+:\d+/?", str(url)):
            raise ConfigError(f"{key}.server_urls[{i}]: {url!r} is not http://host:port")
    if r.server_start_timeout_s <= 0:
        raise ConfigError(f"{key}.server_start_timeout_s: must be > 0, got "
                          f"{r.server_start_timeout_s}")


def _check_staleness(cfg: DictConfig) -> None:
    alg, r, t = cfg.algorithm, cfg.actor_rollout_ref.rollout, cfg.trainer
    ahead = t.generate_ahead_steps if cfg.actor_rollout_ref.async_pipeline else 1
    if alg.max_staleness is not None and alg.max_staleness < ahead - 1:
        # GENERATE(k) starts on version k - ahead + 1 and TRAIN(k) uses version k: every
        # sample would be over the limit and nothing would ever train.
        raise ConfigError(
            f"algorithm.max_staleness: {alg.max_staleness} is below the lag the pipeline "
            f"itself introduces (trainer.generate_ahead_steps - 1 = {ahead - 1}); every "
            "sample would be too stale")
    if r.over_sample_prompts is not None and r.over_sample_prompts < 0:
        raise ConfigError(f"{_ARR}.rollout.over_sample_prompts: must be >= 0, got "
                          f"{r.over_sample_prompts}")


def _check_actor(cfg: DictConfig, actor: DictConfig) -> None:
    if cfg.data.train_batch_size % actor.ppo_mini_batch_size:
        raise ConfigError(
            f"{_ARR}.actor.ppo_mini_batch_size: {actor.ppo_mini_batch_size} does not divide "
            f"data.train_batch_size={cfg.data.train_batch_size}")
    if actor.clip_ratio_c <= 1:
        raise ConfigError(f"{_ARR}.actor.clip_ratio_c: dual-clip bound must be > 1, "
                          f"got {actor.clip_ratio_c}")


def _check_trainer(t: DictConfig, data: DictConfig) -> None:
    if t.val_only and not data.val_files:
        raise ConfigError("trainer.val_only: nothing to validate, data.val_files is not set")
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        raise ConfigError("trainer.resume_from_path: required when trainer.resume_mode="
                          "resume_path")
    from megarl.observability.loggers import KNOWN

    # checked here so a typo fails before Ray and the workers start, not after
    names = [t.logger] if isinstance(t.logger, str) else list(t.logger)
    for name in names:
        if name not in KNOWN:
            close = difflib.get_close_matches(str(name), KNOWN, n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise ConfigError(f"trainer.logger: unknown logger {name!r} (known: "
                              f"{', '.join(KNOWN)}){hint}")


def _check_reward(reward: DictConfig) -> None:
    fn = reward.reward_fn
    if fn is not None and (fn.count(":") != 1 or not all(fn.split(":"))):
        raise ConfigError(f"reward.reward_fn: {fn!r} is not an import path `module:function`")


def _check_group_parallelism(cfg: DictConfig, plan: GroupPlan) -> None:
    for task in plan.tasks:
        keys = _PARALLEL_KEYS[task]
        if not keys:
            continue
        sizes = [_get(cfg, k) for k in keys]
        width = 1
        for size in sizes:
            width *= size
        if plan.num_devices % width:
            shown = " × ".join(f"{k}={s}" for k, s in zip(keys, sizes))
            raise ConfigError(
                f"{keys[0]}: group '{plan.name}' has {plan.num_devices} devices (from "
                f"trainer.separated_node_ratios), not a multiple of {shown} needed by task "
                f"'{task}'")
