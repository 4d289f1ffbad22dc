"""Cross-field validation of a merged megarl config.

This module owns the rules no single field's type can express: enum values (``CHOICES``),
numeric ranges (``RANGES``: sizes, probabilities, seeds), finite numbers everywhere (NaN and
inf are refused in every field, open ones like ``model.override_config`` included), bucket
ordering, and the task-group layout (via ``megarl.cluster.topology``) including that each
group's device count is a multiple of the model parallelism of every task it hosts. Every
``ConfigError`` it raises starts with the dotted key at fault.
"""
from __future__ import annotations

import difflib
import math
import re
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.cluster.topology import GroupPlan, TopologyError, plan_groups
from megarl.config.errors import ConfigError
from megarl.config.schema import CHOICES, MEGATRON_SECTIONS, RANGES
from megarl.utils.imports import check_import_path

_ARR = "actor_rollout_ref"

# Which model-parallel layout each task's workers run, as the keys whose product must divide
# the group's device count. ``reward`` runs no model.
_PARALLEL_KEYS = {
    "logp": (f"{_ARR}.logp.tensor_model_parallel_size",
             f"{_ARR}.logp.pipeline_model_parallel_size",
             f"{_ARR}.actor.megatron.context_parallel_size"),
    "actor-train": (f"{_ARR}.actor.megatron.tensor_model_parallel_size",
                    f"{_ARR}.actor.megatron.pipeline_model_parallel_size",
                    f"{_ARR}.actor.megatron.context_parallel_size"),
    "ref_logp": (f"{_ARR}.ref.megatron.tensor_model_parallel_size",
                 f"{_ARR}.ref.megatron.pipeline_model_parallel_size",
                 f"{_ARR}.ref.megatron.context_parallel_size"),
    "generate": (f"{_ARR}.rollout.tensor_model_parallel_size",),
    "reward": (),
    "critic": ("critic.megatron.tensor_model_parallel_size",
               "critic.megatron.pipeline_model_parallel_size",
               "critic.megatron.context_parallel_size"),
}


def validate_config(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` naming the offending key if ``cfg`` cannot run."""
    _check_values(_resolved(cfg))
    _check_filter_groups(cfg)
    _check_adv_estimator(cfg)
    _check_choices(cfg)
    _check_rollout(cfg)
    _check_actor(cfg, cfg.actor_rollout_ref.actor)
    _check_trainer(cfg.trainer, cfg.data)
    _check_data(cfg.data)
    _check_reward(cfg.reward, cfg.data.max_response_length)
    _check_rollout_fn(cfg.actor_rollout_ref.rollout)
    _check_multi_turn(cfg.actor_rollout_ref.rollout.multi_turn)
    _check_staleness(cfg)
    _check_transformer_impl(cfg)
    _check_moe(cfg)
    _check_recompute(cfg)
    _check_optimizers(cfg)
    plans = plan_task_groups(cfg)
    _check_critic(cfg, plans)
    _check_logp(cfg, plans)
    _check_rollout_correction(cfg, plans)
    _check_torchrun_sharing(cfg, plans)
    _check_update_group(cfg, plans)
    critic_host = critic_hosted(plans) if cfg.algorithm.adv_estimator == "gae" else None
    for plan in plans:
        _check_group_parallelism(cfg, plan, with_critic=plan is critic_host)
        _check_expert_parallelism(cfg, plan, plans)


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


# Every int must fit the int64 the tensors, RNGs and C libraries it ends up in hold.
_INT64 = 2**63


def _resolved(cfg: DictConfig) -> dict:
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "config"
        raise ConfigError(f"{key}: {str(err).splitlines()[0]}") from None


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def show(value: Any) -> str:
    """``repr`` cut to a length that keeps an error message on one readable line."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else \
        f"{'-' if value < 0 else ''}{abs(value).bit_length()}-bit integer"
    return text if len(text) <= 60 else text[:57] + "..."


def _check_values(tree: dict) -> None:
    """Every number finite and within int64, and each ``RANGES`` field inside its range."""
    for path, value in _leaves(tree, ""):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{path}: must be a finite number, got {value}")
        if isinstance(value, int) and not isinstance(value, bool) and \
                not -_INT64 <= value < _INT64:
            raise ConfigError(f"{path}: {show(value)} does not fit in a 64-bit integer")
    for key, allowed in RANGES.items():
        value = _pick(tree, key)
        items = value if isinstance(value, list) else [value]
        if isinstance(value, list) and allowed.length is not None and \
                len(value) != allowed.length:
            raise ConfigError(f"{key}: needs {allowed.length} numbers, got {show(value)}")
        for i, item in enumerate(items):
            if item is None:
                continue  # null (an Optional field) keeps its documented meaning
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                raise ConfigError(f"{key}: must be a number, got {show(item)}")
            if not allowed.allows(item):
                where = f"{key}[{i}]" if isinstance(value, list) else key
                raise ConfigError(f"{where}: must be {allowed.describe()}, got {show(item)}")


def _pick(tree: dict, key: str) -> Any:
    for part in key.split("."):
        tree = tree[part]
    return tree


def _check_rollout(cfg: DictConfig) -> None:
    r = cfg.actor_rollout_ref.rollout
    if r.param_update_consume_bucket_size_mb > r.param_update_preduce_bucket_size_mb:
        raise ConfigError(
            f"{_ARR}.rollout.param_update_consume_bucket_size_mb: "
            f"{r.param_update_consume_bucket_size_mb} MiB is larger than the producer bucket "
            f"{_ARR}.rollout.param_update_preduce_bucket_size_mb="
            f"{r.param_update_preduce_bucket_size_mb} MiB; a received bucket is consumed in "
            "pieces no larger than itself")
    # max_new_tokens is null until the loader fills in data.max_response_length
    if r.max_new_tokens is not None and r.min_new_tokens > r.max_new_tokens:
        raise ConfigError(
            f"{_ARR}.rollout.min_new_tokens: {r.min_new_tokens} is more than "
            f"{_ARR}.rollout.max_new_tokens={r.max_new_tokens} (SGLang refuses such a request)")
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


def _check_staleness(cfg: DictConfig) -> None:
    alg, t = cfg.algorithm, cfg.trainer
    ahead = t.generate_ahead_steps  # async_pipeline is resolved into it (loader.py)
    if alg.max_staleness is not None and alg.max_staleness < ahead - 1:
        # GENERATE(k) starts on version k - ahead + 1 and TRAIN(k) uses version k: every
        # sample would be over the limit and nothing would ever train.
        raise ConfigError(
            f"algorithm.max_staleness: {alg.max_staleness} is below the lag the pipeline "
            f"itself introduces (trainer.generate_ahead_steps - 1 = {ahead - 1}); every "
            "sample would be too stale")


def _check_actor(cfg: DictConfig, actor: DictConfig) -> None:
    if cfg.data.train_batch_size % actor.ppo_mini_batch_size:
        raise ConfigError(
            f"{_ARR}.actor.ppo_mini_batch_size: {actor.ppo_mini_batch_size} does not divide "
            f"data.train_batch_size={cfg.data.train_batch_size}")
    if actor.router_replay.mode == "R3" and \
            not cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay:
        raise ConfigError(f"{_ARR}.actor.router_replay.mode: R3 replays the experts the rollout "
                          f"engines routed each token to, which they report only with "
                          f"{_ARR}.rollout.enable_rollout_routing_replay=true")
    if actor.clip_ratio_low is None and actor.clip_ratio > 1:
        # clip_ratio stands in for the low bound, and 1 - low below 0 clips nothing
        raise ConfigError(f"{_ARR}.actor.clip_ratio: {actor.clip_ratio} is also the lower clip "
                          f"(1 - {actor.clip_ratio} < 0); keep it <= 1 or set "
                          f"{_ARR}.actor.clip_ratio_low")
    # the loss modes' own needs (megarl.algo.policy_losses.check_params, here before any work)
    pl = actor.policy_loss
    if pl.loss_mode == "dro" and pl.dro_beta is None:
        raise ConfigError(f"{_ARR}.actor.policy_loss.dro_beta: required (> 0) when "
                          f"{_ARR}.actor.policy_loss.loss_mode=dro (verl has no default)")
    if pl.loss_mode == "clip_cov" and not pl.clip_cov_lb < pl.clip_cov_ub:
        raise ConfigError(f"{_ARR}.actor.policy_loss.clip_cov_lb: {pl.clip_cov_lb} must be "
                          f"less than {_ARR}.actor.policy_loss.clip_cov_ub={pl.clip_cov_ub}")


def _check_trainer(t: DictConfig, data: DictConfig) -> None:
    if t.val_only and not data.val_files:
        raise ConfigError("trainer.val_only: nothing to validate, data.val_files is not set")
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        raise ConfigError("trainer.resume_from_path: required when trainer.resume_mode="
                          "resume_path")
    from megarl.observability.loggers import KNOWN, check_installed

    # checked here so a typo fails before Ray and the workers start, not after
    names = [t.logger] if isinstance(t.logger, str) else list(t.logger)
    for name in names:
        if name not in KNOWN:
            close = difflib.get_close_matches(str(name), KNOWN, n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise ConfigError(f"trainer.logger: unknown logger {name!r} (known: "
                              f"{', '.join(KNOWN)}){hint}")
    check_installed(names)  # wandb, mlflow: their library, before any worker starts


def _check_data(data: DictConfig) -> None:
    from megarl.data.dataset import check_template_kwargs

    check_template_kwargs(data.apply_chat_template_kwargs)  # its errors name the key
    for key in ("prompt_key", "reward_fn_key"):
        if not isinstance(data[key], str) or not data[key].strip():
            raise ConfigError(f"data.{key}: expected the name of a data column, got "
                              f"{data[key]!r}")


def _check_reward(reward: DictConfig, max_response_length: int) -> None:
    if reward.reward_fn is not None:
        check_import_path(reward.reward_fn, "reward.reward_fn")
    from megarl.reward.overlong import OverlongPenalty

    OverlongPenalty.from_config(reward, max_response_length)  # its errors name the key


def _check_rollout_fn(rollout: DictConfig) -> None:
    if rollout.rollout_fn is None:
        return
    check_import_path(rollout.rollout_fn, f"{_ARR}.rollout.rollout_fn")
    if rollout.partial_rollout:
        raise ConfigError(f"{_ARR}.rollout.rollout_fn: a rollout function replaces the built-in "
                          f"policies; {_ARR}.rollout.partial_rollout=true is one of them (set one "
                          "or the other)")


def _check_filter_groups(cfg: DictConfig) -> None:
    fg = cfg.algorithm.filter_groups
    key = "algorithm.filter_groups"
    if fg.metric not in CHOICES[f"{key}.metric"]:
        # before the generic choices check: say why verl's other names have no counterpart
        raise ConfigError(
            f"{key}.metric: {fg.metric!r} is not a number megarl keeps per response; a reward "
            "function gives one score (keys of a returned dict other than 'score' are not "
            "kept): reward or seq_reward name what trains (the score plus any overlong "
            "penalty), acc or score the function's score alone")
    if not fg.enable:
        return
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.rollout_fn is not None:
        raise ConfigError(f"{key}.enable: a rollout function ({_ARR}.rollout.rollout_fn) "
                          "replaces the built-in policies that filter groups; filter in the "
                          "function, or leave the function out")
    if int(rollout.n) < 2:
        raise ConfigError(f"{key}.enable: with {_ARR}.rollout.n={rollout.n} a group has one "
                          "sample and nothing to compare; dynamic sampling needs n >= 2")


# verl 0.9.1's advantage estimators megarl does not build, and why; checked before the
# generic choices so that their names get the reason, not a list of alternatives
ESTIMATORS_NOT_BUILT = {
    "grpo_vectorized": "use grpo with algorithm.norm_adv_by_std_in_grpo=true: the same "
                       "advantages, except that verl's trainer never passes that key to "
                       "grpo_vectorized (it always divides by the group std) and that it passes "
                       "a one-sample group's reward through (megarl gives such a group 0)",
    "optimal_token_baseline": "it needs the actor's per-token sum of squared probabilities "
                              "(verl's actor.calculate_sum_pi_squared), which megarl's actor "
                              "does not compute",
}
ESTIMATORS_NOT_BUILT["tir_optimal_token_baseline"] = ESTIMATORS_NOT_BUILT["optimal_token_baseline"]


def _check_adv_estimator(cfg: DictConfig) -> None:
    key, name = "algorithm.adv_estimator", cfg.algorithm.adv_estimator
    if name in ESTIMATORS_NOT_BUILT:
        raise ConfigError(f"{key}: verl's {name!r} is not built in megarl: "
                          f"{ESTIMATORS_NOT_BUILT[name]}")
    n = int(cfg.actor_rollout_ref.rollout.n)
    rollout = cfg.actor_rollout_ref.rollout
    if name == "remax" and rollout.rollout_fn is not None:
        raise ConfigError(f"{key}: remax's greedy baseline is generated by megarl's own "
                          f"rollouts beside each prompt's samples; {_ARR}.rollout.rollout_fn "
                          "replaces them, and a user function chooses its own prompts and forms "
                          "its own requests (other prompts, turns, per-sample sampling), so no "
                          "greedy request can be added to its groups for it (set one or the "
                          "other)")
    if name == "gdpo":
        _check_gdpo(cfg)
    if name == "grpo_passk" and n < 2:
        raise ConfigError(f"{key}: grpo_passk gives a group's best sample its margin over the "
                          f"runner-up; with {_ARR}.rollout.n={n} a group has one sample and "
                          "no runner-up (set n >= 2)")


def _check_gdpo(cfg: DictConfig) -> None:
    alg, key = cfg.algorithm, "algorithm.adv_estimator"
    keys, weights = list(alg.gdpo_reward_keys), alg.gdpo_reward_weights
    if not keys:
        raise ConfigError("algorithm.gdpo_reward_keys: gdpo normalises the reward's components "
                          "one by one; list the entries of the dict your reward function "
                          "returns, e.g. [format_reward, accuracy_reward]")
    if weights is not None and len(weights) != len(keys):
        raise ConfigError(f"algorithm.gdpo_reward_weights: {len(weights)} weights for "
                          f"{len(keys)} gdpo_reward_keys")
    # verl's gdpo reads the components only: what is added to the reward after scoring would
    # silently do nothing, and verl's trainer never passes the std switch to it
    if alg.use_kl_in_reward:
        raise ConfigError(f"{key}: gdpo's advantages come from the reward's components, so "
                          "algorithm.use_kl_in_reward would have no effect; use the KL loss "
                          f"({_ARR}.actor.use_kl_loss) instead")
    if cfg.reward.reward_kwargs.overlong_buffer_cfg.enable:
        raise ConfigError(f"{key}: gdpo's advantages come from the reward's components, so "
                          "the overlong penalty (reward.reward_kwargs.overlong_buffer_cfg) "
                          "would have no effect; return it as a component instead")
    if not alg.norm_adv_by_std_in_grpo:
        raise ConfigError(f"{key}: gdpo always divides each component by its group's std "
                          "(verl's trainer does not pass algorithm.norm_adv_by_std_in_grpo "
                          "to it); leave norm_adv_by_std_in_grpo true")


def _check_multi_turn(mt: DictConfig) -> None:
    key = f"{_ARR}.rollout.multi_turn"
    if not mt.enable:
        return
    from megarl.agent.tools import tool_specs

    if not mt.tools:
        raise ConfigError(f"{key}.tools: multi_turn.enable=true needs at least one tool")
    tool_specs(mt.tools)
    if mt.format != "hermes":
        check_import_path(mt.format, f"{key}.format")
    if "{content}" not in mt.tool_response_template:
        raise ConfigError(f"{key}.tool_response_template: must contain {{content}}, where "
                          "the tool answers go")


def hosting(plans: list[GroupPlan], task: str) -> GroupPlan:
    """The group that runs `task`."""
    return next(p for p in plans if task in p.tasks)


def update_group_shares_a_device(cfg: DictConfig, plans: list[GroupPlan]) -> str | None:
    """Why two ranks of the weight-update group (the trainer's sender, every engine TP rank,
    every logp replica rank) would sit on one device, or None. Servers the user runs
    (`rollout.server_urls`) are placed by the user."""
    if cfg.actor_rollout_ref.rollout.server_urls:
        return None
    train, gen = hosting(plans, "actor-train"), hosting(plans, "generate")
    if train is gen:
        return f"generate shares the devices of actor-train (group {train.name})"
    logp = hosting(plans, "logp")
    if logp is gen:
        return f"the logp replica shares the devices of generate (group {gen.name})"
    return None


def update_group_backend(cfg: DictConfig, plans: list[GroupPlan]) -> str:
    """`rollout.update_group_backend` with `auto` resolved (see the schema)."""
    chosen = cfg.actor_rollout_ref.rollout.update_group_backend
    if chosen != "auto":
        return chosen
    if cfg.trainer.device != "cuda" or update_group_shares_a_device(cfg, plans):
        return "gloo"
    return "nccl"


def _check_update_group(cfg: DictConfig, plans: list[GroupPlan]) -> None:
    if cfg.actor_rollout_ref.rollout.update_group_backend != "nccl":
        return
    key = f"{_ARR}.rollout.update_group_backend"
    if cfg.trainer.device != "cuda":
        raise ConfigError(f"{key}: nccl needs trainer.device=cuda, not {cfg.trainer.device}")
    why = update_group_shares_a_device(cfg, plans)
    if why:
        raise ConfigError(f"{key}: nccl cannot hold two ranks on one GPU, and {why}; use "
                          "gloo or auto")


def critic_hosted(plans: list[GroupPlan]) -> GroupPlan:
    """The group the critic runs on: its own task's, else actor-train's."""
    return next((p for p in plans if "critic" in p.tasks), hosting(plans, "actor-train"))


def _check_critic(cfg: DictConfig, plans: list[GroupPlan]) -> None:
    listed = any("critic" in p.tasks for p in plans)
    if cfg.algorithm.adv_estimator != "gae":
        if listed:
            raise ConfigError(
                "trainer.separated_node_tasks: task `critic` is placed, but only "
                f"algorithm.adv_estimator=gae trains a critic (it is "
                f"{cfg.algorithm.adv_estimator!r})")
        return
    critic, actor = cfg.critic, cfg.actor_rollout_ref.actor
    mini = critic.ppo_mini_batch_size or actor.ppo_mini_batch_size
    if cfg.data.train_batch_size % mini:
        raise ConfigError(f"critic.ppo_mini_batch_size: {mini} does not divide "
                          f"data.train_batch_size={cfg.data.train_batch_size}")


def _check_logp(cfg: DictConfig, plans: list[GroupPlan]) -> None:
    """The replica's own layout is for logp on a group of its own; beside actor-train, LOGP
    runs on the trainer, whose layout is the actor's."""
    shared = any({"logp", "actor-train"} <= set(p.tasks) for p in plans)
    logp, actor = cfg.actor_rollout_ref.logp, cfg.actor_rollout_ref.actor.megatron
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if shared and logp[key] is not None and logp[key] != actor[key]:
            raise ConfigError(
                f"{_ARR}.logp.{key}: {logp[key]}, but logp shares the actor-train group, where "
                f"it runs on the trainer itself ({_ARR}.actor.megatron.{key}={actor[key]}); "
                f"give logp a group of its own in trainer.separated_node_tasks, or drop it")


def _check_rollout_correction(cfg: DictConfig, plans: list[GroupPlan]) -> None:
    """verl's algorithm.rollout_correction: its values parsed as a run will, and bypass mode's
    needs. At verl's defaults (all off) nothing is parsed: the parser is megarl.algo's, which
    loads torch, and a config that uses none of it does not need it to load."""
    import dataclasses

    from megarl.config.schema import RolloutCorrectionConfig

    key, rc = "algorithm.rollout_correction", cfg.algorithm.rollout_correction
    if all(rc[k] == v for k, v in dataclasses.asdict(RolloutCorrectionConfig()).items()):
        return
    from megarl.algo.rollout_correction import RolloutCorrection

    try:
        RolloutCorrection.from_config(rc)  # its messages start with the key
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not rc.bypass_mode:
        return
    mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if mode != "vanilla":
        raise ConfigError(f"{key}.bypass_mode: true replaces the policy loss by {key}.loss_type's "
                          f"({rc.loss_type}), and {_ARR}.actor.policy_loss.loss_mode is {mode} "
                          "(verl drops it silently); set loss_mode vanilla")
    if any("logp" in p.tasks and "actor-train" not in p.tasks for p in plans):
        raise ConfigError(f"{key}.bypass_mode: true skips the LOGP pass (the rollout log-probs "
                          "are the old policy), and logp has a task group of its own in "
                          "trainer.separated_node_tasks, whose devices would sit idle; put logp "
                          "with actor-train")


def _models_on(cfg: DictConfig, plan: GroupPlan, plans: list[GroupPlan]) -> list[tuple]:
    """The Megatron models a group's workers hold, as (model, its TP key, TP, PP)."""
    m = cfg.actor_rollout_ref
    out = []
    if "actor-train" in plan.tasks:
        out.append(("actor", f"{_ARR}.actor.megatron", m.actor.megatron))
    if "logp" in plan.tasks and "actor-train" not in plan.tasks:
        out.append(("logp replica", f"{_ARR}.logp", m.logp))
    if "ref_logp" in plan.tasks:
        out.append(("ref", f"{_ARR}.ref.megatron", m.ref.megatron))
    if cfg.algorithm.adv_estimator == "gae" and critic_hosted(plans) is plan:
        out.append(("critic", "critic.megatron", cfg.critic.megatron))
    actor = m.actor.megatron
    # the layout (TP, PP, CP); a logp replica has no CP key: it runs the actor's
    return [(name, key, n.tensor_model_parallel_size or actor.tensor_model_parallel_size,
             n.pipeline_model_parallel_size or actor.pipeline_model_parallel_size,
             n.get("context_parallel_size") or actor.context_parallel_size)
            for name, key, n in out]


def _check_transformer_impl(cfg: DictConfig) -> None:
    """Transformer Engine's layers are CUDA kernels (whether it is installed, preflight
    checks)."""
    for key in MEGATRON_SECTIONS:
        if _get(cfg, key).transformer_impl == "transformer_engine" and \
                cfg.trainer.device != "cuda":
            raise ConfigError(f"{key}.transformer_impl: transformer_engine runs on CUDA only, "
                              f"but trainer.device={cfg.trainer.device} (use auto or local)")


def _check_recompute(cfg: DictConfig) -> None:
    """Megatron's rules for its recompute settings, said by key before anything is built."""
    for key in MEGATRON_SECTIONS:
        o = _get(cfg, key).override_transformer_config
        key = f"{key}.override_transformer_config"
        given = [k for k in ("recompute_method", "recompute_num_layers") if o[k] is not None]
        if o.recompute_granularity == "selective" and given:
            raise ConfigError(f"{key}.{given[0]}: applies to recompute_granularity=full only, "
                              f"but it is selective (every layer's core attention recomputed)")
        if o.recompute_granularity is None and given:
            raise ConfigError(f"{key}.{given[0]}: does nothing while "
                              f"{key}.recompute_granularity is null (set it to full)")


def _check_moe(cfg: DictConfig) -> None:
    """Mixture-of-experts settings that need no model to judge (the model's own fit is the
    preflight's: EP dividing num_experts, a dense model refusing EP)."""
    for key in MEGATRON_SECTIONS:
        m = _get(cfg, key)
        dispatcher = m.override_transformer_config.moe_token_dispatcher_type
        if dispatcher == "alltoall" and cfg.trainer.device != "cuda":
            raise ConfigError(f"{key}.override_transformer_config.moe_token_dispatcher_type: "
                              f"alltoall opens CUDA streams, but trainer.device="
                              f"{cfg.trainer.device} (use allgather or null)")
        if m.expert_model_parallel_size > 1 and m.optimizer == "torch":
            raise ConfigError(f"{key}.expert_model_parallel_size: "
                              f"{m.expert_model_parallel_size} needs Megatron's optimizer "
                              f"(experts' gradients reduce over their own data-parallel "
                              f"ranks), but {key}.optimizer=torch")


def _expert_layouts(cfg: DictConfig, plan: GroupPlan, plans: list[GroupPlan]) -> list[tuple]:
    """(model, key of its EP, PP, EP, ETP) of each Megatron model on a group: a logp replica
    and the critic run the actor's and the critic's own expert layout."""
    arr = cfg.actor_rollout_ref
    own = {"actor": arr.actor.megatron, "logp replica": arr.actor.megatron,
           "ref": arr.ref.megatron, "critic": cfg.critic.megatron}
    keys = {"actor": f"{_ARR}.actor.megatron", "logp replica": f"{_ARR}.actor.megatron",
            "ref": f"{_ARR}.ref.megatron", "critic": "critic.megatron"}
    out = []
    for name, _, tp, pp, _cp in _models_on(cfg, plan, plans):
        m = own[name]
        etp = m.expert_tensor_parallel_size or tp
        out.append((name, keys[name], pp, m.expert_model_parallel_size, etp))
    return out


def _check_expert_parallelism(cfg: DictConfig, plan: GroupPlan, plans: list[GroupPlan]) -> None:
    """EP × ETP ranks are taken from a stage's ranks (Megatron's expert groups): they must
    divide the group's devices / PP."""
    for name, key, pp, ep, etp in _expert_layouts(cfg, plan, plans):
        per_stage = plan.num_devices // pp
        if per_stage % (ep * etp):
            raise ConfigError(
                f"{key}.expert_model_parallel_size: the {name} model on group '{plan.name}' "
                f"has {per_stage} ranks per pipeline stage ({plan.num_devices} devices / "
                f"PP={pp}), not a multiple of EP × ETP = {ep} × {etp}")


def _check_optimizers(cfg: DictConfig) -> None:
    """What the trainers' optimizer and LR schedule settings must agree on. A decay whose
    length is null (the trainer's total steps) is checked once that total is known."""
    for section, optim in (("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.optim),
                           ("critic", cfg.critic.optim)):
        m = _get(cfg, f"{section}.megatron")
        if m.optimizer == "torch":
            for key in ("use_distributed_optimizer", "overlap_grad_reduce"):
                if m[key]:
                    raise ConfigError(f"{section}.megatron.{key} needs Megatron's optimizer, "
                                      f"but {section}.megatron.optimizer=torch")
        if optim.min_lr > optim.lr:
            raise ConfigError(f"{section}.optim.min_lr={optim.min_lr} is above "
                              f"{section}.optim.lr={optim.lr}")
        steps = optim.total_training_steps
        if optim.lr_decay_style != "constant" and steps is not None and \
                steps <= optim.lr_warmup_steps:
            raise ConfigError(f"{section}.optim.total_training_steps={steps}: a "
                              f"{optim.lr_decay_style} decay needs more steps than "
                              f"{section}.optim.lr_warmup_steps={optim.lr_warmup_steps}")


def _check_torchrun_sharing(cfg: DictConfig, plans: list[GroupPlan]) -> None:
    """Under torchrun a device is one process: every model placed on a group lives in it and
    shares its one model-parallel state, so they need one TP × PP (Ray gives each model
    processes of its own)."""
    if cfg.trainer.launcher != "torchrun":
        return
    for plan in plans:
        models = _models_on(cfg, plan, plans)
        for name, key, tp, pp, cp in models[1:]:
            first, fkey, ftp, fpp, fcp = models[0]
            if (tp, pp) == (ftp, fpp) and cp != fcp:
                raise ConfigError(
                    f"{key}.context_parallel_size: {cp}, but with trainer.launcher=torchrun "
                    f"the {name} model on group '{plan.name}' shares the {first} model's "
                    f"processes, which run {fkey}.context_parallel_size={fcp}; use the same "
                    "size or give it a task group of its own")
            if (tp, pp) != (ftp, fpp):
                raise ConfigError(
                    f"{key}.tensor_model_parallel_size/pipeline_model_parallel_size: {tp}×{pp}"
                    f", but with trainer.launcher=torchrun the {name} model on group "
                    f"'{plan.name}' shares the {first} model's processes, which run "
                    f"{fkey} {ftp}×{fpp}; use the same sizes or give it a task group of its "
                    "own")


def _check_group_parallelism(cfg: DictConfig, plan: GroupPlan,
                             with_critic: bool = False) -> None:
    tasks = list(plan.tasks)
    if with_critic and "critic" not in tasks:
        tasks.append("critic")  # the critic runs beside actor-train when not placed itself
    for task in tasks:
        keys = _PARALLEL_KEYS[task]
        if task == "logp" and ("actor-train" in tasks or _get(cfg, keys[0]) is None):
            keys = _PARALLEL_KEYS["actor-train"]  # on the trainer, or the actor's layout
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
