"""The asyncio driver: turns the Pipeline's actions into coarse calls on group handles.

`run(cfg)` is the whole job: set up data, reward, Ray groups, engines and weight sync, then
loop — start every action the Pipeline says is ready, await whichever finishes first, tell the
Pipeline — until the planned steps (or, with `val_only`, the one validation) are done. The
Pipeline (machine.py) owns which step is in which state; this module owns the step data (the
samples and tensors each state produces) and the side effects (metrics, checkpoints).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time


from megarl.algo.advantages import compute_advantages, gae_advantages, token_rewards
from megarl.algo.kl import adaptive_kl_coef, apply_kl_in_reward
from megarl.config import plan_task_groups
from megarl.observability.metrics import (MetricsTracker, pipeline_step_metrics,
                                          staleness_metrics, throughput)
from megarl.observability.timeline import render_png, write_chrome_trace
from megarl.rollout.protocol import version_int

from . import checkpoint as ckpt
from .batch import StepRecord, build_batch, mini_batches
from .machine import Pipeline
from .setup import Run, setup_run
from .trajectory import TrajectoryRunner, make_policy, sampling_params
from .validation import first_last_table

logger = logging.getLogger(__name__)



LOGP_WEIGHTS_TIMEOUT_S = 600.0  # a logp replica's wait for the version SYNC(k-1) sent


def _describe(err: BaseException) -> str:
    """`Type: message` of a failed state's error; for an error a Ray worker raised, of the
    worker's own exception (Ray's wrapper adds a banner and the remote traceback)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and type(err).__name__.startswith("RayTaskError"):
        err = cause
    return f"{type(err).__name__}: {err}"

class Driver:
    def __init__(self, run: Run):
        self.r = run
        self.cfg = run.cfg
        self.steps: dict[int, StepRecord] = {}   # step -> what its states produced
        self.owed_saves: dict[int, dict] = {}     # step -> its resume state, until saved
        self.metrics = MetricsTracker()
        self.val: dict[int, dict] = {}
        # Scores each response in a worker process as soon as it finishes (streaming).
        self.scorer = run.reward_pool
        self.val_results: list[dict] = []
        saved = run.driver_state or {}
        # In-reward KL coefficient: the adaptive controller's value survives a resume.
        self.kl_coef = float(saved.get("kl_coef", self.cfg.algorithm.kl_ctrl.kl_coef))
        # GENERATE's policy over one trajectory runner: plain, partial, or the user's function
        rc = self.cfg.actor_rollout_ref.rollout
        self.runner = TrajectoryRunner(run.manager, run.tokenizer, self.scorer)
        self.rollout = make_policy(rc, self.runner, run.loader,
                                   need=self.cfg.data.train_batch_size,
                                   max_staleness=self.cfg.algorithm.max_staleness,
                                   stale_policy=self.cfg.algorithm.stale_policy,
                                   rollout_fn=run.rollout_fn)
        self.rollout.load_state_dict(saved.get("partial"))

    # ---------------------------------------------------------------- the loop
    async def main(self, pipeline: Pipeline) -> None:
        self.p = pipeline
        running: dict[asyncio.Task, object] = {}
        # A host lost under torchrun may leave the work in flight waiting on it for minutes
        # (a collective, an HTTP call); its silence ends the run as soon as it is noticed.
        health = self.r.transport.health() if self.r.transport is not None else None
        lost = asyncio.wrap_future(health) if health is not None else None
        try:
            while not pipeline.done:
                for action in pipeline.ready():
                    pipeline.start(action)
                    running[asyncio.create_task(self.execute(action))] = action
                if not running:
                    raise RuntimeError("pipeline stalled: nothing ready and nothing running")
                watch = set(running) | ({lost} if lost is not None else set())
                finished, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
                if lost is not None and lost in finished:
                    doing = ", ".join(str(a) for a in running.values())
                    logger.error("a rank was lost while %s ran: %s", doing,
                                 _describe(lost.exception()))
                    raise RuntimeError(f"{lost.exception()}; in flight: {doing}")
                for t in finished:
                    action = running.pop(t)
                    err = None if t.cancelled() else t.exception()
                    if err is not None:  # a failed state fails the run
                        logger.error("%s failed: %s", action, _describe(err))
                    t.result()  # ... with its own traceback
                    pipeline.finish(action)
                    await self.after(action)
        finally:
            for t in running:
                t.cancel()
            if lost is not None and not lost.done():
                lost.cancel()

    async def execute(self, a) -> None:
        k = a.step
        fn = {"generate": self.generate, "reward": self.reward, "ref_logp": self.ref_logp,
              "values": self.values, "logp": self.logp, "actor-train": self.train,
              "sync": self.sync, "checkpoint": self.checkpoint,
              "val-generate": self.val_generate, "val-score": self.val_score}[a.task]
        t0 = time.perf_counter()
        await fn(a.version if a.task.startswith("val-") else k)
        logger.debug("%s took %.3f s", a, time.perf_counter() - t0)

    async def after(self, a) -> None:
        if a.task == "sync":
            await self.finish_step(a.step)

    # ---------------------------------------------------------------- step states
    async def generate(self, k: int) -> None:
        r = self.r
        # What is owed training before this step's prompts: where a checkpoint of step k-1
        # resumes (the loader position, and the partial-rollout cache as it is now).
        rec = self.steps[k] = StepRecord(k, {"loader": r.loader.state_dict(),
                                             "partial": self.rollout.state_dict()})
        sp = sampling_params(self.cfg.actor_rollout_ref.rollout, r.eos_ids,
                             self.cfg.trainer.seed * 1_000_003 + k,
                             max_new_tokens=r.max_new_tokens)
        waited = await self._engines_at(max(r.start_step, k - r.ahead + 1))
        t0 = time.perf_counter()
        # TRAIN(k) starts from version k: staleness is measured against that
        out = await self.rollout.run_step(k, sp, k)
        samples, extra = out.samples, {"timing/wait_for_weights_s": waited, **out.metrics}
        dt = time.perf_counter() - t0
        tokens = sum(len(s.response_ids) for s in samples)
        rec.samples, rec.scores, rec.dropped = samples, out.scores, out.dropped
        self.metrics.update(k, extra)
        # engines alive, failed, replaced and requests sent again during this GENERATE
        self.metrics.update(k, r.manager.pop_metrics())
        for _, engine, what in r.manager.pop_events():
            self.p.incident(k, "generate", f"{engine}: {what}")
        self.metrics.update(k, {"rollout/gen_tokens_per_s": tokens / dt if dt else 0.0,
                                "rollout/generate_s": dt,
                                "response/length_mean": tokens / max(1, len(samples)),
                                "response/length_max": max(len(s.response_ids)
                                                           for s in samples),
                                "response/aborted_resumed_frac": sum(
                                    len(set(s.token_versions)) > 1 for s in samples) /
                                len(samples)})

    async def _engines_at(self, version: int, timeout_s: float = 600.0) -> float:
        """Wait until every engine serves weights >= `version`; returns the seconds waited.

        SYNC(k) finishes when the trainer has its snapshot; with the dual buffer the transfer
        to the engines is still landing then. GENERATE(j) is promised version j - a + 1, so
        it waits here for that transfer instead of starting new requests on older weights.
        Polling the engines keeps the trainer free (a call on it would queue behind TRAIN)."""
        if version <= self.r.start_step:
            return 0.0  # the initial (or resumed) weights: loaded before the first step
        t0 = time.perf_counter()
        while True:
            have = await self.r.manager.weight_versions()
            if all(version_int(v) >= version for v in have):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"engines still serve weight versions {have} after "
                                   f"{timeout_s:.0f} s; version {version} never landed")
            await asyncio.sleep(0.002)

    async def reward(self, k: int) -> None:
        rec = self.steps[k]
        await asyncio.gather(*rec.scores)  # scoring started as each response finished
        rec.batch = build_batch(rec.samples, self.r.pad_id)
        rw = rec.batch["rewards"]
        self.metrics.update(k, {"reward/mean": rw.mean().item(), "reward/max": rw.max().item(),
                                "reward/min": rw.min().item(),
                                "reward/exact_frac": (rw >= 1.0).float().mean().item()})

    def _advantages(self, k: int) -> None:
        """Advantages of step k's batch, at the start of TRAIN(k): the in-reward KL penalty
        needs the reference and proximal log-probs of REF_LOGP(k) and LOGP(k)."""
        b = self.steps[k].batch
        alg = self.cfg.algorithm
        rewards = b["rewards"]
        if alg.use_kl_in_reward:
            rewards, m = apply_kl_in_reward(rewards, b["old_logprobs"], b["ref_logprobs"],
                                            b["response_mask"], alg.kl_penalty, self.kl_coef)
            self.metrics.update(k, m)
            if alg.kl_ctrl.type == "adaptive":
                self.kl_coef = adaptive_kl_coef(self.kl_coef, m["reward/kl_penalty"],
                                                alg.kl_ctrl.target_kl, len(rewards),
                                                alg.kl_ctrl.horizon)
        if alg.adv_estimator == "gae":
            mask = b["response_mask"]
            b["advantages"], b["returns"] = gae_advantages(
                token_rewards(rewards, mask), b["values"], mask, alg.gamma, alg.lam)
            valid = mask > 0
            self.metrics.update(k, {"critic/values_mean": b["values"][valid].mean().item(),
                                    "critic/returns_mean": b["returns"][valid].mean().item()})
            return
        b["advantages"] = compute_advantages(
            alg.adv_estimator, rewards, [s.uid for s in self.steps[k].samples],
            b["response_mask"], norm_by_std=alg.norm_adv_by_std_in_grpo, gamma=alg.gamma)

    async def ref_logp(self, k: int) -> None:
        if self.r.ref is None:  # no KL anywhere: nothing consumes reference log-probs
            return
        b = self.steps[k].batch
        out = await self.r.ref.compute_logp(self._model_inputs(b), self.r.temperature,
                                            self.cfg.actor_rollout_ref.ref
                                            .log_prob_micro_batch_size_per_gpu)
        b["ref_logprobs"] = out["logprobs"]

    async def values(self, k: int) -> None:
        """VALUES(k): the critic's value of every prefix of step k's batch, for GAE."""
        b = self.steps[k].batch
        c = self.cfg.critic
        out = await self.r.critic.compute_values(
            self._model_inputs(b), c.forward_micro_batch_size_per_gpu
            or c.ppo_micro_batch_size_per_gpu)
        b["values"] = out["values"]

    async def _train_critic(self, k: int, b: dict) -> None:
        """The critic's optimizer steps on step k's batch (clipped value loss)."""
        c, actor = self.cfg.critic, self.cfg.actor_rollout_ref.actor
        keys = ("input_ids", "attention_mask", "response_mask", "values", "returns")
        mbs = mini_batches({n: b[n] for n in keys}, self.cfg.actor_rollout_ref.rollout.n,
                           c.ppo_mini_batch_size or actor.ppo_mini_batch_size,
                           c.ppo_epochs or actor.ppo_epochs)
        for s in await self.r.critic.train_critic(mbs, c.ppo_micro_batch_size_per_gpu):
            for name, v in s.items():
                self.metrics.add(k, name if "/" in name else f"critic/{name}", v)

    async def logp(self, k: int) -> None:
        """The proximal policy's log-probs: the weights TRAIN(k) starts from (version k),
        computed by the actor itself or, with logp on a group of its own, by its replica
        there once it holds version k (SYNC(k-1) sent it; the machine orders LOGP after it)."""
        b = self.steps[k].batch
        mbs = self.cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
        if self.r.logp is None:
            out, version = await self.r.actor.compute_logp(self._model_inputs(b),
                                                           self.r.temperature, mbs), k
        else:
            out, version = await self.r.logp.compute_logp_at(
                self._model_inputs(b), self.r.temperature, mbs, k, LOGP_WEIGHTS_TIMEOUT_S)
        self.metrics.update(k, {"actor/logp_version": float(version),
                                "actor/logp_version_lag": float(k - version)})
        b["old_logprobs"] = out["logprobs"]
        mask = b["response_mask"] > 0
        diff = (b["old_logprobs"] - b["rollout_logprobs"])[mask].abs()
        self.metrics.update(k, {"rollout/logp_mismatch_mean": diff.mean().item(),
                                "rollout/logp_mismatch_max": diff.max().item()})

    async def train(self, k: int) -> None:
        self._advantages(k)
        b = self.steps[k].batch
        actor = self.cfg.actor_rollout_ref.actor
        mbs = mini_batches(b, self.cfg.actor_rollout_ref.rollout.n, actor.ppo_mini_batch_size,
                           actor.ppo_epochs)
        t0 = time.perf_counter()
        # trainer.critic_warmup: the first steps train the critic only (the actor's weights,
        # hence the versions SYNC publishes, stay as they were)
        train_actor = self.r.critic is None or k >= self.cfg.trainer.critic_warmup
        jobs = [self.r.actor.train(mbs, actor.ppo_micro_batch_size_per_gpu, self.r.temperature)
                if train_actor else asyncio.sleep(0, [])]
        if self.r.critic is not None:  # on its own group, it trains while the actor does
            jobs.append(self._train_critic(k, b))
            self.metrics.update(k, {"critic/warmup": float(not train_actor)})
        stats = (await asyncio.gather(*jobs))[0]
        dt = time.perf_counter() - t0
        for s in stats:
            for name, v in s.items():
                self.metrics.add(k, name if "/" in name else f"actor/{name}", v)
        tokens = int(b["attention_mask"].sum())
        self.metrics.update(k, throughput(tokens, dt))
        # per response token: a sync may land mid-request, so tokens of one sample differ
        versions = b["token_versions"][b["response_mask"] > 0].tolist()
        self.metrics.update(k, staleness_metrics(k, versions))
        self._record_prompts(k)

    def _record_prompts(self, k: int) -> None:
        """Append which prompts step k trained on (an audit trail that resume tests read)."""
        uids = sorted({s.uid for s in self.steps[k].samples})
        rec = {"step": k, "uids": uids}
        if self.steps[k].dropped:
            rec["dropped"] = sorted(self.steps[k].dropped)  # over max_staleness
        self.r.ckpt_root.mkdir(parents=True, exist_ok=True)
        with open(self.r.ckpt_root / "trained_prompts.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    async def sync(self, k: int) -> None:
        stats = await self.r.actor.sync_weights(k + 1)
        self.metrics.update(k, {f"weight_sync/{n}": v for n, v in stats.items()})

    # ---------------------------------------------------------------- validation
    async def val_generate(self, version: int) -> None:
        r = self.r
        await self._engines_at(version)
        sp = sampling_params(self.cfg.actor_rollout_ref.rollout, r.eos_ids,
                             self.cfg.trainer.seed, validation=True,
                             max_new_tokens=r.max_new_tokens)
        out = await self.runner.prompts(list(r.val_dataset), sp, f"v{version}")
        self.val[version] = {"samples": out.samples, "scores": out.scores}

    async def val_score(self, version: int) -> None:
        d = self.val.pop(version)
        rewards = await asyncio.gather(*d["scores"])
        n = max(1, len(rewards))
        m = {"val/reward_mean": sum(rewards) / n,
             "val/exact_frac": sum(x >= 1.0 for x in rewards) / n,
             # ended by a stop token (EOS) rather than cut at the length cap
             "val/eos_frac": sum(s.finish == "stop" for s in d["samples"]) / n,
             "val/response_length_mean": sum(len(s.response_ids) for s in d["samples"]) / n}
        self.val_results.append({"version": version, **m})
        logger.info("validation of weights v%d: %s", version,
                    " ".join(f"{k}={v:.4f}" for k, v in m.items()))
        self.r.loggers.log(version, m)

    # ---------------------------------------------------------------- end of a step
    async def finish_step(self, k: int) -> None:
        self.metrics.update(k, pipeline_step_metrics(self.p, k))
        self.metrics.update(k, self.scorer.pop_stats())  # reward calls since the last step
        metrics = self.metrics.pop(k)
        self.r.loggers.log(k + 1, metrics)
        self.steps.pop(k, None)
        t = self.cfg.trainer
        last = k + 1 == self.p.total_steps
        if t.timeline_freq > 0 and (k + 1) % t.timeline_freq == 0 and not last:
            self.write_timeline(k, t.timeline_freq)  # the last: when the run is over
        if self.p.checkpoint_due(k):
            # What a resume needs, as it stands when SYNC(k) has finished: CHECKPOINT(k) runs
            # later, beside GENERATE(k+2) and REF_LOGP(k+1), which move the loader and the KL
            # coefficient on.
            self.owed_saves[k] = self._resume_state(k)

    def write_timeline(self, k: int, last_steps: int) -> None:
        """`timeline.json` (the whole run so far) and `timeline.png` (steps k-last_steps+1..k,
        with the validations among them), the picture also to TensorBoard at step k+1."""
        tl = self.p.timeline
        devices = {g.name: g.num_devices for g in plan_task_groups(self.cfg)}
        trace = write_chrome_trace(tl, self.r.ckpt_root / "timeline.json", devices)
        first = k - last_steps + 1
        # From the first interval of step `first` on, everything each group did (the end of
        # step first-1's work, step k+1's generation), so a busy group is not drawn waiting.
        lo = min((iv.start for iv in tl if iv.step >= first), default=0.0)
        recent = [dataclasses.replace(iv, start=max(iv.start, lo)) for iv in tl if iv.end > lo]
        groups = sorted({g for t, g in self.p.groups.items() if not t.startswith("val-")})
        png = render_png(recent, self.r.ckpt_root / "timeline.png", groups=groups,
                         title=f"steps {max(first, 0) + 1}-{k + 1} (seconds since the first "
                               "bar; grey: the group waits)")
        self.r.loggers.log_image(k + 1, "timeline", png)
        logger.debug("timeline written: %s, %s", trace, png)

    def _model_inputs(self, b: dict) -> dict:
        return {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}

    def _resume_state(self, k: int) -> dict:
        """The driver's part of checkpoint k: the trainer holds version k+1; the next step's
        prompts have not been trained on, so the loader is saved at the position before them."""
        nxt = self.steps.get(k + 1)  # GENERATE(k+1) has started (one step off or more)
        owed = nxt.resume_before if nxt is not None else {
            "loader": self.r.loader.state_dict(), "partial": self.rollout.state_dict()}
        return {"step": k, "weight_version": k + 1, "loader": owed["loader"],
                "partial": owed["partial"], "kl_coef": self.kl_coef, "rng": ckpt.rng_state()}

    async def checkpoint(self, k: int) -> None:
        """CHECKPOINT(k), on the trainer's group: the weights SYNC(k) published (TRAIN(k+1)
        waits for this), with the resume state taken when SYNC(k) finished."""
        root, t0 = self.r.ckpt_root, time.perf_counter()
        tmp = ckpt.begin(root, k)
        await self.r.actor.save(str(tmp / "actor"), step=k)
        if self.r.critic is not None:
            await self.r.critic.save(str(tmp / "critic"), step=k)
        # every rank's files are complete (the save returned on all of them); checksumming a
        # large checkpoint takes a while, so it runs off the event loop
        await asyncio.to_thread(ckpt.commit, root, k, self.owed_saves.pop(k),
                                keep=self.cfg.trainer.max_actor_ckpt_to_keep)
        self.r.loggers.log(k + 1, {"timing/checkpoint": time.perf_counter() - t0})



def run(cfg, val_only: bool = False) -> dict:
    """Entry point of `megarl train` / `megarl validate`; returns a small summary."""
    return asyncio.run(_run(cfg, val_only or cfg.trainer.val_only))


async def _run(cfg, val_only: bool) -> dict:
    if not val_only and cfg.trainer.save_freq == -1:
        logger.warning("trainer.save_freq=-1: this run saves no checkpoint; its weights are "
                       "lost when it ends (set trainer.save_freq to keep them)")
    r = await setup_run(cfg, val_only)
    d = Driver(r)
    failed = True
    try:
        pipeline = Pipeline(r.ahead, r.total_steps, cfg.trainer.test_freq,
                            cfg.trainer.val_before_train, groups=r.groups,
                            val_only=val_only, start_step=r.start_step,
                            critic=r.critic is not None, save_freq=cfg.trainer.save_freq,
                            sync_between_generations=cfg.trainer.sync_between_generations)
        t0 = time.perf_counter()
        await d.main(pipeline)
        await r.actor_wait()
        if cfg.trainer.timeline_freq > 0 and not val_only and r.total_steps > r.start_step:
            # the whole run: the last step's save and validation come after its SYNC
            d.write_timeline(r.total_steps - 1, cfg.trainer.timeline_freq)
        summary = {"steps": r.total_steps, "start_step": r.start_step,
                   "seconds": time.perf_counter() - t0, "validation": d.val_results,
                   "incidents": len(pipeline.incidents)}
        logger.info("run finished: %s", {k: v for k, v in summary.items() if k != "validation"})
        if len(d.val_results) > 1:
            logger.info("first vs last validation:\n%s", first_last_table(d.val_results))
        failed = False
        return summary
    finally:
        await r.close(failed=failed)
