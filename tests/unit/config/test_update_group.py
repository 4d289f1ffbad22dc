"""Which backend the weight-update group uses: NCCL between distinct GPUs; gloo where two of
its ranks would share a GPU (NCCL refuses a duplicate device) or on the CPU."""
import pytest

from megarl.cluster.spec import megatron_spec
from megarl.config import load_config
from megarl.config.errors import ConfigError

R = "actor_rollout_ref.rollout.update_group_backend"
CUDA = ["trainer.device=cuda", "trainer.n_gpus_per_node=4"]
COLOCATED = ["trainer.separated_node_tasks=[[generate,ref_logp,logp,actor-train]]",
             "trainer.separated_node_ratios=[1.0]"]
SEPARATED = ["trainer.separated_node_tasks=[[logp,actor-train,ref_logp],[generate]]",
             "trainer.separated_node_ratios=[0.5,0.5]"]
LOGP_ON_GENERATE = ["trainer.separated_node_tasks=[[logp,generate],[actor-train,ref_logp]]",
                    "trainer.separated_node_ratios=[0.5,0.5]"]


@pytest.mark.parametrize("overrides,backend", [
    (SEPARATED + ["trainer.n_gpus_per_node=2"], "gloo"),  # on the CPU
    (CUDA + SEPARATED, "nccl"),                     # trainer | generate on distinct GPUs
    (CUDA + COLOCATED, "gloo"),                     # the one-GPU quickstart: a shared GPU
    (CUDA + LOGP_ON_GENERATE, "gloo"),              # replica ranks beside engine ranks
    (CUDA + COLOCATED + [f"{R}=gloo"], "gloo"),
    (CUDA + SEPARATED + [f"{R}=gloo"], "gloo"),
])
def test_auto_resolves_where_the_ranks_sit(overrides, backend):
    cfg = load_config(None, overrides)
    assert cfg.actor_rollout_ref.rollout.update_group_backend == backend
    assert megatron_spec(cfg, "actor").sync.backend == backend


def test_servers_the_user_runs_are_the_users_to_place():
    cfg = load_config(None, CUDA + COLOCATED + [
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.server_urls=[http://10.0.0.5:30000]"])
    assert cfg.actor_rollout_ref.rollout.update_group_backend == "nccl"


@pytest.mark.parametrize("overrides,says", [
    (CUDA + COLOCATED + [f"{R}=nccl"], "two ranks on one GPU"),
    (CUDA + LOGP_ON_GENERATE + [f"{R}=nccl"], "logp replica"),
    ([f"{R}=nccl"], "trainer.device=cuda"),
    ([f"{R}=mpi"], R),
])
def test_nccl_where_it_cannot_run_is_refused_by_key(overrides, says):
    with pytest.raises(ConfigError, match=R.replace(".", r"\.")) as err:
        load_config(None, overrides)
    assert says in str(err.value)
