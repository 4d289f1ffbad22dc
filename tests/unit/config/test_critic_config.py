"""The critic's config: placed only with gae, its TP×PP checked on the group that hosts it
(its own, or actor-train's when it is not placed), its keys validated by name."""
import pytest

from megarl.config import ConfigError, load_config
from megarl.config.validate import critic_hosted, plan_task_groups

GAE = "algorithm.adv_estimator=gae"
OWN = ["trainer.n_gpus_per_node=4",
       "trainer.separated_node_tasks=[[logp,actor-train,ref_logp],generate,critic]",
       "trainer.separated_node_ratios=[0.5,0.25,0.25]"]


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    return str(err.value)


def test_critic_is_hosted_by_its_own_group_or_beside_actor_train():
    assert critic_hosted(plan_task_groups(load_config(None, [GAE, *OWN]))).name == "critic"
    cfg = load_config(None, [GAE, "trainer.n_gpus_per_node=2",
                             "trainer.separated_node_tasks=[[logp,actor-train],"
                             "[ref_logp,generate]]", "trainer.separated_node_ratios=[0.5,0.5]"])
    assert critic_hosted(plan_task_groups(cfg)).name == "logp+actor-train"


def test_placed_critic_needs_gae():
    msg = error_of(*OWN)
    assert msg.startswith("trainer.separated_node_tasks:") and "adv_estimator=gae" in msg


def test_critic_parallelism_checked_where_it_runs():
    # its own 1-device group cannot hold TP=2
    msg = error_of(GAE, *OWN, "critic.megatron.tensor_model_parallel_size=2")
    assert msg.startswith("critic.megatron.tensor_model_parallel_size:") and "'critic'" in msg
    # beside actor-train (2 devices): TP=2 fits, PP=4 does not
    beside = [GAE, "trainer.n_gpus_per_node=4",
              "trainer.separated_node_tasks=[[logp,actor-train,ref_logp],generate]",
              "trainer.separated_node_ratios=[0.5,0.5]"]
    load_config(None, [*beside, "critic.megatron.tensor_model_parallel_size=2"])
    msg = error_of(*beside, "critic.megatron.pipeline_model_parallel_size=4")
    assert msg.startswith("critic.megatron.tensor_model_parallel_size:") and "critic" in msg
    # without gae the critic's layout is never used, so it is not checked
    load_config(None, ["critic.megatron.pipeline_model_parallel_size=4"])


@pytest.mark.parametrize("override,key", [
    ("critic.loss_agg_mode=seq-mean", "critic.loss_agg_mode"),
    ("critic.cliprange_value=0", "critic.cliprange_value"),
    ("critic.ppo_mini_batch_size=3", "critic.ppo_mini_batch_size"),
    ("trainer.critic_warmup=-1", "trainer.critic_warmup"),
    ("critic.optim.lr=-1", "critic.optim.lr"),
])
def test_bad_critic_keys_are_named(override, key):
    assert error_of(GAE, override).startswith(f"{key}:")
