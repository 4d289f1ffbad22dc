"""The run plan: derived once from the config, frozen, and what setup builds workers from."""
import dataclasses
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.controller.run_plan import make_run_plan

ARR = "actor_rollout_ref"
SEED_LAYOUT = ["trainer.n_gpus_per_node=4",
               "+trainer.sperated_node_tasks=[logp,ref_logp,actor-train,generate]",
               "+trainer.sperated_node_ratios=[0.25,0.25,0.25,0.25]"]


def _plan(*overrides, val_only=False, resumed=False, start=0):
    cfg = load_config(None, list(overrides))
    return make_run_plan(cfg, root=Path("/runs/x"), start_step=start, total_steps=8,
                         val_only=val_only, resumed=resumed)


def test_the_seed_layout_places_each_model_on_its_group_with_its_spec():
    p = _plan(*SEED_LAYOUT, f"{ARR}.actor.use_kl_loss=true", f"{ARR}.rollout.name=sglang",
              "actor_rollout_ref.async_pipeline=true")
    assert p.ahead == 2  # the seed alias, resolved
    assert {r: m.group for r, m in p.models.items()} == {
        "actor": "actor-train", "ref": "ref_logp", "logp": "logp"}
    assert p.models["actor"].spec.sync is not None and p.models["ref"].spec.model.optim is None
    assert p.generate_group == "generate" and len(p.servers) == 1  # one TP-1 replica
    assert p.groups["logp"] == "logp" and p.groups["reward"] == "reward"
    # one process per device for each model and for the engines
    assert p.processes_per_group() == {"logp": 1, "ref_logp": 1, "actor-train": 1,
                                       "generate": 1}


def test_models_follow_what_the_run_needs():
    # no KL anywhere: no reference model; logp beside the trainer: no replica
    assert set(_plan().models) == {"actor"}
    shared = _plan(f"{ARR}.actor.use_kl_loss=true", "algorithm.adv_estimator=gae")
    assert set(shared.models) == {"actor", "ref", "critic"}
    # the default layout colocates everything: the engines and three models share each device
    assert shared.processes_per_group() == {shared.generate_group: 4}
    # validation only: the trainer only to load a checkpoint's weights
    assert set(_plan(val_only=True).models) == set()
    assert set(_plan(f"{ARR}.actor.use_kl_loss=true", val_only=True, resumed=True).models) == \
        {"actor"}


def test_launched_servers_load_dummy_weights_only_where_a_trainer_sends_its_own():
    stock = f"{ARR}.rollout.name=sglang"
    assert {s.args.load_format for s in _plan(stock).servers} == {"dummy"}
    assert {s.args.load_format for s in _plan(stock, val_only=True, resumed=True).servers} \
        == {"dummy"}
    # validating the HF model itself: no trainer, the servers load the model's files
    assert {s.args.load_format for s in _plan(stock, val_only=True).servers} == {"auto"}


def test_the_plan_is_frozen():
    p = _plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.ahead = 3
    with pytest.raises(TypeError):
        p.models["ref"] = p.models["actor"]
    with pytest.raises(TypeError):
        p.groups["generate"] = "elsewhere"
