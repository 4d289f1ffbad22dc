"""The run plan: what a run derives from its config and its checkpoint, resolved once.

Built after the config has been checked and the checkpoint chosen, before any worker starts,
and frozen. It is where each derived value lives: how far generation runs ahead, the step
range, which task runs on which group and which devices each group owns, which models the run
builds, on which group, and the spec each model's workers are sent (cluster/spec.py), and the
launched rollout servers' specs. Setup builds workers from it; nothing after reads the config
for these again.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from megarl.cluster.spec import MegatronSpec, ServerSpec, megatron_spec, server_spec
from megarl.cluster.topology import GroupPlan
from megarl.config import plan_task_groups
from megarl.config.validate import critic_hosted, hosting

from .machine import task_groups


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    spec: MegatronSpec   # what each of its workers is told
    group: str           # the task group whose devices it runs on


@dataclasses.dataclass(frozen=True)
class RunPlan:
    ahead: int                          # trainer.generate_ahead_steps (async_pipeline: alias)
    start_step: int                     # the first step to run (after a checkpoint's)
    total_steps: int
    max_new_tokens: int
    temperature: float
    ckpt_root: Path                     # default_local_dir/project/experiment
    groups: Mapping[str, str]           # task -> the group it runs on (machine.task_groups)
    placement: tuple[GroupPlan, ...]    # each group's devices (cluster/topology.py)
    generate_group: str
    models: Mapping[str, ModelPlan]     # role (actor, ref, critic, logp) -> its plan
    servers: tuple[ServerSpec, ...]     # launched rollout servers, one per replica

    def processes_per_group(self) -> dict[str, int]:
        """Worker processes per device of each group: one per model placed on it, and one
        for the rollout engines of the generate group."""
        count = {p.name: 0 for p in self.placement if p.tasks != ("reward",)}
        count[self.generate_group] += 1
        for m in self.models.values():
            count[m.group] += 1
        return count


def make_run_plan(cfg, *, root: Path, start_step: int, total_steps: int, val_only: bool,
                  resumed: bool) -> RunPlan:
    """The plan of the run `cfg` describes (checked: config/validate.py), starting at
    `start_step` of `total_steps`; `resumed`: from a checkpoint (whose weights a validation-
    only run then needs a trainer to load)."""
    arr, t, alg = cfg.actor_rollout_ref, cfg.trainer, cfg.algorithm
    plans = plan_task_groups(cfg)
    actor = hosting(plans, "actor-train").name
    where: dict[str, str] = {}
    # val_only with no checkpoint validates the HF model itself: no trainer is needed.
    if not val_only or resumed:
        where["actor"] = actor
    if not val_only:
        if arr.actor.use_kl_loss or alg.use_kl_in_reward:
            where["ref"] = hosting(plans, "ref_logp").name
        if alg.adv_estimator == "gae":  # on its own task group, or beside actor-train
            where["critic"] = critic_hosted(plans).name
        logp = hosting(plans, "logp").name
        if logp != actor:  # a frozen replica of the actor there, fed by the weight sync
            where["logp"] = logp
    r = arr.rollout
    servers = ()
    if r.name == "sglang" and not r.server_urls:
        replicas = hosting(plans, "generate").num_devices // r.tensor_model_parallel_size
        # dummy weights where the trainer sends its own before the first rollout; the model's
        # files where no trainer runs (validating the HF model itself)
        servers = tuple(server_spec(cfg, j, "dummy" if "actor" in where else "auto")
                        for j in range(replicas))
    schedule = None if val_only else total_steps  # the LR schedule's length, where null
    groups = task_groups([list(g) if not isinstance(g, str) else g
                          for g in t.separated_node_tasks])
    return RunPlan(
        ahead=int(t.generate_ahead_steps), start_step=start_step, total_steps=total_steps,
        max_new_tokens=int(r.max_new_tokens), temperature=float(r.temperature),
        ckpt_root=root, groups=MappingProxyType(dict(groups)), placement=tuple(plans),
        generate_group=hosting(plans, "generate").name,
        models=MappingProxyType({role: ModelPlan(megatron_spec(cfg, role, schedule), g)
                                 for role, g in where.items()}),
        servers=servers)
