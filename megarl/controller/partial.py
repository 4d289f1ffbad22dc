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

    @classmethod
    def fresh(cls, prompt, n: int, step: int, serial: int = 0) -> "PromptGroup":
        return cls(prompt, [Trajectory() for _ in range(n)], step, serial)

    @property
    def complete(self) -> bool:
        return all(t.finish is not None for t in self.samples)

    @property
    def started(self) -> bool:
        return any(t.ids or t.finish for t in self.samples)

    def oldest_version(self) -> int | None:
        vs = [min(t.versions) for t in self.samples if t.versions]
        return min(vs) if vs else None

    def restart(self) -> None:
        """Throw away every token (regenerate from the prompt under current weights)."""
        self.samples = [Trajectory() for _ in self.samples]

    def to_dict(self) -> dict:
        # The prompt is stored by dataset index + uid, checked on load: the data itself is
        # the dataset's, so a checkpoint cannot resume on a changed data set unnoticed.
        return {"index": self.prompt.index, "uid": self.prompt.uid,
                "first_step": self.first_step, "serial": self.serial,
                "samples": [t.to_dict() for t in self.samples]}

    @classmethod
    def from_dict(cls, d: dict, dataset) -> "PromptGroup":
        idx = int(d["index"])
        if not 0 <= idx < len(dataset) or dataset[idx].uid != d["uid"]:
            raise ValueError(f"partial rollout cache: prompt {d['uid']!r} (row {idx}) is not "
                             "in this run's data set at that row; the data changed since the "
                             "checkpoint")
        return cls(dataset[idx], [Trajectory.from_dict(t) for t in d["samples"]],
                   int(d["first_step"]), int(d.get("serial", 0)))


class PartialRollout:
    """The GENERATE state's work with partial rollout, and its cache (see the module doc);
    each sample runs on the `TrajectoryRunner`, which scores it when it finishes."""

    def __init__(self, runner: TrajectoryRunner, loader, *, n: int, need: int, over: int,
                 max_staleness: int | None = None, stale_policy: str = "drop",
                 sampling_for: Callable | None = None,
                 filter_max_gen_batches: int | None = None, filter_metric: str = "reward"):
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
                    queue.append(PromptGroup.fresh(p, self.n, step, self.drawn))
                    self.drawn += 1
            return queue.popleft()

        self._stopping = False
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
        if self.filter_max is not None:
            out.update(filter_metrics(len(complete), len(filtered), draws,
                                      int(metrics["rollout/prompts_drawn"])))
        return StepRollout(samples, futures, out, dropped, filtered=filtered)

    async def _run_group(self, g: PromptGroup, step: int, sp: SamplingParams) -> bool:
        """Run the group's samples; False when dynamic sampling drops it (complete, and
        every reward the same)."""
        await asyncio.gather(*[self._run_sample(g, i, step, sp)
                               for i in range(len(g.samples))])
        if self.filter_max is None or not g.complete:
            return True
        return await has_spread([t.future for t in g.samples], [t.sample for t in g.samples],
                                self.filter_metric)

    async def _run_sample(self, g: PromptGroup, i: int, step: int, sp: SamplingParams) -> None:
        t = g.samples[i]
        if self.sampling_for is not None:
            sp = self.sampling_for(g.prompt, i, sp)

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
                True, f"s{step}-{g.prompt.uid}-{i}+{len(t.ids)}.{attempt}.g{g.serial}")

        if await self.runner.extend(t, sp.max_new_tokens, request_for,
                                    lambda: self._stopping, prompt=g.prompt):
            self.runner.finish(g.prompt, t)


