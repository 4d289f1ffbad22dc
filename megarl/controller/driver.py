"""The asyncio driver: starts what the Pipeline says is ready and calls each state's work.

`run(cfg)` is the whole job: set up data, reward, worker groups, engines and weight sync, then
loop — start every action the Pipeline says is ready, await whichever finishes first, tell the
Pipeline — until the planned steps (or, with `val_only`, the one validation) are done. The
Pipeline (machine.py) owns which step is in which state and each step's record; the work of
each state is a plain function in steps.py; this module adds the end of a step (its metrics,
the resume state a checkpoint will write) and the timeline.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time

from megarl.config import plan_task_groups
from megarl.utils.errors import lost_too_often
from megarl.observability.metrics import pipeline_step_metrics
from megarl.observability.timeline import render_png, write_chrome_trace

from . import deadlines
from .batch import StepRecord
from .machine import Pipeline
from .setup import Run, setup_run
from .steps import STEP_WORK, VALIDATION_WORK, RunState, resume_state
from .validation import first_last_table

logger = logging.getLogger(__name__)


def describe(err: BaseException) -> str:
    """`Type: message` of a failed state's error; for an error a Ray worker raised, of the
    worker's own exception (Ray's wrapper adds a banner and the remote traceback)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and type(err).__name__.startswith("RayTaskError"):
        err = cause
    return f"{type(err).__name__}: {err}"


class Driver:
    def __init__(self, run: Run, pipeline: Pipeline, keep_timeline: bool = False):
        """`keep_timeline`: the run restarts or resumes; its timeline goes on from the one
        in the run directory."""
        self.r, self.p, self.cfg = run, pipeline, run.cfg
        self.st = RunState.start(run, pipeline)
        self.step_tokens = deadlines.step_tokens(self.cfg)
        # the wall-clock time of the pipeline's start: where this timeline joins the earlier
        self.started_unix = time.time() - (pipeline.clock() - pipeline.t0)
        self.earlier_timeline = _read_trace(run.plan.ckpt_root / "timeline.json") \
            if keep_timeline else None
        self.devices = {g.name: g.num_devices for g in plan_task_groups(self.cfg)}

    # ---------------------------------------------------------------- the loop
    async def main(self) -> None:
        pipeline, running = self.p, {}
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
                                 describe(lost.exception()))
                    raise RuntimeError(f"{lost.exception()}; in flight: {doing}")
                for t in finished:
                    action = running.pop(t)
                    err = None if t.cancelled() else t.exception()
                    if err is not None:  # a failed state fails the run
                        logger.error("%s failed: %s", action, describe(err))
                    t.result()  # ... with its own traceback
                    pipeline.finish(action)
                    self.after(action)
        finally:
            for t in running:
                t.cancel()
            if lost is not None and not lost.done():
                lost.cancel()

    async def execute(self, a) -> None:
        t0 = time.perf_counter()
        if a.task == "checkpoint" and self.cfg.trainer.timeline_freq > 0:
            # before the checkpoint can be found: a restart from it finds this run's work
            self.write_trace()
        if a.task in VALIDATION_WORK:
            work = VALIDATION_WORK[a.task](self.st, a.version)
            tokens = deadlines.validation_tokens(self.cfg, len(self.r.val_dataset or ()))
        else:
            work = STEP_WORK[a.task](self.st, self._record(a))
            tokens = self.step_tokens
        limit = deadlines.deadline_s(self.cfg, tokens)
        try:
            await asyncio.wait_for(work, limit)
        except asyncio.TimeoutError:
            raise deadlines.StateTimeout(deadlines.explain(self.cfg, a, limit, tokens)) from None
        logger.debug("%s took %.3f s", a, time.perf_counter() - t0)

    def _record(self, a) -> StepRecord:
        records = self.p.records
        if a.task == "generate":
            # What is owed training before this step's prompts: where the checkpoint after
            # step k-1 (global_step_<k>, k steps done) resumes (the loader position, and the
            # partial-rollout cache as it is now).
            records[a.step] = StepRecord(a.step, {"loader": self.r.loader.state_dict(),
                                                  "partial": self.st.rollout.state_dict()})
        return records[a.step]

    # ---------------------------------------------------------------- end of a step
    def after(self, a) -> None:
        if a.task == "sync":
            self.finish_step(a.step)
        elif a.task == "checkpoint":
            del self.p.records[a.step]

    def finish_step(self, k: int) -> None:
        """SYNC(k) has finished: log the step's metrics and release its data; a checkpoint
        due at k keeps the record until CHECKPOINT(k) has written it."""
        m = self.st.metrics
        m.update(k, pipeline_step_metrics(self.p, k))
        m.update(k, self.r.reward_pool.pop_stats())  # reward calls since the last step
        self.r.loggers.log(k + 1, m.pop(k))
        t = self.cfg.trainer
        if t.timeline_freq > 0 and (k + 1) % t.timeline_freq == 0 and k + 1 < self.p.total_steps:
            self.write_timeline(k, t.timeline_freq)  # the last: when the run is over
        rec = self.p.records[k]
        rec.release()
        if self.p.checkpoint_due(k):
            # What a resume needs, as it stands now: CHECKPOINT(k) runs later, beside
            # GENERATE(k+2) and REF_LOGP(k+1), which move the loader and the KL coefficient on.
            rec.resume_after = resume_state(self.st, k)
        else:
            del self.p.records[k]

    def write_timeline(self, k: int, last_steps: int) -> None:
        """`timeline.json` (the whole run so far) and `timeline.png` (steps k-last_steps+1..k,
        with the validations among them), the picture also to TensorBoard at step k+1."""
        tl = self.p.timeline
        trace = self.write_trace()
        first = k - last_steps + 1
        # From the first interval of step `first` on, everything each group did (the end of
        # step first-1's work, step k+1's generation), so a busy group is not drawn waiting.
        lo = min((iv.start for iv in tl if iv.step >= first), default=0.0)
        recent = [dataclasses.replace(iv, start=max(iv.start, lo)) for iv in tl if iv.end > lo]
        groups = sorted({g for t, g in self.p.groups.items() if not t.startswith("val-")})
        png = render_png(recent, self.r.plan.ckpt_root / "timeline.png", groups=groups,
                         title=f"steps {max(first, 0) + 1}-{k + 1} (seconds since the first "
                               "bar; grey: the group waits)")
        self.r.loggers.log_image(k + 1, "timeline", png)
        logger.debug("timeline written: %s, %s", trace, png)

    def write_trace(self):
        """`timeline.json` alone: the whole run so far, after what the runs before a restart
        or resume did. Also written as each checkpoint begins and when the run fails, so a
        restart finds the work up to its checkpoint."""
        return write_chrome_trace(self.p.timeline, self.r.plan.ckpt_root / "timeline.json",
                                  self.devices, incidents=self.p.incidents, t0=self.p.t0,
                                  started_unix=self.started_unix,
                                  earlier=self.earlier_timeline,
                                  first_step=self.r.plan.start_step)


def _read_trace(path) -> dict | None:
    """The timeline a run before this one wrote, if it is one (else it is started anew)."""
    try:
        trace = json.loads(path.read_text())
        return trace if isinstance(trace.get("traceEvents"), list) else None
    except (OSError, ValueError, AttributeError):
        return None


def run(cfg, val_only: bool = False, life=None) -> dict:
    """Entry point of `megarl train` / `megarl validate`; returns a small summary.

    `life`: under torchrun, this life of the launch (`cluster/torchrun.py`: `.losses`, what
    ended each earlier one, and `.started()`): torchrun's agent restarts the processes. None
    where megarl restarts the run itself, in this process (Ray)."""
    val_only = val_only or cfg.trainer.val_only
    if life is None:
        return asyncio.run(_run_restarting(cfg, val_only))
    return asyncio.run(_run_restarted(cfg, val_only, life))


def restart_wait_s(cfg, n: int) -> float:
    """The wait before restart n (1-based): `restart_backoff_s` doubling, at most 300 s."""
    return min(float(cfg.trainer.restart_backoff_s) * 2 ** (n - 1), 300.0)


async def _run_restarting(cfg, val_only: bool) -> dict:
    """The run, restarted from its newest checkpoint after each loss, up to
    `trainer.max_restarts` times. A restart is a new set-up (workers, engines, weight sync)
    resuming as `resume_mode=auto` does, into the same run directory and TensorBoard
    history; an error of the first set-up (a config, a path) is never retried."""
    limit = 0 if val_only else int(cfg.trainer.max_restarts)
    losses = [] if val_only else _requeues()
    while True:
        started = []  # set once the first set-up is done: later errors are losses
        try:
            return await _run(cfg if not losses else _resuming(cfg), val_only, losses,
                              lambda: started.append(True), keep_transport=len(losses) < limit)
        except Exception as err:
            if not limit or not (started or losses):
                raise
            losses.append(describe(err))
            if len(losses) > limit:
                raise RuntimeError(lost_too_often(losses, limit)) from err
            wait = restart_wait_s(cfg, len(losses))
            logger.error("run lost (%s); restart %d/%d from the newest checkpoint in %.0f s",
                         losses[-1], len(losses), limit, wait)
        await asyncio.sleep(wait)


async def _run_restarted(cfg, val_only: bool, life) -> dict:
    """One life of a run whose processes torchrun's agent restarts (`--max-restarts`, set
    from `trainer.max_restarts`): after `losses`, it waits as a restart in this process
    would, then resumes from the newest checkpoint. The life after the last allowed one is
    never started by the agent, so the last life names every loss when it fails."""
    limit, losses = (0 if val_only else int(cfg.trainer.max_restarts)), list(life.losses)
    if losses:
        wait = restart_wait_s(cfg, len(losses))
        logger.error("run lost (%s); restart %d/%d from the newest checkpoint in %.0f s",
                     losses[-1], len(losses), limit, wait)
        await asyncio.sleep(wait)
    try:
        return await _run(cfg if not losses else _resuming(cfg), val_only, losses, life.started)
    except Exception as err:
        if limit and len(losses) >= limit:
            raise RuntimeError(lost_too_often([*losses, describe(err)], limit)) from err
        raise


def _requeues() -> list[str]:
    """Restarts a batch system made before this process began (launch/slurm_ray.sh: a job
    Slurm requeued sets MEGARL_RESTARTS_BEFORE and MEGARL_RESTART_REASON): the run resumes
    as a restart, and they count against `trainer.max_restarts`."""
    n = int(os.environ.get("MEGARL_RESTARTS_BEFORE", "0") or 0)
    return [os.environ.get("MEGARL_RESTART_REASON", "the job was restarted")] * n


def _resuming(cfg):
    """The config of a restart: the same, resuming from the run's newest checkpoint."""
    import copy

    from omegaconf import OmegaConf, open_dict

    again = copy.deepcopy(cfg)
    OmegaConf.set_readonly(again, False)
    with open_dict(again):
        again.trainer.resume_mode = "auto"
    return again


async def _run(cfg, val_only: bool, losses: list[str] = (), on_started=None,
               keep_transport: bool = False) -> dict:
    """One run; `on_started()` once its set-up is done. `keep_transport`: a failure is
    followed by a restart, which sets up again over the same transport (under Ray, the same
    cluster connection: no second start-up)."""
    if not val_only and cfg.trainer.save_freq == -1 and not losses:
        logger.warning("trainer.save_freq=-1: this run saves no checkpoint; its weights are "
                       "lost when it ends (set trainer.save_freq to keep them)")
    r = await setup_run(cfg, val_only)
    if on_started is not None:
        on_started()
    failed, d = True, None
    try:
        pipeline = Pipeline(r.plan.ahead, r.plan.total_steps, cfg.trainer.test_freq,
                            cfg.trainer.val_before_train, groups=r.plan.groups,
                            val_only=val_only, start_step=r.plan.start_step,
                            critic=r.critic is not None, save_freq=cfg.trainer.save_freq,
                            sync_between_generations=cfg.trainer.sync_between_generations)
        d = Driver(r, pipeline, keep_timeline=bool(losses) or r.plan.start_step > 0)
        if losses:
            start = r.plan.start_step
            pipeline.incident(start, "restart", f"restart {len(losses)} after: {losses[-1]}")
            d.st.metrics.update(start, {"trainer/restarts": float(len(losses))})
        t0 = time.perf_counter()
        await d.main()
        await r.actor_wait()
        if cfg.trainer.timeline_freq > 0 and not val_only and r.plan.total_steps > r.plan.start_step:
            # the whole run: the last step's save and validation come after its SYNC
            d.write_timeline(r.plan.total_steps - 1, cfg.trainer.timeline_freq)
        summary = {"steps": r.plan.total_steps, "start_step": r.plan.start_step,
                   "seconds": time.perf_counter() - t0, "validation": d.st.val_results,
                   "incidents": len(pipeline.incidents), "restarts": len(losses)}
        logger.info("run finished: %s", {k: v for k, v in summary.items() if k != "validation"})
        if len(d.st.val_results) > 1:
            logger.info("first vs last validation:\n%s", first_last_table(d.st.val_results))
        failed = False
        return summary
    finally:
        if failed and d is not None and cfg.trainer.timeline_freq > 0 and not val_only:
            try:  # what this run did, for the restart's timeline (best effort)
                d.write_trace()
            except Exception as err:  # noqa: BLE001 - the failure is what gets reported
                logger.debug("timeline not written: %s", err)
        await r.close(failed=failed, keep_transport=failed and keep_transport)
