"""The asyncio driver: turns the Pipeline's actions into coarse calls on group handles.

`run(cfg)` is the whole job: set up data, reward, Ray groups, engines and weight sync, then
loop — start every action the Pipeline says is ready, await whichever finishes first, tell the
Pipeline — until the planned steps (or, with `val_only`, the one validation) are done. The
Pipeline (machine.py) owns which step is in which state; this module owns the step data (the
samples and tensors each state produces) and the side effects (metrics, checkpoints).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time


from megarl.algo.advantages import compute_advantages
from megarl.observability.metrics import (MetricsTracker, pipeline_step_metrics,
                                          staleness_metrics, throughput)

from . import checkpoint as ckpt
from .batch import build_batch, mini_batches
from .generation import Scorer, rollout, sampling_params
from .machine import Pipeline
from .setup import Run, setup_run

logger = logging.getLogger(__name__)


class Driver:
    def __init__(self, run: Run):
        self.r = run
        self.cfg = run.cfg
        self.steps: dict[int, dict] = {}         # step -> what its states produced
        self.loader_states: dict[int, dict] = {}  # step -> loader position before its prompts
        self.metrics = MetricsTracker()
        self.val: dict[int, dict] = {}
        self.scorer = Scorer(run.reward_fn, self.cfg.reward.num_workers)
        self.val_results: list[dict] = []

    # ---------------------------------------------------------------- the loop
    async def main(self, pipeline: Pipeline) -> None:
        self.p = pipeline
        running: dict[asyncio.Task, object] = {}
        try:
            while not pipeline.done:
                for action in pipeline.ready():
                    pipeline.start(action)
                    running[asyncio.create_task(self.execute(action))] = action
                if not running:
                    raise RuntimeError("pipeline stalled: nothing ready and nothing running")
                finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for t in finished:
                    action = running.pop(t)
                    t.result()  # a failed state fails the run, with its own traceback
                    pipeline.finish(action)
                    await self.after(action)
        finally:
            for t in running:
                t.cancel()
            self.scorer.close()

    async def execute(self, a) -> None:
        k = a.step
        fn = {"generate": self.generate, "reward": self.reward, "ref_logp": self.ref_logp,
              "logp": self.logp, "actor-train": self.train, "sync": self.sync,
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
        self.loader_states[k] = r.loader.state_dict()
        prompts = r.loader.next_batch()
        sp = sampling_params(self.cfg.actor_rollout_ref.rollout, r.eos_ids,
                             self.cfg.trainer.seed * 1_000_003 + k,
                             max_new_tokens=r.max_new_tokens)
        t0 = time.perf_counter()
        samples, scores = await rollout(r.manager, prompts, sp, r.tokenizer, self.scorer,
                                        f"s{k}")
        dt = time.perf_counter() - t0
        tokens = sum(len(s.response_ids) for s in samples)
        self.steps[k] = {"samples": samples, "scores": scores}
        self.metrics.update(k, {"rollout/gen_tokens_per_s": tokens / dt if dt else 0.0,
                                "response/length_mean": tokens / max(1, len(samples)),
                                "response/length_max": max(len(s.response_ids)
                                                           for s in samples),
                                "response/aborted_resumed_frac": sum(
                                    len(set(s.token_versions)) > 1 for s in samples) /
                                len(samples)})

    async def reward(self, k: int) -> None:
        d = self.steps[k]
        await asyncio.gather(*d["scores"])  # scoring started as each response finished
        samples = d["samples"]
        batch = build_batch(samples, self.r.pad_id)
        alg = self.cfg.algorithm
        batch["advantages"] = compute_advantages(
            alg.adv_estimator, batch["rewards"], [s.uid for s in samples],
            batch["response_mask"], norm_by_std=alg.norm_adv_by_std_in_grpo, gamma=alg.gamma)
        d["batch"] = batch
        rw = batch["rewards"]
        self.metrics.update(k, {"reward/mean": rw.mean().item(), "reward/max": rw.max().item(),
                                "reward/min": rw.min().item(),
                                "reward/exact_frac": (rw >= 1.0).float().mean().item()})

    async def ref_logp(self, k: int) -> None:
        if self.r.ref is None:  # no KL anywhere: nothing consumes reference log-probs
            return
        b = self.steps[k]["batch"]
        out = await self.r.ref.compute_logp(self._model_inputs(b), self.r.temperature,
                                            self.cfg.actor_rollout_ref.ref
                                            .log_prob_micro_batch_size_per_gpu)
        b["ref_logprobs"] = out["logprobs"]

    async def logp(self, k: int) -> None:
        b = self.steps[k]["batch"]
        out = await self.r.actor.compute_logp(
            self._model_inputs(b), self.r.temperature,
            self.cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu)
        b["old_logprobs"] = out["logprobs"]
        mask = b["response_mask"] > 0
        diff = (b["old_logprobs"] - b["rollout_logprobs"])[mask].abs()
        self.metrics.update(k, {"rollout/logp_mismatch_mean": diff.mean().item(),
                                "rollout/logp_mismatch_max": diff.max().item()})

    async def train(self, k: int) -> None:
        b = self.steps[k]["batch"]
        actor = self.cfg.actor_rollout_ref.actor
        mbs = mini_batches(b, self.cfg.actor_rollout_ref.rollout.n, actor.ppo_mini_batch_size,
                           actor.ppo_epochs)
        t0 = time.perf_counter()
        stats = await self.r.actor.train(mbs, actor.ppo_micro_batch_size_per_gpu,
                                         self.r.temperature)
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
        uids = sorted({s.uid for s in self.steps[k]["samples"]})
        self.r.ckpt_root.mkdir(parents=True, exist_ok=True)
        with open(self.r.ckpt_root / "trained_prompts.jsonl", "a") as f:
            f.write(json.dumps({"step": k, "uids": uids}) + "\n")

    async def sync(self, k: int) -> None:
        stats = await self.r.actor.sync_weights(k + 1)
        self.metrics.update(k, {f"weight_sync/{n}": v for n, v in stats.items()})

    # ---------------------------------------------------------------- validation
    async def val_generate(self, version: int) -> None:
        r = self.r
        sp = sampling_params(self.cfg.actor_rollout_ref.rollout, r.eos_ids,
                             self.cfg.trainer.seed, validation=True,
                             max_new_tokens=r.max_new_tokens)
        samples, scores = await rollout(r.manager, list(r.val_dataset), sp, r.tokenizer,
                                        self.scorer, f"v{version}")
        self.val[version] = {"samples": samples, "scores": scores}

    async def val_score(self, version: int) -> None:
        d = self.val.pop(version)
        rewards = await asyncio.gather(*d["scores"])
        n = max(1, len(rewards))
        m = {"val/reward_mean": sum(rewards) / n,
             "val/exact_frac": sum(x >= 1.0 for x in rewards) / n,
             "val/response_length_mean": sum(len(s.response_ids) for s in d["samples"]) / n}
        self.val_results.append({"version": version, **m})
        logger.info("validation of weights v%d: %s", version,
                    " ".join(f"{k}={v:.4f}" for k, v in m.items()))
        self.r.loggers.log(version, m)

    # ---------------------------------------------------------------- end of a step
    async def finish_step(self, k: int) -> None:
        self.metrics.update(k, pipeline_step_metrics(self.p, k))
        metrics = self.metrics.pop(k)
        self.r.loggers.log(k + 1, metrics)
        self.steps.pop(k, None)
        t = self.cfg.trainer
        last = k + 1 == self.p.total_steps
        if t.save_freq > 0 and ((k + 1) % t.save_freq == 0 or last):
            await self.save(k)

    def _model_inputs(self, b: dict) -> dict:
        return {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}

    async def save(self, k: int) -> None:
        """Checkpoint after SYNC(k): the trainer holds version k+1; the next step's prompts
        have not been trained on, so the loader is saved at the position before them."""
        root = self.r.ckpt_root
        tmp = ckpt.begin(root, k)
        await self.r.actor.save(str(tmp / "actor"), step=k)
        position = self.loader_states.get(k + 1, self.r.loader.state_dict())
        ckpt.commit(root, k, {"step": k, "weight_version": k + 1, "loader": position,
                              "rng": ckpt.rng_state()})
        for old in [s for s in self.loader_states if s <= k]:
            self.loader_states.pop(old)


def run(cfg, val_only: bool = False) -> dict:
    """Entry point of `megarl train` / `megarl validate`; returns a small summary."""
    return asyncio.run(_run(cfg, val_only or cfg.trainer.val_only))


async def _run(cfg, val_only: bool) -> dict:
    r = await setup_run(cfg, val_only)
    d = Driver(r)
    try:
        pipeline = Pipeline(r.ahead, r.total_steps, cfg.trainer.test_freq,
                            cfg.trainer.val_before_train, groups=r.groups,
                            val_only=val_only, start_step=r.start_step)
        t0 = time.perf_counter()
        await d.main(pipeline)
        await r.actor_wait()
        summary = {"steps": r.total_steps, "start_step": r.start_step,
                   "seconds": time.perf_counter() - t0, "validation": d.val_results}
        logger.info("run finished: %s", {k: v for k, v in summary.items() if k != "validation"})
        return summary
    finally:
        await r.close()
