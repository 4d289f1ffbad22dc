"""Partial rollout: interrupt the long tail, cache unfinished trajectories, resume them later.

A step needs ``need`` complete prompt groups (``data.train_batch_size``, n samples each). With
partial rollout the GENERATE state keeps ``need + over`` groups in flight — the groups cached
by earlier steps first, then new prompts, one new group started for every group that
completes — and once ``need`` groups are complete it aborts every request still running. Each
unfinished trajectory keeps its tokens, per-token behaviour log-probs and per-token weight
versions and is resumed, under whatever weights the engines then hold, by a later step; a
sample that finished inside an unfinished group keeps its tokens and its reward. So a long
response costs the step that starts it no more than the steps' common length, and the engines
never idle on a tail of a few stragglers.

Exactly-once. Prompts are drawn from the loader a batch at a time; drawn prompts that have not
been started yet are cached too. The cache plus the loader position is the whole state of
"which prompts are owed training", and the driver checkpoints both as they were at the start
of the next step's GENERATE, so after a resume no prompt is lost or trained twice.

Staleness. A group's staleness when it is trained at step k is k minus the oldest version of
any of its tokens (TRAIN(k) starts from version k). Before a cached group is resumed it is
checked against `algorithm.max_staleness`; an over-limit group is dropped (counted, its prompt
recorded as dropped) or regenerated from its prompt (``stale_policy``). A group completed in
this step is never over the limit: the config check keeps the limit >= generate_ahead - 1.

Dynamic sampling (``algorithm.filter_groups``, `megarl.controller.filter_groups`). A group
whose samples all got the same reward is dropped when its last sample is scored; its slot
goes to a new group, as a completed group's does. Only complete groups are judged, so a group
cut off by the step's end is judged by the step that completes it.

ReMax (``algorithm.adv_estimator=remax``). Each group also holds its prompt's greedy response
(`PromptGroup.baseline`), run, aborted, resumed, cached and checkpointed as the group's samples
are, its tokens' weight versions kept. A group is complete only when its baseline is finished
and scored; its reward is then every sample's `Sample.baseline`. The baseline's versions do not
count toward the group's staleness: staleness bounds the off-policy gap of the tokens that are
trained, and the baseline is not trained; a baseline from older weights does not depend on the
sampled responses, so the advantage stays an unbiased estimate (it only reduces less variance).
A stale group that is regenerated regenerates its baseline too; one that is dropped, or dropped
by dynamic sampling (judged by its samples' rewards, as without partial rollout), takes its
baseline with it.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import Any, Callable

import torch

from megarl.algo.staleness import staleness_mask
from megarl.rollout.protocol import GenerateRequest, SamplingParams

from .filter_groups import FilterGroupsExhausted, filter_metrics, has_spread
from .trajectory import StepRollout, Trajectory, TrajectoryRunner

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PromptGroup:
    """The n samples of one prompt."""
    prompt: Any                     # megarl.data.dataset.Prompt
    samples: list[Trajectory]
    first_step: int                 # the step that drew the prompt
    # the how-manyth group drawn in the run (checkpointed): the same prompt can be in flight
    # twice (a group cached near an epoch's end beside the next epoch's draw of it, or two
    # epochs in one step of a small data set), and its requests' ids and seeds must differ
    serial: int = 0
    baseline: Trajectory | None = None  # remax: the prompt's greedy response (not trained)

    @classmethod
    def fresh(cls, prompt, n: int, step: int, serial: int = 0,
              remax: bool = False) -> "PromptGroup":
        return cls(prompt, [Trajectory() for _ in range(n)], step, serial,
                   Trajectory() if remax else None)

    def _all(self) -> list[Trajectory]:
        return self.samples + ([self.baseline] if self.baseline is not None else [])

    @property
    def complete(self) -> bool:
        """Every sample finished, and the baseline too (it is scored before the group is
        handed on: `PartialRollout._run_group`)."""
        return all(t.finish is not None for t in self._all())

    @property
    def started(self) -> bool:
        return any(t.ids or t.finish for t in self._all())

    def oldest_version(self) -> int | None:
        """Of the trained tokens (the baseline's are not: see the module doc)."""
        vs = [min(t.versions) for t in self.samples if t.versions]
        return min(vs) if vs else None

    def restart(self) -> None:
        """Throw away every token (regenerate from the prompt under current weights)."""
        self.samples = [Trajectory() for _ in self.samples]
        if self.baseline is not None:
            self.baseline = Trajectory()

    def to_dict(self) -> dict:
        # The prompt is stored by dataset index + uid, checked on load: the data itself is
        # the dataset's, so a checkpoint cannot resume on a changed data set unnoticed.
        d = {"index": self.prompt.index, "uid": self.prompt.uid,
             "first_step": self.first_step, "serial": self.serial,
             "samples": [t.to_dict() for t in self.samples]}
        if self.baseline is not None:
            d["baseline"] = self.baseline.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict, dataset) -> "PromptGroup":
        idx = int(d["index"])
        if not 0 <= idx < len(dataset) or dataset[idx].uid != d["uid"]:
            raise ValueError(f"partial rollout cache: prompt {d['uid']!r} (row {idx}) is not "
                             "in this run's data set at that row; the data changed since the "
                             "checkpoint")
        base = d.get("baseline")
        return cls(dataset[idx], [Trajectory.from_dict(t) for t in d["samples"]],
                   int(d["first_step"]), int(d.get("serial", 0)),
                   Trajectory.from_dict(base) if base is not None else None)


class PartialRollout:
    """The GENERATE state's work with partial rollout, and its cache (see the module doc);
    each sample runs on the `TrajectoryRunner`, which scores it when it finishes."""

    def __init__(self, runner: TrajectoryRunner, loader, *, n: int, need: int, over: int,
                 max_staleness: int | None = None, stale_policy: str = "drop",
                 sampling_for: Callable | None = None,
                 filter_max_gen_batches: int | None = None, filter_metric: str = "reward",
                 remax: bool = False):
        if need <= 0 or n <= 0 or over < 0:
            raise ValueError(f"partial rollout: need={need}, n={n}, over={over}")
        self.runner, self.loader = runner, loader
        self.n, self.need, self.over = n, need, over
        self.max_staleness, self.stale_policy = max_staleness, stale_policy
        # optional (prompt, sample index, step params) -> params of that one sample, e.g. a
        # per-prompt length budget from the data
        self.sampling_for = sampling_for
        # dynamic sampling: None is off; else the most loader draws one step may make (<= 0:
        # no limit)
        self.filter_max, self.filter_metric = filter_max_gen_batches, filter_metric
        self.remax = remax  # each group also runs its prompt's greedy baseline response
        self._baselines_done = 0  # baselines finished in the current step (the metric)
        self.cache: list[PromptGroup] = []
        self._stopping = False
        self.drawn = 0  # groups drawn so far: the next one's serial

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        return {"version": 1, "n": self.n, "drawn": self.drawn,
                "groups": [g.to_dict() for g in self.cache]}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        if state.get("version") != 1:
            raise ValueError(f"partial rollout cache: unknown version {state.get('version')!r}")
        if state["n"] != self.n:
            raise ValueError(f"partial rollout cache: saved with rollout.n={state['n']}, this "
                             f"run has {self.n}")
        self.cache = [PromptGroup.from_dict(g, self.loader.dataset) for g in state["groups"]]
        for g in self.cache:
            # a cache saved with another estimator: a group gets (or loses) its baseline
            if self.remax and g.baseline is None:
                g.baseline = Trajectory()
            elif not self.remax:
                g.baseline = None
        if "drawn" in state:
            self.drawn = int(state["drawn"])
        else:  # a checkpoint from before groups had serials: number the restored ones
            for j, g in enumerate(self.cache):
                g.serial = j
            self.drawn = len(self.cache)
        logger.info("partial rollout: %d cached prompt group(s) restored", len(self.cache))

    # ------------------------------------------------------------------ one step
    def _over_limit(self, trainer_version: int) -> tuple[set[int], float]:
        """The cached groups (by id) over `max_staleness` at `trainer_version`, judged by
        `algo.staleness` (a group goes whole), and how many samples they hold."""
        started = [g for g in self.cache if g.started]
        rows = [t.versions for g in started for t in g.samples]
        if self.max_staleness is None or not any(rows):
            return set(), 0.0
        versions = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        mask = torch.zeros_like(versions)
        for i, r in enumerate(rows):
            versions[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, :len(r)] = 1
        groups = [j for j, g in enumerate(started) for _ in g.samples]
        keep, m = staleness_mask(versions, mask, trainer_version, self.max_staleness, groups)
        return {id(g) for j, g in enumerate(started) if not keep[groups.index(j)]}, \
            m["rollout/stale_dropped"]

    async def run_step(self, step: int, sp: SamplingParams, trainer_version: int
                       ) -> StepRollout:
        """Generate until `need` groups are complete: their samples in group order, their
        score futures, metrics, and the uids dropped as too stale."""
        metrics = collections.Counter()
        queue: collections.deque[PromptGroup] = collections.deque()
        dropped: list[str] = []
        filtered: list[str] = []
        draws = 0
        over, samples_over = self._over_limit(trainer_version)
        if over:  # in samples, as `staleness_mask` counts them
            metrics["rollout/stale_regenerated" if self.stale_policy == "regenerate"
                    else "rollout/stale_dropped"] += samples_over
        for g in self.cache:
            if id(g) in over:
                if self.stale_policy != "regenerate":
                    dropped.append(g.prompt.uid)
                    continue
                g.restart()
            queue.append(g)
        self.cache = []
        resumed = sum(g.started for g in queue)

        def next_group() -> PromptGroup:
            nonlocal draws
            if not queue:
                if self.filter_max is not None and 0 < self.filter_max <= draws:
                    raise FilterGroupsExhausted(step, draws, len(complete), self.need)
                draws += 1
                batch = self.loader.next_batch()
                metrics["rollout/prompts_drawn"] += len(batch)
                for p in batch:
                    queue.append(PromptGroup.fresh(p, self.n, step, self.drawn, self.remax))
                    self.drawn += 1
            return queue.popleft()

        self._stopping = False
        self._baselines_done = 0
        active: dict[asyncio.Task, PromptGroup] = {}
        complete: list[PromptGroup] = []

        def launch(g: PromptGroup) -> None:
            active[asyncio.ensure_future(self._run_group(g, step, sp))] = g

        target = self.need + self.over
        running = self.runner.running
        try:
            while len(active) < target:
                launch(next_group())
            while active and len(complete) < self.need:
                done, _ = await asyncio.wait(active, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    g = active.pop(t)
                    if t.result():
                        complete.append(g)
                    else:  # no spread: consumed, not trained; its slot goes to a new group
                        filtered.append(g.prompt.uid)
                # one new group for each that completed: the engines stay full
                while len(complete) < self.need and len(active) < target:
                    launch(next_group())
            # enough: cut the tail off; each aborted request returns its partial output
            self._stopping = True
            if running:
                metrics["rollout/partial/aborted_requests"] += len(running)
                await self.runner.manager.abort(list(running))
            await asyncio.gather(*active)  # each aborted sample has stored its partial output
        finally:
            self._stopping = False
            for t in active:
                t.cancel()
        leftovers = list(active.values())
        # Complete groups beyond the batch (several can finish in one wait) are trained next.
        extra, complete = complete[self.need:], complete[:self.need]
        self.cache = extra + leftovers + list(queue)
        samples = [t.sample for g in complete for t in g.samples]
        futures = [t.future for g in complete for t in g.samples]
        spans = [max(s.token_versions) - min(s.token_versions) + 1
                 for s in samples if s.token_versions]
        resumed_samples = sum(1 for g in complete for t in g.samples if t.interrupted)
        out = dict(metrics)
        out.update({
            "rollout/partial/resumed_groups": float(resumed),
            "rollout/partial/ratio": resumed_samples / max(1, len(samples)),
            "rollout/partial/versions_spanned_max": float(max(spans, default=0)),
            "rollout/partial/cached_groups": float(len(self.cache)),
            "rollout/partial/cached_started_groups": float(sum(g.started
                                                               for g in self.cache)),
        })
        if self.remax:
            # requests: the greedy responses finished in this step (those of groups cached
            # or dropped included); the mean: of the trained groups' baselines
            out["rollout/remax/baseline_requests"] = float(self._baselines_done)
            out["rollout/remax/baseline_reward_mean"] = (
                sum(g.samples[0].sample.baseline for g in complete) / max(1, len(complete)))
        if self.filter_max is not None:
            out.update(filter_metrics(len(complete), len(filtered), draws,
                                      int(metrics["rollout/prompts_drawn"])))
        return StepRollout(samples, futures, out, dropped, filtered=filtered)

    async def _run_group(self, g: PromptGroup, step: int, sp: SamplingParams) -> bool:
        """Run the group's samples (and remax's baseline); False when dynamic sampling drops
        it (complete, and every reward the same). A complete remax group returns once its
        baseline is scored, each sample's `baseline` set."""
        jobs = [self._run_sample(g, i, step, sp) for i in range(len(g.samples))]
        if g.baseline is not None:
            jobs.append(self._run_baseline(g, step, sp))
        await asyncio.gather(*jobs)
        if not g.complete:
            return True
        if g.baseline is not None:
            b = float(await g.baseline.future)
            for t in g.samples:
                t.sample.baseline = b
        if self.filter_max is None:
            return True
        return await has_spread([t.future for t in g.samples], [t.sample for t in g.samples],
                                self.filter_metric)

    async def _run_sample(self, g: PromptGroup, i: int, step: int, sp: SamplingParams) -> None:
        if self.sampling_for is not None:
            sp = self.sampling_for(g.prompt, i, sp)
        await self._run(g, g.samples[i], step, sp, str(i), i)

    async def _run_baseline(self, g: PromptGroup, step: int, sp: SamplingParams) -> None:
        """ReMax's greedy response (verl: do_sample=False beside the sampled ones), under the
        length budget of the group's first sample."""
        if self.sampling_for is not None:
            sp = self.sampling_for(g.prompt, 0, sp)
        was_done = g.baseline.finish is not None
        await self._run(g, g.baseline, step, dataclasses.replace(
            sp, temperature=0.0, sampling_seed=None), "greedy", 0)
        if g.baseline.finish is not None and not was_done:
            self._baselines_done += 1

    async def _run(self, g: PromptGroup, t: Trajectory, step: int, sp: SamplingParams,
                   tag: str, i: int) -> None:
        def request_for(t: Trajectory, attempt: int) -> GenerateRequest:
            seed = sp.sampling_seed
            if seed is not None:  # reproducible per (step seed, draw, sample, position): two
                # draws of one prompt in flight together would otherwise repeat each other
                seed = (seed * 1_000_003 + g.prompt.index * 4099 + g.serial * 65_537
                        + i * 131 + len(t.ids)) % (2**63)
            return GenerateRequest(
                list(g.prompt.prompt_ids) + t.ids,
                dataclasses.replace(sp, n=1, max_new_tokens=sp.max_new_tokens - len(t.ids),
                                    sampling_seed=seed,
                                    min_new_tokens=max(0, sp.min_new_tokens - len(t.ids)),
                                    stop_token_ids=list(sp.stop_token_ids)),
                True, f"s{step}-{g.prompt.uid}-{tag}+{len(t.ids)}.{attempt}.g{g.serial}")

        if await self.runner.extend(t, sp.max_new_tokens, request_for,
                                    lambda: self._stopping, prompt=g.prompt):
            self.runner.finish(g.prompt, t)
