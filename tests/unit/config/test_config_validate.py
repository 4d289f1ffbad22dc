"""validate_config: every rule's error names the dotted key at fault."""
import pytest
from omegaconf import OmegaConf

from megarl.config import ConfigError, MegaRLConfig, load_config, validate_config

ARR = "actor_rollout_ref"


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    return str(err.value)


def four_devices(*overrides: str) -> list:
    return ["trainer.n_gpus_per_node=4", *overrides]


def test_validate_config_callable_alone():
    cfg = OmegaConf.structured(MegaRLConfig)
    validate_config(cfg)
    cfg.trainer.separated_node_ratios = [0.5]
    with pytest.raises(ConfigError, match="trainer.separated_node_ratios"):
        validate_config(cfg)


def test_ratios_must_sum_to_one():
    msg = error_of(*four_devices("trainer.separated_node_tasks=[[logp,actor-train],"
                                 "[ref_logp,generate]]",
                                 "trainer.separated_node_ratios=[0.5,0.25]"))
    assert msg.startswith("trainer.separated_node_ratios:") and "sum" in msg


def test_ratio_sum_within_tolerance_is_fine():
    load_config(None, four_devices(
        "trainer.separated_node_tasks=[[logp,actor-train],ref_logp,generate]",
        "trainer.separated_node_ratios=[0.5,0.2500000001,0.25]"))


@pytest.mark.parametrize("ratios", ["[1.5,-0.5]", "[1.0,0.0]"])
def test_ratio_must_be_positive(ratios):
    msg = error_of(*four_devices("trainer.separated_node_tasks=[[logp,actor-train,ref_logp],"
                                 "generate]", f"trainer.separated_node_ratios={ratios}"))
    # the message names the item at fault: trainer.separated_node_ratios[1]: ...
    assert msg.startswith("trainer.separated_node_ratios") and "> 0" in msg


def test_tasks_and_ratios_lengths_differ():
    msg = error_of("trainer.separated_node_tasks=[[logp,actor-train],ref_logp,generate]")
    assert msg.startswith("trainer.separated_node_ratios:") and "3 task groups" in msg


def test_task_in_two_groups():
    msg = error_of(*four_devices("trainer.separated_node_tasks=[[logp,actor-train,ref_logp],"
                                 "[generate,logp]]", "trainer.separated_node_ratios=[0.5,0.5]"))
    assert msg.startswith("trainer.separated_node_tasks:") and "'logp'" in msg


def test_task_missing_from_all_groups():
    msg = error_of("trainer.separated_node_tasks=[[logp,actor-train,generate]]")
    assert msg.startswith("trainer.separated_node_tasks:") and "ref_logp" in msg


def test_reward_may_have_its_own_group_or_be_left_out():
    load_config(None, four_devices(
        "trainer.separated_node_tasks=[[logp,actor-train,ref_logp,generate],reward]",
        "trainer.separated_node_ratios=[0.75,0.25]"))
    load_config(None, ["trainer.separated_node_tasks=[[logp,actor-train,ref_logp,generate]]"])


def test_unknown_task_suggests_name():
    msg = error_of("trainer.separated_node_tasks=[[logp,actor_train,ref_logp,generate]]")
    assert msg.startswith("trainer.separated_node_tasks:")
    assert "did you mean `actor-train`?" in msg


def test_non_integer_device_count_on_one_node():
    msg = error_of("trainer.n_gpus_per_node=3",
                   "trainer.separated_node_tasks=[[logp,actor-train,ref_logp],generate]",
                   "trainer.separated_node_ratios=[0.5,0.5]")
    assert msg.startswith("trainer.separated_node_ratios:") and "whole number of devices" in msg


def test_non_integer_node_count_on_many_nodes():
    msg = error_of("trainer.nnodes=2", "trainer.n_gpus_per_node=8",
                   "trainer.separated_node_tasks=[[logp,actor-train],ref_logp,generate]",
                   "trainer.separated_node_ratios=[0.5,0.25,0.25]")
    assert msg.startswith("trainer.separated_node_ratios:") and "whole number of nodes" in msg


def test_group_with_zero_devices():
    # 1e-7 passes the sum tolerance yet rounds to zero devices.
    msg = error_of("trainer.separated_node_tasks=[[logp,actor-train,ref_logp,generate],reward]",
                   "trainer.separated_node_ratios=[0.9999999,0.0000001]")
    assert msg.startswith("trainer.separated_node_ratios:") and "zero devices" in msg


def test_actor_tp_pp_must_divide_its_group():
    msg = error_of(*four_devices(
        "trainer.separated_node_tasks=[[logp,actor-train],ref_logp,generate]",
        "trainer.separated_node_ratios=[0.5,0.25,0.25]",
        f"{ARR}.actor.megatron.pipeline_model_parallel_size=4"))
    assert msg.startswith(f"{ARR}.actor.megatron.tensor_model_parallel_size:")
    assert f"{ARR}.actor.megatron.pipeline_model_parallel_size=4" in msg
    assert "logp+actor-train" in msg


def test_ref_tp_must_divide_its_group():
    msg = error_of(*four_devices(
        "trainer.separated_node_tasks=[[logp,actor-train],ref_logp,generate]",
        "trainer.separated_node_ratios=[0.5,0.25,0.25]",
        f"{ARR}.ref.megatron.tensor_model_parallel_size=2"))
    assert msg.startswith(f"{ARR}.ref.megatron.tensor_model_parallel_size:")


def test_rollout_tp_must_divide_its_group():
    msg = error_of(*four_devices(
        "trainer.separated_node_tasks=[[logp,actor-train,ref_logp],generate]",
        "trainer.separated_node_ratios=[0.75,0.25]",
        f"{ARR}.rollout.tensor_model_parallel_size=2"))
    assert msg.startswith(f"{ARR}.rollout.tensor_model_parallel_size:")


def test_every_model_in_a_shared_group_must_divide_it():
    ok = four_devices(f"{ARR}.actor.megatron.tensor_model_parallel_size=4",
                      f"{ARR}.ref.megatron.tensor_model_parallel_size=2")
    load_config(None, ok)
    msg = error_of(*ok, f"{ARR}.rollout.tensor_model_parallel_size=3")
    assert msg.startswith(f"{ARR}.rollout.tensor_model_parallel_size:")


@pytest.mark.parametrize("key", ["param_update_preduce_bucket_size_mb",
                                 "param_update_consume_bucket_size_mb"])
def test_bucket_sizes_positive(key):
    assert error_of(f"{ARR}.rollout.{key}=0").startswith(f"{ARR}.rollout.{key}:")


def test_consume_bucket_not_larger_than_produce():
    msg = error_of(f"{ARR}.rollout.param_update_preduce_bucket_size_mb=128",
                   f"{ARR}.rollout.param_update_consume_bucket_size_mb=512")
    assert msg.startswith(f"{ARR}.rollout.param_update_consume_bucket_size_mb:")
    assert f"{ARR}.rollout.param_update_preduce_bucket_size_mb" in msg


def test_min_new_tokens_within_the_budget():
    msg = error_of(f"{ARR}.rollout.min_new_tokens=9", f"{ARR}.rollout.max_new_tokens=8")
    assert msg.startswith(f"{ARR}.rollout.min_new_tokens:") and "max_new_tokens=8" in msg
    assert error_of(f"{ARR}.rollout.min_new_tokens=-1").startswith(
        f"{ARR}.rollout.min_new_tokens:")


def test_generate_ahead_steps_at_least_one():
    assert error_of("trainer.generate_ahead_steps=0").startswith("trainer.generate_ahead_steps:")


def test_val_only_needs_val_files():
    assert error_of("trainer.val_only=True").startswith("trainer.val_only:")
    load_config(None, ["trainer.val_only=True", "data.val_files=val.jsonl"])


@pytest.mark.parametrize("key,bad,hint", [
    ("trainer.device", "gpu", None),
    ("data.truncation", "middle", None),
    (f"{ARR}.rollout.name", "sglang2", "sglang"),
    (f"{ARR}.actor.loss_agg_mode", "token_mean", "token-mean"),
    (f"{ARR}.actor.kl_loss_type", "low_var", "low_var_kl"),
    ("algorithm.adv_estimator", "grp", "grpo"),
    ("trainer.resume_mode", "always", None),
    (f"{ARR}.actor.megatron.params_dtype", "bf16", None),
])
def test_enum_fields(key, bad, hint):
    msg = error_of(f"{key}={bad}")
    assert msg.startswith(f"{key}:") and repr(bad) in msg
    if hint:
        assert f"did you mean `{hint}`?" in msg


def test_resume_path_needs_a_path():
    assert error_of("trainer.resume_mode=resume_path").startswith("trainer.resume_from_path:")


def test_reward_fn_must_be_an_import_path():
    assert error_of("reward.reward_fn=my_rewards.score").startswith("reward.reward_fn:")
    load_config(None, ["reward.reward_fn=my_rewards:score"])


def test_mini_batch_must_divide_train_batch():
    msg = error_of("data.train_batch_size=6", f"{ARR}.actor.ppo_mini_batch_size=4")
    assert msg.startswith(f"{ARR}.actor.ppo_mini_batch_size:")


def test_max_staleness_below_the_pipeline_lag_is_refused():
    msg = error_of(f"{ARR}.async_pipeline=True", "trainer.generate_ahead_steps=3",
                   "algorithm.max_staleness=1")
    assert msg.startswith("algorithm.max_staleness") and "generate_ahead_steps" in msg
    # the lag of a synchronous pipeline is 0: any limit fits
    load_config(None, ["algorithm.max_staleness=0"])
    load_config(None, [f"{ARR}.async_pipeline=True", "trainer.generate_ahead_steps=3",
                       "algorithm.max_staleness=2", "algorithm.stale_policy=regenerate"])


def test_stale_policy_and_over_sample_are_checked():
    assert error_of("algorithm.stale_policy=discard").startswith("algorithm.stale_policy")
    assert error_of(f"{ARR}.rollout.over_sample_prompts=-1").startswith(
        f"{ARR}.rollout.over_sample_prompts")


def test_unknown_logger_fails_at_load():
    msg = error_of("trainer.logger=[console,tensorbord]")
    assert msg.startswith("trainer.logger") and "did you mean `tensorboard`" in msg


@pytest.mark.parametrize("overrides, key", [
    (["actor_rollout_ref.rollout.server_urls=[http://h:1]"], "rollout.server_urls"),
    (["actor_rollout_ref.rollout.server_module=sglang.launch_server"], "rollout.server_module"),
    (["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.server_urls=[h:1]"],
     "rollout.server_urls[0]"),
    (["actor_rollout_ref.rollout.name=sglang",
      "actor_rollout_ref.rollout.server_start_timeout_s=0"], "rollout.server_start_timeout_s"),
])
def test_rollout_server_settings_name_the_key(overrides, key):
    assert error_of(*overrides).startswith(f"{ARR}.{key}:")


def test_sglang_with_given_servers_loads():
    cfg = load_config(None, ["actor_rollout_ref.rollout.name=sglang",
                             "actor_rollout_ref.rollout.server_urls=[http://10.1.2.3:30000]"])
    assert list(cfg.actor_rollout_ref.rollout.server_urls) == ["http://10.1.2.3:30000"]


# ------------------------------------------------------------------ the logp replica's own layout
APART = ["trainer.separated_node_tasks=[logp,ref_logp,actor-train,generate]"]


def test_the_logp_replica_takes_the_actors_layout_unless_it_has_its_own():
    cfg = load_config(None, [*APART, "trainer.n_gpus_per_node=8",
                             "trainer.separated_node_ratios=[0.25,0.25,0.25,0.25]",
                             f"{ARR}.actor.megatron.tensor_model_parallel_size=2"])
    assert (cfg.actor_rollout_ref.logp.tensor_model_parallel_size,
            cfg.actor_rollout_ref.logp.pipeline_model_parallel_size) == (2, 1)
    cfg = load_config(None, [*APART, "trainer.n_gpus_per_node=5",
                             "trainer.separated_node_ratios=[0.4,0.2,0.2,0.2]",
                             f"{ARR}.logp.tensor_model_parallel_size=2"])
    assert cfg.actor_rollout_ref.logp.tensor_model_parallel_size == 2
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 1


def test_the_logp_replica_layout_must_fit_its_group_and_needs_one():
    msg = error_of(*APART, "trainer.n_gpus_per_node=4",
                   "trainer.separated_node_ratios=[0.25,0.25,0.25,0.25]",
                   f"{ARR}.logp.tensor_model_parallel_size=2")
    assert msg.startswith(f"{ARR}.logp.tensor_model_parallel_size: group 'logp' has 1 devices")
    # beside actor-train LOGP runs on the trainer: a layout of its own would be ignored
    msg = error_of(f"{ARR}.logp.pipeline_model_parallel_size=2")
    assert msg.startswith(f"{ARR}.logp.pipeline_model_parallel_size: 2, but logp shares the "
                          "actor-train group")


# ------------------------------------------------------------------ torchrun: one process a device
def test_under_torchrun_models_sharing_a_group_need_one_layout():
    """torchrun runs every model placed on a device in that device's one process (one
    model-parallel state); Ray gives each model processes of its own, so it allows it."""
    shared = [*four_devices("trainer.separated_node_tasks=[[logp,actor-train,ref_logp],"
                            "[generate]]", "trainer.separated_node_ratios=[0.5,0.5]"),
              f"{ARR}.ref.megatron.tensor_model_parallel_size=2"]
    load_config(None, shared)  # Ray
    msg = error_of(*shared, "trainer.launcher=torchrun")
    assert msg.startswith(f"{ARR}.ref.megatron.tensor_model_parallel_size/"
                          "pipeline_model_parallel_size: 2×1, but with trainer.launcher=torchrun "
                          "the ref model on group 'logp+actor-train+ref_logp' shares the actor "
                          f"model's processes, which run {ARR}.actor.megatron 1×1"), msg
    # a logp replica and the reference on one group of their own share processes too
    apart = [*four_devices("trainer.separated_node_tasks=[[logp,ref_logp],actor-train,"
                           "generate]", "trainer.separated_node_ratios=[0.5,0.25,0.25]"),
             "trainer.launcher=torchrun", f"{ARR}.logp.tensor_model_parallel_size=2"]
    msg = error_of(*apart)
    assert msg.startswith(f"{ARR}.ref.megatron.tensor_model_parallel_size/"), msg
    assert "shares the logp replica model's processes" in msg, msg
    load_config(None, [*apart, f"{ARR}.ref.megatron.tensor_model_parallel_size=2"])
    # the critic beside actor-train (not placed itself) lives in the actor's processes
    msg = error_of("trainer.launcher=torchrun", "algorithm.adv_estimator=gae",
                   "trainer.n_gpus_per_node=2", "critic.megatron.pipeline_model_parallel_size=2")
    assert msg.startswith("critic.megatron.tensor_model_parallel_size/"), msg


# ------------------------------------------------------------------- mixture of experts
def test_expert_parallel_ranks_must_divide_a_stages_ranks():
    split = ["trainer.separated_node_tasks=[[logp,actor-train],ref_logp,generate]",
             "trainer.separated_node_ratios=[0.5,0.25,0.25]"]
    load_config(None, four_devices(*split, f"{ARR}.actor.megatron.expert_model_parallel_size=2"))
    msg = error_of(*four_devices(*split, f"{ARR}.actor.megatron.expert_model_parallel_size=4"))
    assert msg.startswith(f"{ARR}.actor.megatron.expert_model_parallel_size:")
    assert "logp+actor-train" in msg and "EP × ETP = 4 × 1" in msg
    # ETP (null: TP) takes ranks too
    msg = error_of(*four_devices(*split, f"{ARR}.ref.megatron.expert_model_parallel_size=1",
                                 f"{ARR}.ref.megatron.expert_tensor_parallel_size=2"))
    assert msg.startswith(f"{ARR}.ref.megatron.expert_model_parallel_size:") and "1 × 2" in msg


@pytest.mark.parametrize("overrides,key", [
    ([f"{ARR}.actor.router_replay.mode=R3"], f"{ARR}.actor.router_replay.mode"),
    ([f"{ARR}.actor.router_replay.mode=R2"], f"{ARR}.actor.router_replay.mode"),
    ([f"{ARR}.actor.megatron.override_transformer_config.moe_token_dispatcher_type=alltoall"],
     f"{ARR}.actor.megatron.override_transformer_config.moe_token_dispatcher_type"),
    ([f"{ARR}.actor.megatron.override_transformer_config.moe_aux_loss_coeff=-1"],
     f"{ARR}.actor.megatron.override_transformer_config.moe_aux_loss_coeff"),
    ([f"critic.megatron.override_transformer_config.moe_expert_capacity_factor=0"],
     "critic.megatron.override_transformer_config.moe_expert_capacity_factor"),
    ([f"{ARR}.actor.megatron.override_transformer_config.moe_router_topk=4"],
     f"{ARR}.actor.megatron.override_transformer_config.moe_router_topk"),
    ([f"{ARR}.actor.megatron.optimizer=torch", "trainer.n_gpus_per_node=4",
      f"{ARR}.actor.megatron.expert_model_parallel_size=2"],
     f"{ARR}.actor.megatron.expert_model_parallel_size"),
], ids=["R3-without-engine-routing", "R2", "alltoall-on-cpu", "negative-aux", "zero-capacity",
        "unknown-router-key", "EP-with-torch-optimizer"])
def test_moe_settings_are_refused_by_key(overrides, key):
    assert key in error_of(*overrides)


_OTC = f"{ARR}.actor.megatron.override_transformer_config"


@pytest.mark.parametrize("overrides,said", [
    ([f"{_OTC}.recompute_granularity=selective", f"{_OTC}.recompute_method=uniform"],
     f"{_OTC}.recompute_method: applies to recompute_granularity=full only"),
    ([f"critic.megatron.override_transformer_config.recompute_num_layers=2"],
     "critic.megatron.override_transformer_config.recompute_num_layers: does nothing while "
     "critic.megatron.override_transformer_config.recompute_granularity is null"),
    ([f"{_OTC}.recompute_granularity=partial"], f"{_OTC}.recompute_granularity"),
    ([f"{_OTC}.recompute_granularity=full", f"{_OTC}.recompute_num_layers=0"],
     f"{_OTC}.recompute_num_layers"),
], ids=["selective-with-method", "layers-without-granularity", "unknown-granularity",
        "zero-layers"])
def test_recompute_settings_are_refused_by_key(overrides, said):
    assert said in error_of(*overrides)


def test_attention_backend_is_refused_by_key():
    # Megatron's `local` (its own DotProductAttention) allocates on CUDA and takes no packed
    # sequences: not one of megarl's
    assert f"{_OTC}.attention_backend" in error_of(f"{_OTC}.attention_backend=local")


def test_attention_backend_reaches_each_model_spec():
    from megarl.cluster.spec import megatron_spec

    # verl's default (flash) loads on the CPU too: SDPA falls back where flash cannot run
    cfg = load_config(None, [f"{_OTC}.attention_backend=flex",
                             f"{ARR}.ref.megatron.override_transformer_config.attention_backend"
                             f"=flash"])
    assert [megatron_spec(cfg, r).model.attention_backend for r in ("actor", "logp", "ref")] \
        == ["flex", "flex", "flash"]
