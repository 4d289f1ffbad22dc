"""Worker specs: what each worker is told instead of the run's config, resolved once."""
import dataclasses
import pickle

import pytest

from megarl.cluster.spec import MegatronSpec, ServerSpec, megatron_spec, server_spec
from megarl.config import load_config

ARR = "actor_rollout_ref"


def test_every_role_gets_its_own_model_and_only_what_it_uses():
    cfg = load_config(None, [
        "trainer.n_gpus_per_node=16", "algorithm.adv_estimator=gae",
        "trainer.separated_node_tasks=[logp,ref_logp,actor-train,critic,generate]",
        "trainer.separated_node_ratios=[0.25,0.125,0.25,0.25,0.125]",
        f"{ARR}.actor.megatron.tensor_model_parallel_size=2", f"{ARR}.actor.optim.lr=3e-4",
        f"{ARR}.logp.pipeline_model_parallel_size=2", "critic.model.path=/models/critic",
        "critic.optim.lr=7e-4", f"{ARR}.rollout.param_update_preduce_bucket_size_mb=64",
        f"{ARR}.rollout.param_update_consume_bucket_size_mb=32"])
    actor, ref, logp, critic = (megatron_spec(cfg, r) for r in ("actor", "ref", "logp", "critic"))
    assert (actor.model.tp, actor.model.pp, actor.model.optim.lr) == (2, 1, 3e-4)
    assert actor.sync.produce_bucket_mb == 64 and actor.sync.consume_bucket_mb == 32
    assert actor.actor_loss is not None and actor.critic_loss is None
    # frozen models: no optimizer, no loss, no weights to send
    assert ref.model.optim is None and ref.actor_loss is None and ref.sync is None
    assert (ref.model.tp, ref.model.pp) == (1, 1)
    # the logp replica: null TP is the actor's, its own PP; it receives from the actor's HF
    assert (logp.model.tp, logp.model.pp, logp.model.optim) == (2, 2, None)
    assert logp.hf_path == actor.model.path
    # the critic: its own model path, optimizer and loss; a value head
    assert critic.model.path == "/models/critic" and critic.model.value_model
    assert critic.model.optim.lr == 7e-4 and critic.actor_loss is None
    assert critic.critic_loss.loss_agg_mode == cfg.actor_rollout_ref.actor.loss_agg_mode


def test_derived_loss_settings_are_resolved_once_here():
    cfg = load_config(None, [f"{ARR}.actor.clip_ratio=0.3", f"{ARR}.actor.clip_ratio_high=0.28",
                             "data.max_response_length=40"])
    loss = megatron_spec(cfg, "actor").actor_loss
    assert (loss.clip_ratio_low, loss.clip_ratio_high) == (0.3, 0.28)
    assert loss.loss_scale_factor == 40.0  # null: the response budget
    cfg = load_config(None, [f"{ARR}.actor.loss_scale_factor=7"])
    assert megatron_spec(cfg, "actor").actor_loss.loss_scale_factor == 7.0


def test_specs_are_frozen_and_cross_a_process_boundary():
    cfg = load_config(None, [f"{ARR}.rollout.name=sglang"])
    spec = megatron_spec(cfg, "actor")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.role = "ref"
    assert pickle.loads(pickle.dumps(spec)) == spec
    server = server_spec(cfg, 1)
    assert isinstance(server, ServerSpec) and pickle.loads(pickle.dumps(server)) == server
    # the seed is the replica's; address, port and GPU are the worker's to fill in
    assert server.args.random_seed == cfg.trainer.seed + 1
    assert server.args.host == "" and server.args.port == 0
    assert server.module == "sglang.launch_server"
    assert isinstance(spec, MegatronSpec) and "cfg" not in {f.name for f in
                                                           dataclasses.fields(MegatronSpec)}


def test_an_unknown_role_is_refused():
    with pytest.raises(ValueError, match="role must be one of actor, ref, logp, critic"):
        megatron_spec(load_config(None, []), "reward")
