"""GENERATE and REWARD work for one step: requests from prompts, responses to scored samples.

Owns turning prompts into engine requests (n samples each, seeded per step) and engine outputs
into `Sample`s. A response aborted by a weight update (engines pause in `abort` mode without the
dual buffer) is resumed from where it stopped — its tokens, log-probs and versions are kept and
the tail continues under the new weights — so no sample is lost to a sync. Each response is
handed to the scorer (the streaming `megarl.reward.pool.RewardPool`) as soon as it is complete,
while the rest are still generating.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

from megarl.rollout.protocol import GenerateRequest, SamplingParams, continuation

from .batch import Sample

logger = logging.getLogger(__name__)


def sampling_params(rollout_cfg, eos_ids: list[int], seed: int | None, *, validation=False,
                    max_new_tokens: int) -> SamplingParams:
    src = rollout_cfg.val_kwargs if validation else rollout_cfg
    greedy = validation and not src.do_sample
    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=0.0 if greedy else float(src.temperature),
        top_p=float(src.top_p), top_k=int(src.top_k), n=int(src.n),
        stop_token_ids=list(eos_ids), sampling_seed=seed)


async def generate_one(manager, request: GenerateRequest, max_resumes: int = 100):
    """(output_ids, logprobs, token_versions, finish_reason) of one sample, resuming aborts."""
    ids, lps, versions = [], [], []
    req = request
    for _ in range(max_resumes + 1):
        out = await manager.generate(req)
        ids += out.output_ids
        lps += out.output_logprobs or [0.0] * len(out.output_ids)
        versions += out.token_versions()
        if not out.aborted:
            return ids, lps, versions, out.finish_reason.type
        if len(ids) >= request.sampling.max_new_tokens:
            return ids, lps, versions, "length"
        # the budget left is counted over every token so far, not just this attempt's
        req = continuation(request, dataclasses.replace(out, output_ids=list(ids)))
        await asyncio.sleep(0.01)  # let the update that aborted us finish
    raise RuntimeError(f"request {request.rid}: aborted {max_resumes} times in a row")


def extra_info_of(prompt) -> dict:
    return dict(getattr(prompt, "extra_info", None) or {})


async def rollout(manager, prompts, sp: SamplingParams, tokenizer, scorer,
                  rid_prefix: str) -> tuple[list[Sample], list[asyncio.Future]]:
    """Generate n samples for every prompt; start scoring each as soon as it finishes
    (`scorer.submit(sample)` returns an awaitable of the reward; None skips scoring)."""
    scores: list[asyncio.Future] = []

    async def one(prompt, req):
        ids, lps, versions, finish = await generate_one(manager, req)
        s = Sample(uid=prompt.uid, prompt_ids=list(prompt.prompt_ids), response_ids=ids,
                   rollout_logprobs=lps, weight_version=versions[0] if versions else -1,
                   token_versions=versions, finish=finish, ground_truth=prompt.ground_truth,
                   data_source=prompt.data_source, extra_info=extra_info_of(prompt),
                   response_text=tokenizer.decode(ids, skip_special_tokens=True))
        if scorer is not None:
            scores.append(scorer.submit(s))
        return s

    jobs = []
    for p in prompts:
        base = GenerateRequest(list(p.prompt_ids), sp, True, f"{rid_prefix}-{p.uid}")
        jobs += [one(p, req) for req in base.expand()]
    samples = await asyncio.gather(*jobs)
    return list(samples), scores
