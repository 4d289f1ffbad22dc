"""Everything a run needs before its first step, and its orderly teardown.

Owns: the quickstart's local assets (tiny model, synthetic task), tokenizer and data, the
reward function, Ray placement of the task groups, the Megatron actor/reference/critic groups,
the rollout servers and their weight-update group, loggers, and resuming from a checkpoint.
Bad configuration fails here, before any worker starts.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from pathlib import Path
from typing import Any

from megarl.config import ConfigError
from megarl.utils.imports import load_callable

from . import checkpoint as ckpt
from .run_plan import RunPlan, make_run_plan

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
    cfg: Any
    tokenizer: Any
    eos_ids: list[int]
    pad_id: int
    loader: Any
    val_dataset: Any
    reward_pool: Any                   # the streaming scorer (megarl.reward.pool.RewardPool)
    actor: Any
    ref: Any
    rollout: Any
    manager: Any
    loggers: Any
    plan: RunPlan                      # everything derived from the config, resolved once
    device_groups: list
    driver_state: dict | None = None   # the resumed checkpoint's driver_state.json
    critic: Any = None                 # the value model (adv_estimator=gae), else None
    logp: Any = None                   # logp's replica, when logp has a group of its own
    transport: Any = None  # cluster/transport.py: how the groups reach their workers
    rollout_fn: Any = None  # actor_rollout_ref.rollout.rollout_fn, imported
    agent: Any = None       # multi_turn.enable: megarl.agent.loop.AgentLoop (its tool workers)

    async def actor_wait(self) -> None:
        if self.actor is not None and self.actor.sync_initialised:
            await self.actor.wait_weight_sync()

    async def close(self, failed: bool = False, keep_transport: bool = False) -> None:
        """Release everything (but the transport with `keep_transport`: a restart follows).
        After a failure the groups get little time each: a worker still blocked on a host
        that is gone must not hold the run's exit."""
        if self.manager is not None:
            await self.manager.close()
        groups = [g for g in (self.actor, self.ref, self.critic, self.logp, self.rollout)
                  if g is not None]
        # All at once: groups sharing a worker thread that is still blocked on a lost peer
        # would otherwise each wait their whole timeout, one after another.
        with concurrent.futures.ThreadPoolExecutor(max(1, len(groups))) as pool:
            list(pool.map(lambda g: g.shutdown(timeout_s=10.0 if failed else 60.0), groups))
        for dg in self.device_groups:
            dg.remove()
        self.loggers.close()
        self.reward_pool.close()
        if self.agent is not None:
            self.agent.close()
        if self.transport is not None and not keep_transport:
            self.transport.close()


def prepare_assets(cfg) -> None:
    """Make the tiny model and the synthetic task when the config asks and they are absent."""
    model = cfg.actor_rollout_ref.model
    if model.make_tiny and not (Path(model.path) / "config.json").is_file():
        from megarl.utils.tiny_model import make_tiny_model

        # A model for a multi-turn run gets the tool markers, and Megatron's scaled init of
        # the residual projections: the agent task is learned from the random model's copies
        multi_turn = bool(cfg.actor_rollout_ref.rollout.multi_turn.enable)
        make_tiny_model(model.path, model.make_tiny, tool_tokens=multi_turn,
                        scaled_residual_init=multi_turn)
    if cfg.data.synthetic_task:
        from megarl.data.synthetic import make_synthetic_task

        # under the names the config gives (it keeps both files when both are there)
        train = Path(str(cfg.data.train_files))
        val = cfg.data.val_files if isinstance(cfg.data.val_files, str) else None
        make_synthetic_task(cfg.data.synthetic_task, train.parent, train_file=train,
                            val_file=val)
    if not (Path(model.path) / "config.json").is_file():
        raise ConfigError(f"actor_rollout_ref.model.path: {model.path} has no config.json "
                          "(set actor_rollout_ref.model.make_tiny to make a tiny one)")


def _replacer(rollout, actor):
    """The manager's way to replace a dead engine: a new server on the same devices, which
    the trainer sends the newest version it published at once, out of band (it would
    otherwise wait for the next version, which with no other engine live never comes), and
    takes into its update group from the next version on."""
    async def replace(i: int):
        from megarl.backends.sglang.engine import SGLangEngine
        from megarl.cluster.group import WorkerLost

        url = await rollout.restart(i)
        if actor is not None and actor.sync_initialised:
            await actor.replace_engine(i, rollout.engines[i])
            try:
                got = await actor.refit_engine(i)
            except WorkerLost:
                raise  # the trainer's loss, not the engine's: the run stops on it
            except Exception as e:  # noqa: BLE001 - it still joins at the next version
                logger.error("rollout engine %d: out-of-band weights failed (%s: %s); it "
                             "joins at the next version", i, type(e).__name__, e)
            else:
                if got:
                    logger.info("rollout engine %d has weights v%d (%.1f MB out of band, "
                                "%.2f s)", i, got["version"], got["bytes"] / 1e6,
                                got["seconds"])
        return SGLangEngine(url)
    return replace


def _total_steps(cfg, loader, val_only: bool, start_step: int) -> int:
    if val_only:
        return start_step  # nothing left to train: validate the weights of that step
    t = cfg.trainer
    return int(t.total_training_steps or t.total_epochs * loader.steps_per_epoch)


def _critic_dir(ckpt_dir: Path) -> Path:
    """A checkpoint's critic; a gae run cannot resume from one saved without it."""
    d = Path(ckpt_dir) / "critic"
    if not d.is_dir():
        raise ConfigError(f"algorithm.adv_estimator: `gae` trains a critic, but the checkpoint "
                          f"{ckpt_dir} has none (saved by a run without a critic); start "
                          "afresh with trainer.resume_mode=disable")
    return d


def _resume_point(cfg, root: Path, val_only: bool):
    """(the checkpoint to resume, verified, or None; its critic's directory for a gae run)."""
    t, found = cfg.trainer, None
    if t.resume_mode == "auto":
        found = ckpt.resume_point(root)
    elif t.resume_mode == "resume_path":
        found = ckpt.resume_from(t.resume_from_path)
    critic_ckpt = None
    if found is not None and cfg.algorithm.adv_estimator == "gae" and not val_only:
        critic_ckpt = _critic_dir(found.path)  # before any worker: a gae run needs its critic
    return found, critic_ckpt


def _position(cfg, found, loader, val_only: bool) -> tuple[int, dict | None, int]:
    """(first step to run, 0-based, the checkpoint's driver state or None, total steps); the
    loader and the RNGs are put back where the checkpoint left them. A checkpoint after k
    completed steps (global_step_k; k+1 for an old-style one named k) resumes at 0-based
    step k, which the console and TensorBoard count as step k+1."""
    start_step, state = 0, None
    if found is not None:
        state = found.state
        start_step = found.completed_steps
        loader.load_state_dict(state["loader"])
        ckpt.set_rng_state(state["rng"])
    total = _total_steps(cfg, loader, val_only, start_step)
    if start_step > total:  # a finished run's checkpoint under a smaller step budget
        raise ConfigError(
            f"trainer.total_training_steps: this run has {total} steps, but the checkpoint "
            f"it resumes ({found.path}) has trained {start_step}; raise "
            f"trainer.total_training_steps, or start afresh with "
            f"trainer.resume_mode=disable or another trainer.experiment_name")
    if found is not None:
        nxt = (f"validating its weights (v{start_step})" if val_only else
               f"training continues at step {start_step + 1}/{total}" if start_step < total
               else "no step left to train")
        logger.info("resuming after step %d from %s; %s", start_step, found.path, nxt)
    return start_step, state, total


def _data(cfg):
    """(tokenizer, EOS ids, pad id, the training prompt loader, the validation set)."""
    from transformers import AutoTokenizer

    from megarl.data.dataset import load_split
    from megarl.data.loader import PromptLoader

    model = cfg.actor_rollout_ref.model
    tok = AutoTokenizer.from_pretrained(model.tokenizer_path or model.path,
                                        trust_remote_code=model.trust_remote_code)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    loader = PromptLoader(load_split(cfg.data, tok, "train"), cfg.data.train_batch_size,
                          shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    return tok, [tok.eos_token_id], pad_id, loader, load_split(cfg.data, tok, "val")


def _workers(cfg, plan: RunPlan):
    """Start the plan's workers: (transport, device groups by name, the rollout group, the
    Megatron groups by role)."""
    from megarl.cluster.group import MegatronGroup, RolloutGroup
    from megarl.cluster.transport import make_transport

    # Ray's actors or torchrun's ranks: the groups below are the same over either.
    transport = make_transport(cfg)
    dgs = {p.name: transport.devices(p, cfg.trainer.device) for p in plan.placement
           if p.tasks != ("reward",)}
    # Processes per device of each group: a device is shared by every model placed on it.
    count = plan.processes_per_group()
    share = {n: 1.0 / max(1, c) for n, c in count.items()}
    gen = plan.generate_group
    rollout = RolloutGroup(transport, dgs[gen], cfg, plan.servers, share[gen], count[gen],
                           log_dir=str(plan.ckpt_root / "logs"))
    models = {role: MegatronGroup(transport, dgs[m.group], cfg, m.spec, share[m.group],
                                  count[m.group])
              for role, m in plan.models.items()}
    # Every worker is spawned before any is waited for: their start-ups (a process each,
    # torch and Megatron imports, the engine's model) overlap instead of queueing.
    rollout.ready()
    MegatronGroup.ready_all(list(models.values()))
    return transport, dgs, rollout, models


def _agent(mt, tok, eos_ids, min_turn_tokens=0):
    if not mt.enable:
        return None
    from megarl.agent.loop import AgentLoop
    from megarl.agent.tools import tool_specs

    return AgentLoop(mt, tok, eos_ids, tool_specs(mt.tools), min_turn_tokens=min_turn_tokens)


async def setup_run(cfg, val_only: bool) -> Run:
    from omegaconf import OmegaConf

    from megarl.backends.sglang.engine import SGLangEngine
    from megarl.observability.loggers import make_loggers
    from megarl.reward import sandbox
    from megarl.reward.pool import RewardPool
    from megarl.rollout.manager import RolloutManager

    arr, t = cfg.actor_rollout_ref, cfg.trainer
    # Pick and verify the checkpoint first: a damaged one is named, with the fallback, before
    # any model, data or worker is loaded (and before Ray, under either launcher).
    root = Path(t.default_local_dir) / t.project_name / t.experiment_name
    found, critic_ckpt = _resume_point(cfg, root, val_only)
    prepare_assets(cfg)
    tok, eos_ids, pad_id, loader, val = _data(cfg)
    # The sandbox's caps and policy reach the reward and tool pools' workers through the
    # environment they are spawned with.
    sb = cfg.reward.sandbox
    sandbox.configure(float(sb.max_time_limit_s), int(sb.max_memory_limit_mb),
                      bool(sb.allow_unhardened))
    # Loads the reward function once here, so a bad reward.reward_fn fails before Ray starts.
    reward_pool = RewardPool.from_config(cfg.reward, int(cfg.data.max_response_length))
    # ... and the rollout function, likewise
    rollout_fn = (load_callable(arr.rollout.rollout_fn, "actor_rollout_ref.rollout.rollout_fn")
                  if arr.rollout.rollout_fn else None)
    # ... and the tools (their workers import them: a bad one fails here, named)
    agent = _agent(arr.rollout.multi_turn, tok, eos_ids, int(arr.rollout.min_new_tokens))
    start_step, state, total = _position(cfg, found, loader, val_only)
    plan = make_run_plan(cfg, root=root, start_step=start_step, total_steps=total,
                         val_only=val_only, resumed=state is not None)
    transport, dgs, rollout, models = _workers(cfg, plan)
    actor, logp = models.get("actor"), models.get("logp")
    if actor is not None:
        links = list(rollout.engines)
        if logp is not None:
            # A resumed run's replicas hold the HF weights until the first sync below.
            links += await logp.serve_replicas(start_step if state is None else start_step - 1)
        await actor.init_weight_sync(links)
        # Servers megarl launches start from dummy weights (launcher.replica_server_args):
        # the first rollout, and validation before training, need the trainer's. Embedded
        # engines, and servers the user runs, load the model's files themselves.
        dummy = arr.rollout.name == "sglang" and not arr.rollout.server_urls
        if state is not None:
            await actor.load(str(found.path / "actor"))
            if "critic" in models:
                await models["critic"].load(str(critic_ckpt))
        if state is not None or dummy:
            await actor.sync_weights(start_step)  # engines start from the HF weights
            await actor.wait_weight_sync()
    manager = RolloutManager([SGLangEngine(u) for u in rollout.urls],
                             replace=_replacer(rollout, actor),
                             health_interval_s=arr.rollout.engine_health_interval_s,
                             health_timeout_s=arr.rollout.engine_health_timeout_s,
                             max_restarts=arr.rollout.engine_max_restarts)
    loggers = make_loggers(list(t.logger), root, total_steps=total, start_step=start_step,
                           project=t.project_name, experiment=t.experiment_name,
                           config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    if val is None and (t.val_before_train or t.test_freq > 0 or val_only):
        logger.warning("no data.val_files: validation is skipped")
    return Run(cfg=cfg, tokenizer=tok, eos_ids=eos_ids, pad_id=pad_id, loader=loader,
               val_dataset=val, reward_pool=reward_pool, actor=actor, ref=models.get("ref"),
               rollout=rollout, manager=manager, loggers=loggers, plan=plan,
               device_groups=list(dgs.values()), driver_state=state,
               critic=models.get("critic"), logp=logp, transport=transport,
               rollout_fn=rollout_fn, agent=agent)
