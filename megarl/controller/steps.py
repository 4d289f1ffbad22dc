"""The work of each state, as plain functions of (the run's state, the step's record).

The Pipeline (machine.py) decides which state of which step runs when and keeps each step's
`StepRecord` (batch.py) while the step is in flight; the driver (driver.py) starts what is
ready and calls the function the action's task names (`STEP_WORK`, `VALIDATION_WORK`). Each
function reads what the states before it put in the record and adds its own part:

    GENERATE    samples, scores (pending), dropped, resume_before
    REWARD      batch (tokens, masks, rewards, rollout log-probs, versions)
    REF_LOGP    batch["ref_logprobs"]       VALUES   batch["values"]
    LOGP        batch["old_logprobs"]       TRAIN    advantages, then the optimizer steps
    SYNC        publishes version k+1       CHECKPOINT  writes global_step_<k+1> (k+1
                                            steps done) with resume_after

`RunState` is what lives across steps: the run's handles, the metrics, the rollout policy and
the in-reward KL coefficient.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any

import torch

from megarl.algo.advantages import compute_advantages, gae_advantages, token_rewards
from megarl.algo.kl import adaptive_kl_coef, apply_kl_in_reward
from megarl.algo.rollout_correction import RolloutCorrection, actor_batch
from megarl.observability.metrics import (MetricsTracker, merge_spans, staleness_metrics,
                                          throughput)
from megarl.observability.val_report import generation_rows, validation_metrics
from megarl.rollout.protocol import version_int

from . import checkpoint as ckpt
from .batch import StepRecord, build_batch, mini_batches
from .micro_batches import micro_batching
from .setup import Run
from .trajectory import TrajectoryRunner, make_policy, sampling_params

logger = logging.getLogger(__name__)

LOGP_WEIGHTS_TIMEOUT_S = 600.0  # a logp replica's wait for the version SYNC(k-1) sent


@dataclasses.dataclass
class RunState:
    run: Run
    pipeline: Any                       # machine.Pipeline: the schedule and the records
    metrics: MetricsTracker
    runner: TrajectoryRunner
    rollout: Any                        # GENERATE's policy over the runner
    kl_coef: float                      # in-reward KL coefficient (adaptive: moves per step)
    val: dict[int, dict] = dataclasses.field(default_factory=dict)  # version -> generated
    val_results: list[dict] = dataclasses.field(default_factory=list)

    @property
    def cfg(self):
        return self.run.cfg

    @classmethod
    def start(cls, run: Run, pipeline) -> "RunState":
        cfg, saved = run.cfg, run.driver_state or {}
        runner = TrajectoryRunner(run.manager, run.tokenizer, run.reward_pool, agent=run.agent,
                                  routing=routing_shape(cfg))
        rollout = make_policy(cfg.actor_rollout_ref.rollout, runner, run.loader,
                              need=cfg.data.train_batch_size,
                              max_staleness=cfg.algorithm.max_staleness,
                              stale_policy=cfg.algorithm.stale_policy, rollout_fn=run.rollout_fn,
                              filter_groups=cfg.algorithm.filter_groups,
                              remax=cfg.algorithm.adv_estimator == "remax")
        rollout.load_state_dict(saved.get("partial"))
        # the adaptive controller's coefficient survives a resume
        kl = float(saved.get("kl_coef", cfg.algorithm.kl_ctrl.kl_coef))
        return cls(run, pipeline, MetricsTracker(), runner, rollout, kl)


def routing_shape(cfg) -> tuple[int, int] | None:
    """(layers, top-k) of the model's routing when the engines report it
    (`rollout.enable_rollout_routing_replay`), else None."""
    if not cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay:
        return None
    from megarl.backends.megatron.hf.model_config import read_model_args

    args = read_model_args(cfg.actor_rollout_ref.model.path)
    return args.num_layers, args.moe_topk


# ------------------------------------------------------------------ GENERATE, REWARD
async def generate(st: RunState, rec: StepRecord) -> None:
    r, k = st.run, rec.step
    sp = sampling_params(st.cfg.actor_rollout_ref.rollout, stop_ids(r),
                         st.cfg.trainer.seed * 1_000_003 + k, max_new_tokens=r.plan.max_new_tokens)
    waited = await engines_at(st, max(r.plan.start_step, k - r.plan.ahead + 1))
    t0 = time.perf_counter()
    out = await st.rollout.run_step(k, sp, k)  # TRAIN(k) starts from version k: staleness
    dt = time.perf_counter() - t0
    samples = out.samples
    tokens = sum(len(s.response_ids) for s in samples)
    rec.samples, rec.scores, rec.dropped = samples, out.scores, out.dropped
    rec.filtered, rec.surplus = out.filtered, out.surplus
    st.metrics.update(k, {"timing/wait_for_weights_s": waited, **out.metrics})
    # engines alive, failed, replaced and requests sent again during this GENERATE
    st.metrics.update(k, r.manager.pop_metrics())
    for _, engine, what in r.manager.pop_events():
        st.pipeline.incident(k, "generate", f"{engine}: {what}")
    st.metrics.update(k, {"rollout/gen_tokens_per_s": tokens / dt if dt else 0.0,
                          "rollout/generate_s": dt,
                          "response/length_mean": tokens / max(1, len(samples)),
                          "response/length_max": max(len(s.response_ids) for s in samples),
                          "response/aborted_resumed_frac": sum(
                              len(set(s.token_versions)) > 1 for s in samples) / len(samples)})
    if r.agent is not None:
        agent_step(st, k, samples)


def stop_ids(r: Run) -> list[int]:
    """What ends a generation: EOS, and with tools the closing call marker (a turn's end)."""
    return list(r.eos_ids) + (r.agent.stop_ids if r.agent is not None else [])


def agent_step(st: RunState, k: int, samples) -> None:
    """A multi-turn step's tool metrics, its tool time on the timeline (one row, "tools":
    the union of the step's tool-call intervals) and its trajectory dump."""
    from megarl.agent.loop import step_metrics, trajectory_json

    st.metrics.update(k, step_metrics(samples))
    # the tool workers' counters (calls, failures, timeouts, latency) since the last step
    st.metrics.update(k, st.run.agent.pool.pop_stats())
    st.pipeline.add_intervals([("tools", "tool", k, a, b)
                               for a, b in merge_spans(st.run.agent.pop_spans())])
    n = int(st.cfg.actor_rollout_ref.rollout.multi_turn.dump_trajectories)
    if n > 0:
        path = st.run.plan.ckpt_root / "trajectories" / f"step_{k}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        ckpt.write_json_atomic(path, [trajectory_json(s, st.run.tokenizer)
                                      for s in samples[:n]])


async def engines_at(st: RunState, version: int, timeout_s: float = 600.0) -> float:
    """Wait until every engine serves weights >= `version`; returns the seconds waited.

    SYNC(k) finishes when the trainer has its snapshot; with the dual buffer the transfer
    to the engines is still landing then. GENERATE(j) is promised version j - a + 1, so
    it waits here for that transfer instead of starting new requests on older weights.
    Polling the engines keeps the trainer free (a call on it would queue behind TRAIN)."""
    if version <= st.run.plan.start_step:
        return 0.0  # the initial (or resumed) weights: loaded before the first step
    t0 = time.perf_counter()
    while True:
        have = await st.run.manager.weight_versions()
        if all(version_int(v) >= version for v in have):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"engines still serve weight versions {have} after "
                               f"{timeout_s:.0f} s; version {version} never landed")
        await asyncio.sleep(0.002)


async def reward(st: RunState, rec: StepRecord) -> None:
    await asyncio.gather(*rec.scores)  # scoring started as each response finished
    rec.batch = build_batch(rec.samples, st.run.pad_id)
    rw = rec.batch["rewards"]
    st.metrics.update(rec.step, {"reward/mean": rw.mean().item(), "reward/max": rw.max().item(),
                                 "reward/min": rw.min().item(),
                                 "reward/exact_frac": (rw >= 1.0).float().mean().item()})
    if st.cfg.reward.reward_kwargs.overlong_buffer_cfg.log:  # DAPO's overlong penalty
        pen = [s.reward - s.score for s in rec.samples if s.score is not None]
        if pen:
            st.metrics.update(rec.step, {
                "reward/overlong_penalty_mean": sum(pen) / len(pen),
                "reward/overlong_frac": sum(p < 0 for p in pen) / len(pen)})


# ------------------------------------------------------------------ the models' passes
def _model_inputs(b: dict, routed: bool = False) -> dict:
    """What a forward pass reads; `routed`: the engines' routing too (the actor's passes,
    for routing replay; the reference model routes by itself)."""
    out = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
    if routed and "routed_experts" in b:
        out["routed_experts"] = b["routed_experts"]
    return out


async def ref_logp(st: RunState, rec: StepRecord) -> None:
    if st.run.ref is None:  # no KL anywhere: nothing consumes reference log-probs
        return
    out = await st.run.ref.compute_logp(
        _model_inputs(rec.batch), st.run.plan.temperature, micro_batching(st.cfg, "ref"))
    rec.batch["ref_logprobs"] = out["logprobs"]


async def values(st: RunState, rec: StepRecord) -> None:
    """VALUES(k): the critic's value of every prefix of step k's batch, for GAE."""
    out = await st.run.critic.compute_values(_model_inputs(rec.batch),
                                             micro_batching(st.cfg, "values"))
    rec.batch["values"] = out["values"]


async def logp(st: RunState, rec: StepRecord) -> None:
    """The proximal policy's log-probs: the weights TRAIN(k) starts from (version k),
    computed by the actor itself or, with logp on a group of its own, by its replica
    there once it holds version k (SYNC(k-1) sent it; the machine orders LOGP after it).
    verl's bypass mode (algorithm.rollout_correction.bypass_mode): no pass, the rollout
    log-probs are the old policy."""
    r, b, k = st.run, rec.batch, rec.step
    if st.cfg.algorithm.rollout_correction.bypass_mode:
        b["old_logprobs"] = b["rollout_logprobs"]
        return
    mbs = micro_batching(st.cfg, "logp")
    if r.logp is None:
        out, version = await r.actor.compute_logp(_model_inputs(b, routed=True),
                                                  r.plan.temperature, mbs), k
    else:
        out, version = await r.logp.compute_logp_at(_model_inputs(b, routed=True),
                                                     r.plan.temperature, mbs, k,
                                                     LOGP_WEIGHTS_TIMEOUT_S)
    st.metrics.update(k, {"actor/logp_version": float(version),
                          "actor/logp_version_lag": float(k - version)})
    b["old_logprobs"] = out["logprobs"]
    mask = b["response_mask"] > 0
    diff = (b["old_logprobs"] - b["rollout_logprobs"])[mask].abs()
    st.metrics.update(k, {"rollout/logp_mismatch_mean": diff.mean().item(),
                          "rollout/logp_mismatch_max": diff.max().item()})


# ------------------------------------------------------------------ TRAIN
def advantages(st: RunState, rec: StepRecord) -> None:
    """Advantages of step k's batch, at the start of TRAIN(k): the in-reward KL penalty
    needs the reference and proximal log-probs of REF_LOGP(k) and LOGP(k)."""
    b, k, alg = rec.batch, rec.step, st.cfg.algorithm
    rewards = b["rewards"]
    if alg.use_kl_in_reward:
        rewards, m = apply_kl_in_reward(rewards, b["old_logprobs"], b["ref_logprobs"],
                                        b["response_mask"], alg.kl_penalty, st.kl_coef)
        st.metrics.update(k, m)
        if alg.kl_ctrl.type == "adaptive":
            st.kl_coef = adaptive_kl_coef(st.kl_coef, m["reward/kl_penalty"],
                                          alg.kl_ctrl.target_kl, len(rewards),
                                          alg.kl_ctrl.horizon)
    if alg.adv_estimator == "gae":
        mask = b["response_mask"]
        b["advantages"], b["returns"] = gae_advantages(
            token_rewards(rewards, mask), b["values"], mask, alg.gamma, alg.lam)
        valid = mask > 0
        st.metrics.update(k, {"critic/values_mean": b["values"][valid].mean().item(),
                              "critic/returns_mean": b["returns"][valid].mean().item()})
        return
    components = None
    if alg.adv_estimator == "gdpo":
        components = gdpo_components(rec.samples, list(alg.gdpo_reward_keys),
                                     float(st.cfg.reward.failure_score))
        for key, c in zip(alg.gdpo_reward_keys, components):
            st.metrics.update(k, {f"gdpo/{key}/mean": c.mean().item(),
                                  f"gdpo/{key}/std": c.std(unbiased=False).item(),
                                  f"gdpo/{key}/max": c.max().item(),
                                  f"gdpo/{key}/min": c.min().item()})
    b["advantages"] = compute_advantages(
        alg.adv_estimator, rewards, [s.uid for s in rec.samples], b["response_mask"],
        norm_by_std=alg.norm_adv_by_std_in_grpo, gamma=alg.gamma,
        baselines=b.get("reward_baselines"), components=components,
        component_weights=alg.gdpo_reward_weights)


def gdpo_components(samples, keys: list[str], failure_score: float) -> torch.Tensor:
    """[K, N] the samples' reward components named by ``algorithm.gdpo_reward_keys``. A sample
    whose reward call failed has none: it gets ``reward.failure_score`` in each, as its score
    did. A reward function that returned no such entry is a run error naming the key."""
    rows = []
    for key in keys:
        row = []
        for s in samples:
            if s.reward_extra is None:
                row.append(failure_score)
            elif key in s.reward_extra:
                row.append(s.reward_extra[key])
            else:
                raise RuntimeError(
                    f"algorithm.gdpo_reward_keys: {key!r} is not among the numbers the reward "
                    f"function returned for data_source {s.data_source!r} (it returned "
                    f"{sorted(s.reward_extra) or 'a bare score'}); return a dict with "
                    f"'score' and {key!r}")
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)


async def _train_critic(st: RunState, rec: StepRecord) -> None:
    """The critic's optimizer steps on step k's batch (clipped value loss)."""
    c, actor, b = st.cfg.critic, st.cfg.actor_rollout_ref.actor, rec.batch
    keys = ("input_ids", "attention_mask", "response_mask", "values", "returns")
    mbs = mini_batches({n: b[n] for n in keys}, st.cfg.actor_rollout_ref.rollout.n,
                       c.ppo_mini_batch_size or actor.ppo_mini_batch_size,
                       c.ppo_epochs or actor.ppo_epochs)
    for s in await st.run.critic.train_critic(mbs, micro_batching(st.cfg, "critic")):
        for name, v in s.items():
            st.metrics.add(rec.step, _role_metric("critic", name), v)


async def train(st: RunState, rec: StepRecord) -> None:
    advantages(st, rec)
    r, b, k = st.run, rec.batch, rec.step
    actor = st.cfg.actor_rollout_ref.actor
    # verl's rollout correction over the whole step's batch: the actor's weights and
    # rejections (the advantages above and the critic keep the batch's own mask)
    trained, corr = actor_batch(b, RolloutCorrection.from_config(st.cfg.algorithm
                                                                 .rollout_correction))
    st.metrics.update(k, corr)
    mbs = mini_batches(trained, st.cfg.actor_rollout_ref.rollout.n, actor.ppo_mini_batch_size,
                       actor.ppo_epochs)
    t0 = time.perf_counter()
    # trainer.critic_warmup: the first steps train the critic only (the actor's weights,
    # hence the versions SYNC publishes, stay as they were)
    train_actor = r.critic is None or k >= st.cfg.trainer.critic_warmup
    jobs = [r.actor.train(mbs, micro_batching(st.cfg, "actor"), r.plan.temperature)
            if train_actor else asyncio.sleep(0, [])]
    if r.critic is not None:  # on its own group, it trains while the actor does
        jobs.append(_train_critic(st, rec))
        st.metrics.update(k, {"critic/warmup": float(not train_actor)})
    stats = (await asyncio.gather(*jobs))[0]
    dt = time.perf_counter() - t0
    for s in stats:
        for name, v in s.items():
            st.metrics.add(k, _role_metric("actor", name), v)
    st.metrics.update(k, throughput(int(b["attention_mask"].sum()), dt))
    # per response token: a sync may land mid-request, so tokens of one sample differ
    versions = b["token_versions"][b["response_mask"] > 0].tolist()
    st.metrics.update(k, staleness_metrics(k, versions))
    _record_prompts(st, rec)


def _role_metric(role: str, name: str) -> str:
    """A trainer's metric under its role (`actor/`, `critic/`), its mixture-of-experts ones
    (`moe/...`) included; names of their own (`memory/...`) as they are."""
    return name if "/" in name and not name.startswith("moe/") else f"{role}/{name}"


def _record_prompts(st: RunState, rec: StepRecord) -> None:
    """Append which prompts step k trained on (an audit trail that resume tests read)."""
    line = {"step": rec.step, "uids": sorted({s.uid for s in rec.samples})}
    if rec.dropped:
        line["dropped"] = sorted(rec.dropped)  # over max_staleness
    if rec.filtered:  # dynamic sampling: consumed, not trained (no spread; beyond the batch)
        line["filtered"] = sorted(rec.filtered)
    if rec.surplus:
        line["surplus"] = sorted(rec.surplus)
    st.run.plan.ckpt_root.mkdir(parents=True, exist_ok=True)
    with open(st.run.plan.ckpt_root / "trained_prompts.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


# ------------------------------------------------------------------ SYNC, CHECKPOINT
async def sync(st: RunState, rec: StepRecord) -> None:
    stats = await st.run.actor.sync_weights(rec.step + 1)
    st.metrics.update(rec.step, {f"weight_sync/{n}": v for n, v in stats.items()})


def resume_state(st: RunState, k: int) -> dict:
    """The driver's part of the checkpoint after 0-based step k, as it stands when SYNC(k) has
    finished: k+1 steps are done (its `step`, and its name global_step_<k+1>) and the trainer
    holds version k+1; the next step's prompts have not been trained on, so the loader is
    saved at the position before them."""
    nxt = st.pipeline.records.get(k + 1)  # GENERATE(k+1) has started (one step off or more)
    owed = nxt.resume_before if nxt is not None else {
        "loader": st.run.loader.state_dict(), "partial": st.rollout.state_dict()}
    return {"step": k + 1, "weight_version": k + 1, "loader": owed["loader"],
            "partial": owed["partial"], "kl_coef": st.kl_coef, "rng": ckpt.rng_state()}


async def checkpoint(st: RunState, rec: StepRecord) -> None:
    """CHECKPOINT(k), on the trainer's group: the weights SYNC(k) published (TRAIN(k+1)
    waits for this), with the resume state taken when SYNC(k) finished. Named by completed
    steps, as verl: 0-based step k's checkpoint is global_step_<k+1>."""
    r, k, t0 = st.run, rec.step, time.perf_counter()
    done = k + 1
    tmp = ckpt.begin(r.plan.ckpt_root, done)
    await r.actor.save(str(tmp / "actor"), step=done)
    if r.critic is not None:
        await r.critic.save(str(tmp / "critic"), step=done)
    # every rank's files are complete (the save returned on all of them); checksumming a
    # large checkpoint takes a while, so it runs off the event loop
    await asyncio.to_thread(ckpt.commit, r.plan.ckpt_root, done, rec.resume_after,
                            keep=st.cfg.trainer.max_actor_ckpt_to_keep)
    r.loggers.log(done, {"timing/checkpoint": time.perf_counter() - t0})


# ------------------------------------------------------------------ validation
async def val_generate(st: RunState, version: int) -> None:
    r = st.run
    await engines_at(st, version)
    sp = sampling_params(st.cfg.actor_rollout_ref.rollout, stop_ids(r), st.cfg.trainer.seed,
                         validation=True, max_new_tokens=r.plan.max_new_tokens)
    out = await st.runner.prompts(list(r.val_dataset), sp, f"v{version}",
                                  round_size=st.cfg.data.val_batch_size)
    if r.agent is not None:
        r.agent.pop_spans()  # the timeline's tool row is training's
    st.val[version] = {"samples": out.samples, "scores": out.scores}


async def val_score(st: RunState, version: int) -> None:
    d = st.val.pop(version)
    rewards = await asyncio.gather(*d["scores"])
    samples, t = d["samples"], st.cfg.trainer
    overlong = st.cfg.reward.reward_kwargs.overlong_buffer_cfg
    # the aggregate val/* and verl's per-source val-core/*, val-aux/*
    m = validation_metrics(samples, rewards, log_overlong=overlong.enable and overlong.log)
    if st.run.agent is not None:
        from megarl.agent.loop import step_metrics
        m.update({k.replace("rollout/", "val/"): v
                  for k, v in step_metrics(samples).items()})
    st.val_results.append({"version": version, **m})
    logger.info("validation of weights v%d: %s", version,
                " ".join(f"{k}={v:.4f}" for k, v in m.items() if k.startswith("val/")))
    st.run.loggers.log(version, m)
    if t.log_val_generations > 0:
        st.run.loggers.log_generations(version, generation_rows(
            samples, rewards, st.run.tokenizer, t.log_val_generations))


# What each task of a step runs; validation's tasks take the weight version instead.
STEP_WORK = {"generate": generate, "reward": reward, "ref_logp": ref_logp, "values": values,
             "logp": logp, "actor-train": train, "sync": sync, "checkpoint": checkpoint}
VALIDATION_WORK = {"val-generate": val_generate, "val-score": val_score}
