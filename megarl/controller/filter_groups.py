"""Dynamic sampling (DAPO's ``algorithm.filter_groups``): train only on groups that differ.

A group whose samples all got the same reward has advantage 0 on every token under GRPO (and
under every group-relative estimator): it costs a training step's compute and moves nothing,
and a batch of them shrinks the step's effective batch. With ``filter_groups.enable`` such a
group is dropped as soon as its last sample is scored, and the GENERATE state draws more
prompts until ``data.train_batch_size`` groups with a spread are complete.

- Without partial rollout (`FilteredRollout`): a *generation batch* is one draw of
  ``data.train_batch_size`` prompts from the loader, every sample to its end; batches follow
  one another until enough groups are kept. Groups kept beyond the batch are not trained (as
  verl's DAPO trainer cuts its batch to size); their prompts are consumed and recorded.
- With partial rollout (`megarl.controller.partial.PartialRollout`): a dropped group frees its
  slot and a new group starts in it, like a group that completed; the loader draws count as
  the step's generation batches, the over-sampled ones included.

Exactly once. A dropped or surplus prompt is consumed: the loader has moved past it, the step's
line in ``trained_prompts.jsonl`` names it (``filtered``, ``surplus``), and the checkpoint's
loader position (and partial rollout cache) is taken after it, so a resumed run draws, drops
and trains what an uninterrupted run does.

`algorithm.filter_groups.max_num_gen_batches` > 0 bounds the generation batches of one step;
past it the step fails with `FilterGroupsExhausted` naming the key (verl's DAPO trainer raises
the same way; verl 0.9.1's V1 replay buffer ignores the key with a warning).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Awaitable, Sequence

from megarl.rollout.protocol import SamplingParams

from .trajectory import StepRollout, TrajectoryRunner, _Stateless

logger = logging.getLogger(__name__)

KEY = "algorithm.filter_groups.max_num_gen_batches"


class FilterGroupsExhausted(RuntimeError):
    """A step drew `max_num_gen_batches` generation batches and is still short of groups."""

    def __init__(self, step: int, batches: int, kept: int, need: int):
        super().__init__(
            f"step {step}: {batches} generation batch(es) drawn ({KEY}={batches}) and only "
            f"{kept} of the {need} prompt groups the step needs had rewards that differ; the "
            "data may be too hard or too easy for the model: raise the key, or set it to 0 "
            "for no limit")


# verl's names of the reward function's own score (its DAPO manager's "acc"), before an
# overlong penalty; "reward" and "seq_reward" name what trains
RAW_SCORE_METRICS = ("acc", "score")


async def has_spread(scores: Sequence[Awaitable[float]], samples: Sequence,
                     metric: str = "reward") -> bool:
    """False when every sample of the group has the same `metric` (once all are scored). A
    group of one sample is kept (nothing to compare; verl keeps it too)."""
    rewards = [float(await s) for s in scores]
    if metric in RAW_SCORE_METRICS:
        values = [s.score if s.score is not None else r for s, r in zip(samples, rewards)]
    else:
        values = rewards
    return len(values) < 2 or len(set(values)) > 1


def filter_metrics(kept: int, filtered: int, batches: int, consumed: int,
                   surplus: int = 0) -> dict[str, float]:
    return {"rollout/filter_groups/kept_groups": float(kept),
            "rollout/filter_groups/filtered_groups": float(filtered),
            "rollout/filter_groups/surplus_groups": float(surplus),
            "rollout/filter_groups/gen_batches": float(batches),
            "rollout/filter_groups/prompts_consumed": float(consumed)}


class FilteredRollout(_Stateless):
    """The step's prompts, n samples each, every one to its end, groups without a spread
    dropped and replaced from further generation batches (see the module doc); nothing
    carries over between steps."""

    def __init__(self, runner: TrajectoryRunner, loader, *, need: int,
                 max_num_gen_batches: int = 0, metric: str = "reward", remax: bool = False):
        self.runner, self.loader, self.need = runner, loader, need
        self.max_batches, self.metric, self.remax = max_num_gen_batches, metric, remax

    async def run_step(self, step: int, sp: SamplingParams, trainer_version: int
                       ) -> StepRollout:
        kept: list[tuple[list, list]] = []
        filtered: list[str] = []
        batches = consumed = 0
        while len(kept) < self.need:
            if 0 < self.max_batches <= batches:
                raise FilterGroupsExhausted(step, batches, len(kept), self.need)
            batch = list(self.loader.next_batch())
            batches += 1
            consumed += len(batch)
            bsp, prefix = sp, f"s{step}"
            if batches > 1:  # another batch of the step: its own request ids and random stream
                prefix = f"s{step}.{batches}"
                if sp.sampling_seed is not None:
                    bsp = dataclasses.replace(
                        sp, sampling_seed=(sp.sampling_seed * 1_000_003 + batches) % (2**63))
            out = await self.runner.prompts(batch, bsp, prefix, remax=self.remax)
            n = len(out.samples) // max(1, len(batch))  # samples come in group order
            for j, p in enumerate(batch):
                samples = out.samples[j * n:(j + 1) * n]
                scores = out.scores[j * n:(j + 1) * n]
                if await has_spread(scores, samples, self.metric):
                    kept.append((samples, scores))
                else:
                    filtered.append(p.uid)
        surplus = [g[0][0].uid for g in kept[self.need:]]
        kept = kept[:self.need]
        if filtered or surplus:
            logger.info("step %d: %d group(s) without a spread dropped, %d surplus, %d "
                        "generation batch(es)", step, len(filtered), len(surplus), batches)
        metrics = filter_metrics(len(kept), len(filtered), batches, consumed, len(surplus))
        if self.remax:
            metrics["rollout/remax/baseline_requests"] = float(consumed)
        return StepRollout([s for g in kept for s in g[0]], [f for g in kept for f in g[1]],
                           metrics, filtered=filtered, surplus=surplus)
