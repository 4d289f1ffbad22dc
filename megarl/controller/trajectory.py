"""One trajectory runner, and the plain rollout policy over it.

`TrajectoryRunner` owns what every way of rolling out shares: send a request, keep what came
back (tokens, behaviour log-probs, per-token weight versions), resume after an abort (a weight
update, or a stop asked for by the policy) with the budget left, make the finished trajectory a
`Sample` once and start scoring it as soon as it is complete. A policy decides which prompts,
how many in flight, when to stop, and how each request is formed (rid, seed):

- `PlainRollout` (here): every prompt of the step's batch, n samples each, all to the end.
- `megarl.controller.partial.PartialRollout`: a fixed number of groups in flight, the tail cut
  off and cached for later steps (remax: each group's greedy baseline
  with it).
- a user's function, named by import path in `actor_rollout_ref.rollout.rollout_fn`
  (`module:function`, as `reward.reward_fn`): `async fn(ctx, sampling) -> StepRollout`,
  `ctx` a `RolloutContext` (the runner, the loader, n, the step, the trainer's version);
  see `FunctionRollout`.

Every policy's `run_step(step, sampling, trainer_version)` returns a `StepRollout`.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
from typing import Any, Awaitable, Callable

import numpy as np

from megarl.rollout.protocol import GenerateRequest, SamplingParams, continuation

from megarl.utils.errors import ConfigError

from .batch import Sample

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Trajectory:
    """One sample, possibly unfinished (``finish is None``)."""
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None
    reward: float | None = None
    score: float | None = None    # the reward function's own (before an overlong penalty)
    reward_extra: dict | None = dataclasses.field(default_factory=dict)  # the Sample's, once
    # scored: a reward dict's other numbers (GDPO's components); None: the call failed
    interrupted: int = 0          # times the policy stopped it before it finished
    text: str = ""
    agent: Any = None             # megarl.agent.loop.AgentState of a multi-turn sample
    # routing replay: the experts the engine routed each position of prompt + ids to, in
    # chunks as the requests returned them ([positions, layers, k] int16), and how many
    # positions they cover from the first (each request asks from there)
    routed: list = dataclasses.field(default_factory=list)
    routed_len: int = 0
    # transient: the scoring future and the Sample it scores (not checkpointed)
    future: Any = dataclasses.field(default=None, repr=False, compare=False)
    sample: Any = dataclasses.field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        # copies: the live lists grow in place while a snapshot waits to be written
        d = {"ids": list(self.ids), "logprobs": list(self.logprobs),
             "versions": list(self.versions),
             "finish": self.finish, "reward": self.reward, "interrupted": self.interrupted,
             "text": self.text}
        if self.score is not None and self.score != self.reward:
            d["score"] = self.score
        if self.reward is not None and self.reward_extra != {}:
            # components, or None for a call that failed (GDPO gives it the failure score)
            d["reward_extra"] = None if self.reward_extra is None else dict(self.reward_extra)
        if self.agent is not None:
            d["agent"] = self.agent.to_dict()
        if self.routed:
            whole = np.concatenate(self.routed)
            d["routed"] = {"shape": list(whole.shape),
                           "int16": base64.b64encode(whole.astype("<i2").tobytes()).decode()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        agent = None
        if d.get("agent") is not None:
            from megarl.agent.loop import AgentState
            agent = AgentState.from_dict(d["agent"])
        routed = []
        if d.get("routed"):
            raw = base64.b64decode(d["routed"]["int16"])
            routed = [np.frombuffer(raw, dtype="<i2").reshape(d["routed"]["shape"]).copy()]
        return cls(ids=list(d["ids"]), logprobs=[float(x) for x in d["logprobs"]],
                   versions=[int(v) for v in d["versions"]], finish=d["finish"],
                   reward=d["reward"], score=d.get("score", d["reward"]),
                   reward_extra=d.get("reward_extra", {}),
                   interrupted=int(d["interrupted"]), text=d["text"],
                   agent=agent, routed=routed, routed_len=sum(len(c) for c in routed))


@dataclasses.dataclass
class StepRollout:
    """What GENERATE(k) produced: samples in group order, their reward awaitables (same
    order), metrics, the uids of prompts dropped as too stale, and with dynamic sampling
    (`megarl.controller.filter_groups`) those whose group had no spread (`filtered`) or was
    kept beyond the batch (`surplus`): consumed, not trained."""
    samples: list[Sample]
    scores: list[Awaitable[float]]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    dropped: list[str] = dataclasses.field(default_factory=list)
    filtered: list[str] = dataclasses.field(default_factory=list)
    surplus: list[str] = dataclasses.field(default_factory=list)

    def __iter__(self):
        """Unpacks as (samples, scores, metrics, dropped)."""
        return iter((self.samples, self.scores, self.metrics, self.dropped))


def sampling_params(rollout_cfg, eos_ids: list[int], seed: int | None, *, validation=False,
                    max_new_tokens: int) -> SamplingParams:
    """A step's (or, with `validation`, the validation's) sampling from `rollout.*`."""
    src = rollout_cfg.val_kwargs if validation else rollout_cfg
    greedy = validation and not src.do_sample
    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=0.0 if greedy else float(src.temperature),
        top_p=float(src.top_p), top_k=int(src.top_k), n=int(src.n),
        min_new_tokens=min(int(rollout_cfg.min_new_tokens), max_new_tokens),
        stop_token_ids=list(eos_ids), sampling_seed=seed)


def ended_before_abort(req: GenerateRequest, out) -> bool:
    """An aborted output whose last token is one of the request's stop ids, generated where a
    stop could end it (past `min_new_tokens`)."""
    ids, sp = out.output_ids, req.sampling
    return bool(ids) and ids[-1] in sp.stop_token_ids and len(ids) >= sp.min_new_tokens


def extra_info_of(prompt) -> dict:
    return dict(getattr(prompt, "extra_info", None) or {})


# (trajectory so far, attempt number) -> the request that continues it
RequestFor = Callable[[Trajectory, int], GenerateRequest]


class TrajectoryRunner:
    """Runs trajectories on the rollout manager; `scorer.submit(sample)` returns an awaitable
    of the reward (the streaming `megarl.reward.pool.RewardPool`), None skips scoring.
    With `agent` (a `megarl.agent.loop.AgentLoop`) every trajectory is multi-turn: the loop
    runs tools between the turns this runner generates, whichever policy drives it.
    With `routing` (the model's (layers, top-k): `rollout.enable_rollout_routing_replay`)
    every request asks the engine for the experts it routed each position to, from the
    first position the trajectory's earlier requests did not cover (`routed_experts_start_len`):
    each position keeps the routing of the forward pass that first computed it, as its
    token keeps that pass's log-prob and version."""

    def __init__(self, manager, tokenizer, scorer=None, max_resumes: int = 100, agent=None,
                 routing: tuple[int, int] | None = None):
        self.manager, self.tokenizer, self.scorer = manager, tokenizer, scorer
        self.max_resumes = max_resumes
        self.agent = agent
        self.routing = routing
        self.running: dict[str, None] = {}  # rids in flight (insertion-ordered set)

    async def extend(self, t: Trajectory, budget: int, request_for: RequestFor,
                     stopping: Callable[[], bool] = lambda: False, prompt=None) -> bool:
        """Generate into `t` until it finishes (True) or `stopping()` holds (False, counted
        in `t.interrupted`). An abort while not stopping is a weight update: the request is
        resumed with the budget left, under the new weights. Multi-turn (`agent`): through
        every turn and tool call, with `prompt`'s ``extra_info`` as the tools' context."""
        if self.agent is None:
            return await self._generate(t, budget, request_for, stopping)
        if t.agent is None:
            from megarl.agent.loop import AgentState
            t.agent = AgentState(mask=[1] * len(t.ids))
        return await self.agent.extend(
            t, budget, lambda t: self._generate(t, budget, request_for, stopping),
            extra_info_of(prompt))

    async def _generate(self, t: Trajectory, budget: int, request_for: RequestFor,
                        stopping: Callable[[], bool]) -> bool:
        """One generation to its finish (a multi-turn sample's turn), resumed over aborts."""
        attempts = 0
        while t.finish is None:
            if budget - len(t.ids) <= 0:
                t.finish = "length"
                break
            if stopping():
                t.interrupted += 1
                return False
            req = request_for(t, attempts)
            if t.agent is not None and self.agent is not None and self.agent.min_turn_tokens:
                req = dataclasses.replace(req, sampling=dataclasses.replace(
                    req.sampling, min_new_tokens=min(self.agent.turn_minimum(t),
                                                     req.sampling.max_new_tokens)))
            if self.routing is not None:
                req = dataclasses.replace(req, return_routed_experts=True,
                                          routed_experts_start_len=t.routed_len)
            attempts += 1
            self.running[req.rid] = None
            try:
                out = await self.manager.generate(req)
            finally:
                self.running.pop(req.rid, None)
            if self.routing is not None:
                self._keep_routing(t, req, out)
            t.ids += out.output_ids
            t.logprobs += out.output_logprobs or [0.0] * len(out.output_ids)
            t.versions += out.token_versions()
            if t.agent is not None:
                t.agent.mask += [1] * len(out.output_ids)
            if not out.aborted:
                t.finish = out.finish_reason.type
            elif ended_before_abort(req, out):
                # the abort raced the stop token (stock SGLang can answer "abort" with the
                # stop id already generated): the output is over, and resuming it would
                # train tokens written after its end
                t.finish = "stop"
            elif stopping():
                t.interrupted += 1
                return False
            elif attempts > self.max_resumes:
                raise RuntimeError(f"request {req.rid}: aborted {attempts} times in a row")
            else:
                await asyncio.sleep(0.01)  # let the update that aborted it land
        return True

    def _keep_routing(self, t: Trajectory, req: GenerateRequest, out) -> None:
        """The positions `req` covered: [start_len, its sequence's length - 1) (the last
        token never ran through the model). An aborted request may return none; the next
        request then asks from the same position."""
        if out.routed_experts is None:
            if out.aborted:
                return
            raise RuntimeError(f"request {req.rid}: asked for routed experts, the engine "
                               f"returned none (meta_info.routed_experts; a stock server "
                               f"needs --enable-return-routed-experts)")
        from megarl.rollout.protocol import decode_routed_experts

        chunk = decode_routed_experts(out.routed_experts, *self.routing)
        want = len(req.input_ids) + len(out.output_ids) - 1 - req.routed_experts_start_len
        if len(chunk) != want and not (out.aborted and len(chunk) == 0):
            raise RuntimeError(f"request {req.rid}: meta_info.routed_experts covers "
                               f"{len(chunk)} positions, expected {want} (from "
                               f"routed_experts_start_len={req.routed_experts_start_len})")
        if len(chunk):
            t.routed.append(np.asarray(chunk, dtype=np.int16))
            t.routed_len += len(chunk)

    def finish(self, prompt, t: Trajectory, prompt_ids: list[int] | None = None) -> Sample:
        """The finished trajectory as a Sample, scoring started (once; a reward already
        known, e.g. from a checkpoint, is kept). `prompt_ids`: what the model was given
        before the response, where that is more than the data's prompt (a later turn)."""
        if t.sample is not None:
            return t.sample
        if not t.text:
            t.text = self.tokenizer.decode(t.ids, skip_special_tokens=True)
        extra, mask, agent = extra_info_of(prompt), None, None
        if t.agent is not None:
            mask = list(t.agent.mask)
            agent = {**t.agent.summary(), "calls": [dict(c) for c in t.agent.calls]}
            # for the reward (verl adds num_turns the same way): what the model did and its
            # last turn's text, special tokens kept (tool-call markers often are special)
            extra.update({"num_turns": t.agent.turns,
                          "tool_calls": [{k: c[k] for k in ("name", "arguments", "ok", "answer")}
                                         for c in t.agent.calls],
                          "final_turn": self.tokenizer.decode(t.ids[t.agent.turn_start:],
                                                              skip_special_tokens=False)})
        routed = None
        if self.routing is not None:
            n = len(prompt_ids or prompt.prompt_ids) + len(t.ids) - 1
            if t.routed_len != n:
                raise RuntimeError(f"prompt {prompt.uid}: routed experts cover {t.routed_len} "
                                   f"positions of the sample's {n}")
            routed = np.concatenate(t.routed) if t.routed else None
        t.sample = Sample(uid=prompt.uid, prompt_ids=list(prompt_ids or prompt.prompt_ids),
                          response_ids=list(t.ids), rollout_logprobs=list(t.logprobs),
                          weight_version=t.versions[0] if t.versions else -1,
                          token_versions=list(t.versions), finish=t.finish,
                          ground_truth=prompt.ground_truth, data_source=prompt.data_source,
                          response_text=t.text, extra_info=extra, loss_mask=mask,
                          agent=agent, routed_experts=routed)
        if t.reward is not None:
            t.sample.reward = t.reward
            t.sample.score = t.score if t.score is not None else t.reward
            t.sample.reward_extra = None if t.reward_extra is None else dict(t.reward_extra)
            t.future = _done(t.reward)
        elif self.scorer is not None:
            fut = asyncio.ensure_future(self.scorer.submit(t.sample))
            fut.add_done_callback(_store_reward(t))
            t.future = fut
        else:
            t.future = _done(0.0)
        return t.sample

    async def sample(self, prompt, request: GenerateRequest) -> Trajectory:
        """One whole sample from `request` (n=1), resumed as `continuation` forms it; its
        `sample` made and `future` scoring."""
        if request.sampling.n != 1:
            raise ValueError(f"request {request.rid}: sampling.n={request.sampling.n}; one "
                             "trajectory is one sample (GenerateRequest.expand() gives n)")
        t = Trajectory()

        def request_for(t: Trajectory, attempt: int) -> GenerateRequest:
            if not t.ids:
                return request
            req = continuation(request, t.ids)
            seed = req.sampling.sampling_seed
            if t.agent is not None and seed is not None:
                # a later turn draws afresh, not the first turn's random stream again
                req.sampling.sampling_seed = (seed * 1_000_003 + len(t.ids)) % (2**63)
            return req
        await self.extend(t, request.sampling.max_new_tokens, request_for, prompt=prompt)
        self.finish(prompt, t, request.input_ids)
        return t

    async def prompts(self, prompts, sp: SamplingParams, rid_prefix: str,
                      round_size: int | None = None, remax: bool = False) -> StepRollout:
        """n samples of every prompt, all to the end, scored as each finishes; `round_size`
        prompts at a time (None: all at once), each round started when the one before has
        finished. Seeds and request ids come from each prompt's own index and uid, so rounds
        sample exactly what one call over all prompts would. `remax`: besides, one greedy
        response per prompt, generated beside its samples and scored, whose reward is each
        sample's `baseline` (ReMax's; the response itself is not trained)."""
        prompts = list(prompts)
        size = round_size or max(1, len(prompts))
        samples, scores, metrics = [], [], {}
        for start in range(0, len(prompts), size):
            out = await self._round(prompts[start:start + size], sp, rid_prefix, remax)
            samples += out.samples
            scores += out.scores
            for name, value in out.metrics.items():
                metrics[name] = metrics.get(name, 0.0) + value
        if remax and prompts:
            metrics["rollout/remax/baseline_reward_mean"] = (
                metrics.pop("rollout/remax/baseline_reward_sum") / len(prompts))
        return StepRollout(samples, scores, metrics)

    async def _baseline(self, p, sp: SamplingParams, rid_prefix: str) -> float:
        """ReMax's baseline: the reward of the prompt's greedy response (verl generates it
        with do_sample=False beside the sampled ones)."""
        greedy = dataclasses.replace(sp, n=1, temperature=0.0, sampling_seed=None)
        t = await self.sample(p, GenerateRequest(list(p.prompt_ids), greedy, True,
                                                 f"{rid_prefix}-{p.uid}-greedy"))
        return float(await t.future)

    async def _round(self, prompts, sp: SamplingParams, rid_prefix: str,
                     remax: bool = False) -> StepRollout:
        baselines = [self._baseline(p, sp, rid_prefix) for p in prompts] if remax else []
        jobs = []
        for p in prompts:
            psp = sp
            if sp.sampling_seed is not None:
                # each prompt its own random stream (as partial rollout seeds them): from the
                # step's seed alone, sample i of every prompt of the step drew the same numbers
                psp = dataclasses.replace(sp, sampling_seed=(
                    sp.sampling_seed * 1_000_003 + p.index * 4099) % (2**63))
            base = GenerateRequest(list(p.prompt_ids), psp, True, f"{rid_prefix}-{p.uid}")
            jobs += [self.sample(p, req) for req in base.expand()]
        done, base_rewards = await asyncio.gather(asyncio.gather(*jobs),
                                                  asyncio.gather(*baselines))
        metrics = {}
        if remax:
            by_uid = {p.uid: r for p, r in zip(prompts, base_rewards)}
            for t in done:
                t.sample.baseline = by_uid[t.sample.uid]
            metrics = {"rollout/remax/baseline_requests": float(len(prompts)),
                       "rollout/remax/baseline_reward_sum": float(sum(base_rewards))}
        return StepRollout([t.sample for t in done], [t.future for t in done], metrics)


class _Stateless:
    """A policy that keeps nothing between steps: no checkpoint state."""

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        pass


class PlainRollout(_Stateless):
    """The step's batch of prompts, n samples each, every one to its end (`remax`: and a
    greedy baseline response per prompt)."""

    def __init__(self, runner: TrajectoryRunner, loader, remax: bool = False):
        self.runner, self.loader, self.remax = runner, loader, remax

    async def run_step(self, step: int, sp: SamplingParams, trainer_version: int
                       ) -> StepRollout:
        return await self.runner.prompts(self.loader.next_batch(), sp, f"s{step}",
                                         remax=self.remax)


@dataclasses.dataclass
class RolloutContext:
    """What a rollout function gets: the runner (generate, resume, score), the prompt loader
    (`loader.next_batch()` draws the step's prompts; what it draws is owed training), the
    samples per prompt, and the step with the version TRAIN(step) starts from."""
    runner: TrajectoryRunner
    loader: Any
    n: int
    step: int
    trainer_version: int


class FunctionRollout(_Stateless):
    """A user's rollout function (`actor_rollout_ref.rollout.rollout_fn`) as a policy."""

    def __init__(self, fn: Callable, name: str, runner: TrajectoryRunner, loader, n: int):
        if not asyncio.iscoroutinefunction(fn):
            raise ConfigError(f"actor_rollout_ref.rollout.rollout_fn: {name!r} is not an "
                              "`async def` function (ctx, sampling) -> StepRollout")
        self.fn, self.name, self.runner, self.loader, self.n = fn, name, runner, loader, n

    async def run_step(self, step: int, sp: SamplingParams, trainer_version: int
                       ) -> StepRollout:
        out = await self.fn(RolloutContext(self.runner, self.loader, self.n, step,
                                           trainer_version), sp)
        if not isinstance(out, StepRollout) or not out.samples:
            raise TypeError(f"rollout function {self.name} returned {type(out).__name__}"
                            f"{' with no samples' if isinstance(out, StepRollout) else ''}; "
                            "it must return a StepRollout with the step's samples")
        if len(out.scores) != len(out.samples):
            raise TypeError(f"rollout function {self.name}: {len(out.samples)} samples but "
                            f"{len(out.scores)} reward awaitables (TrajectoryRunner.finish "
                            "starts one per sample)")
        return out


def make_policy(rollout_cfg, runner: TrajectoryRunner, loader, *, need: int,
                max_staleness: int | None, stale_policy: str, rollout_fn: Callable | None,
                filter_groups=None, remax: bool = False):
    """The GENERATE state's policy for this run's `actor_rollout_ref.rollout` (and
    `algorithm.filter_groups`, dynamic sampling, when enabled; `remax`: each prompt's greedy
    baseline generated beside its samples)."""
    if rollout_fn is not None:
        return FunctionRollout(rollout_fn, rollout_cfg.rollout_fn, runner, loader,
                               int(rollout_cfg.n))
    max_batches, metric = None, "reward"
    if filter_groups is not None and filter_groups.enable:
        max_batches, metric = int(filter_groups.max_num_gen_batches), str(filter_groups.metric)
    if not rollout_cfg.partial_rollout:
        if max_batches is not None:
            from .filter_groups import FilteredRollout

            return FilteredRollout(runner, loader, need=need, max_num_gen_batches=max_batches,
                                   metric=metric, remax=remax)
        return PlainRollout(runner, loader, remax)
    from .partial import PartialRollout

    over = rollout_cfg.over_sample_prompts
    return PartialRollout(runner, loader, n=int(rollout_cfg.n), need=need,
                          over=over if over is not None else max(1, need // 2),
                          max_staleness=max_staleness, stale_policy=stale_policy,
                          filter_max_gen_batches=max_batches, filter_metric=metric,
                          remax=remax)


def _store_reward(t: Trajectory) -> Callable:
    def cb(fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            t.reward = float(fut.result())
            t.score = t.sample.score if t.sample is not None else None
            t.reward_extra = t.sample.reward_extra if t.sample is not None else {}
    return cb


def _done(value: float) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut
