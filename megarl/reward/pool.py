"""The streaming reward pool: score each finished response in a worker process, right away.

``RewardPool.submit(sample)`` returns an asyncio future at once; a dispatcher thread hands the
call to an idle worker process and resolves the future (and sets ``sample.reward``) on the
submitting loop when the score is back, so scoring overlaps the generation still running.

Why processes and not threads: reward functions are CPU-bound Python (the GIL would serialise
them against the controller), and a hung or crashing function must be killable. Workers are
started with the ``spawn`` context — the parent has torch, Ray and threads loaded, and forking
that is unsafe — and each imports the reward function itself from its spec, so user functions
need not be picklable.

Failure contract: a call that raises, returns something that is not a finite number, runs past
``timeout_s``, or whose worker dies (segfault, ``os._exit``) scores ``failure_score``, is
counted, and is logged (the first few in full, then one summary line every 100). A timed-out
worker is killed and replaced, so one hung call never wedges the pool. Each worker runs one
call at a time: the timeout then belongs to exactly one call.

State owned here: the workers, the queue of waiting calls, the per-step counters
(``stats()`` / ``pop_stats()``, names under ``reward/``).
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import math
import multiprocessing as mp
import os
import threading
import time
import weakref
from multiprocessing.connection import wait as mp_wait
from typing import Callable, Optional

from megarl.utils.errors import ConfigError
from megarl.utils.imports import load_callable
from megarl.reward import sandbox
from megarl.reward.registry import load_reward_fn

logger = logging.getLogger(__name__)

_FULL_LOGS = 5        # failures logged with their full message
_SUMMARY_EVERY = 100  # after that, one line per this many failures
_START_TIMEOUT_S = 120.0  # a worker that cannot import its function in this time is broken
_MAX_START_FAILURES = 3   # consecutive workers dying before they are ready: give up


def _to_score(value) -> float:
    if isinstance(value, dict):
        value = value.get("score")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy / torch scalars
        except (TypeError, ValueError):
            raise TypeError(f"returned {type(value).__name__} {value!r:.80}, expected a number "
                            f"or a dict with a 'score'") from None
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned non-finite score {score}")
    return score


def _to_result(value) -> tuple[float, dict[str, float]]:
    """(score, components): a returned dict's other finite numeric entries are the reward's
    components (verl's reward_extra_info; GDPO normalises them one by one)."""
    parts = {}
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "score" or isinstance(v, (str, bytes)):
                continue
            try:
                f = float(v)
            except (TypeError, ValueError):
                continue
            if math.isfinite(f):
                parts[str(k)] = f
    return _to_score(value), parts


def split_result(value) -> tuple[float, Optional[dict[str, float]]]:
    """A pool result as (score, components); a failed call's (a bare failure score) has None."""
    return value if isinstance(value, tuple) else (value, None)


def reward_caller(spec: Optional[str]) -> Callable:
    """The reward function of `spec` as a worker's call: (data_source, solution, ground truth,
    extra_info) -> (a finite float, the components of a returned dict)."""
    fn = load_reward_fn(spec)

    def call(data_source, solution_str, ground_truth, extra_info):
        # extra_info is passed only when there is some: many user functions take three args
        if extra_info is None:
            return _to_result(fn(data_source, solution_str, ground_truth))
        return _to_result(fn(data_source, solution_str, ground_truth, extra_info))
    return call


def _worker_main(spec: Optional[str], conn, caller: str = "megarl.reward.pool:reward_caller"
                 ) -> None:
    """Worker process: make the call from `spec` with `caller` (an import path: the reward
    function here, the tools for `megarl.agent.executor.ToolPool`), then serve calls until
    told to stop (None)."""
    try:
        call = load_callable(caller, "worker caller")(spec)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which gives up
        conn.send(("fatal", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if msg is None:
            return
        call_id, args = msg
        t0 = time.perf_counter()
        try:
            conn.send((call_id, "ok", call(*args), time.perf_counter() - t0))
        except Exception as err:  # noqa: BLE001 - every failure becomes a failure score
            conn.send((call_id, "error", f"{type(err).__name__}: {err}",
                       time.perf_counter() - t0))


@dataclasses.dataclass
class _Job:
    call_id: int
    args: tuple            # (data_source, response_text, ground_truth, extra_info)
    done: Callable[[float, Optional[str]], None]  # (score, error or None), from the thread


class _Worker:
    def __init__(self, ctx, spec, caller: str, kind: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(spec, child, caller), daemon=True,
                                name=f"megarl-{kind}-worker")
        self.proc.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.job: Optional[_Job] = None
        self.deadline = math.inf
        self.dispatched = 0.0

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class RewardPool:
    """``num_workers`` processes running ``spec`` (``reward.reward_fn``; None = by data source).

    Subclasses reuse the workers for other killable calls: `CALLER` (an import path) makes a
    worker's call from the spec, `KIND` names the metrics (``<KIND>/calls`` ...) and
    `_check_spec` fails on a bad spec up front."""

    KIND = "reward"
    CALLER = "megarl.reward.pool:reward_caller"

    def _check_spec(self, spec) -> None:
        if spec is not None and not isinstance(spec, str):
            raise ConfigError(f"reward.reward_fn must be an import path string "
                              f"'module:function' for the process pool, got {spec!r}")
        load_reward_fn(spec)  # fail here, naming reward.reward_fn, not in every worker

    def __init__(self, spec: Optional[str], num_workers: int, timeout_s: float,
                 failure_score: float = 0.0, overlong=None):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ConfigError(f"reward.num_workers must be an integer >= 1, got {num_workers!r}")
        if not timeout_s > 0:
            raise ConfigError(f"reward.timeout_s must be > 0, got {timeout_s!r}")
        if not math.isfinite(float(failure_score)):
            raise ConfigError(f"reward.failure_score must be a finite number, "
                              f"got {failure_score!r}")
        self._check_spec(spec)
        self.spec, self.num_workers = spec, num_workers
        self.timeout_s, self.failure_score = float(timeout_s), float(failure_score)
        # megarl.reward.overlong.OverlongPenalty (DAPO's), added to a generated response's
        # score by its length; None: the reward is the score
        self.overlong = overlong
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()
        self._ids = itertools.count()
        self._closed = False
        self._broken: Optional[str] = None
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._reset_counters()
        self._total_failures = 0
        self._start_failures = 0
        self._workers = [_Worker(self._ctx, spec, self.CALLER, self.KIND) for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._dispatch_loop,
                                        name=f"megarl-{self.KIND}-pool",
                                        daemon=True)
        self._thread.start()
        # close at exit even if the owner forgets; a weakref keeps atexit from pinning the pool
        ref = weakref.ref(self)
        self._atexit = lambda: (ref() is not None and ref().close())
        atexit.register(self._atexit)

    @classmethod
    def from_config(cls, reward_cfg, max_response_length: int | None = None) -> "RewardPool":
        overlong = None
        if max_response_length is not None:
            from megarl.reward.overlong import OverlongPenalty

            overlong = OverlongPenalty.from_config(reward_cfg, max_response_length)
        return cls(reward_cfg.reward_fn, int(reward_cfg.num_workers), float(reward_cfg.timeout_s),
                   float(getattr(reward_cfg, "failure_score", 0.0)), overlong)

    # ---- submitting -------------------------------------------------------------------------

    def submit(self, sample) -> asyncio.Future:
        """Score ``sample`` in a worker; the future (of the running loop) resolves to its
        reward, the score plus any overlong penalty, stored in ``sample.reward`` (the score
        alone in ``sample.score``). Never raises for a failing reward function."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        penalty = 0.0
        if self.overlong is not None:
            penalty = self.overlong(len(getattr(sample, "response_ids", ()) or ()))

        def resolve(value):
            score, sample.reward_extra = split_result(value)
            sample.score = score
            sample.reward = score + penalty
            if not fut.done():
                fut.set_result(sample.reward)

        def done(value, _error):
            try:
                loop.call_soon_threadsafe(resolve, value)
            except RuntimeError:  # the loop was closed while we scored; nobody waits
                pass

        extra = getattr(sample, "extra_info", None)
        finish = getattr(sample, "finish", None)
        if extra is not None and finish is not None:
            # how the response ended ("stop": a stop token; "length": cut at the cap) and its
            # length in tokens (the stop token included), for rewards that demand a stop or
            # count tokens; verl adds keys to extra_info the same way (num_turns)
            extra = {**extra, "finish_reason": finish,
                     "response_length": len(getattr(sample, "response_ids", ()) or ())}
        self._enqueue((sample.data_source, sample.response_text, sample.ground_truth, extra),
                      done)
        return fut

    def score(self, data_source: str, solution_str: str, ground_truth,
              extra_info=None) -> concurrent.futures.Future:
        """The same outside an event loop: a concurrent future of the score."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._enqueue((data_source, solution_str, ground_truth, extra_info),
                      lambda value, _err: fut.set_result(split_result(value)[0]))
        return fut

    def _enqueue(self, args: tuple, done) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool: submit after close()")
            if self._broken:
                raise RuntimeError(f"RewardPool: workers cannot start: {self._broken}")
            self._queue.append(_Job(next(self._ids), args, done))
            self._calls += 1
        self._wake()

    def _wake(self):
        try:
            self._wake_w.send_bytes(b"x")
        except OSError:
            pass

    # ---- the dispatcher thread --------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                if self._broken:
                    waitables, deadline = [self._wake_r], math.inf
                    busy = []
                else:
                    self._assign()
                    busy = [w for w in self._workers if w.job is not None]
                    deadline = min([w.deadline for w in busy] + [math.inf])
                    waitables = [self._wake_r] + [w.conn for w in self._workers] + \
                        [w.proc.sentinel for w in self._workers]
            timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
            if not self._broken and any(not w.ready for w in self._workers):
                timeout = 1.0 if timeout is None else min(timeout, 1.0)  # start-up watchdog
            ready = mp_wait(waitables, timeout)
            with self._lock:
                if self._closed:
                    return
                if self._wake_r in ready:
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                for i, w in enumerate(list(self._workers)):
                    if not self._broken:
                        self._service(i, w, ready)

    def _assign(self) -> None:
        for w in self._workers:
            if w.ready and w.job is None and self._queue:
                job = self._queue.popleft()
                try:
                    w.conn.send((job.call_id, job.args))
                except Exception as err:  # noqa: BLE001 - e.g. an unpicklable ground truth
                    self._finish(job, None, f"cannot send the call to a worker: "
                                 f"{type(err).__name__}: {err}", 0.0)
                    continue
                w.job, w.dispatched = job, time.monotonic()
                w.deadline = w.dispatched + self.timeout_s

    def _service(self, i: int, w: _Worker, ready) -> None:
        now = time.monotonic()
        if w.conn in ready:
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):
                msg = None
                w.proc.join(timeout=5)  # closed pipe: the worker is exiting; let it finish
            if msg is not None:
                if msg[0] == "ready":
                    w.ready = True
                    self._start_failures = 0
                    return
                if msg[0] == "fatal":
                    self._give_up(f"worker could not load its {self.KIND} function(s) "
                                  f"{self.spec!r:.200}: "
                                  f"{msg[1]}")
                    return
                call_id, kind, value, elapsed = msg
                if w.job is not None and w.job.call_id == call_id:
                    job, w.job, w.deadline = w.job, None, math.inf
                    if kind == "ok":
                        self._finish(job, value, None, elapsed)
                    else:
                        self._finish(job, None, value, elapsed)
                return
        if w.job is not None and now >= w.deadline:
            job = w.job
            self._timeouts += 1
            self._finish(job, None, f"timed out after {self.timeout_s:g}s (worker killed)",
                         now - w.dispatched)
            self._replace(i)
        elif not w.proc.is_alive():
            if not w.ready:
                # dying before "ready" is not the reward function's fault: restarting would loop
                self._start_failures += 1
                if self._start_failures >= _MAX_START_FAILURES:
                    self._give_up(f"{self._start_failures} worker processes exited during "
                                  f"start-up (last exit code {w.proc.exitcode}); see their "
                                  f"stderr")
                    return
            if w.job is not None:
                code = w.proc.exitcode
                self._finish(w.job, None, f"worker process died (exit code {code})",
                             now - w.dispatched)
            self._replace(i)
        elif not w.ready and now - w.started > _START_TIMEOUT_S:
            self._give_up(f"a worker did not start within {_START_TIMEOUT_S:g}s")

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        # a worker killed inside a sandbox run leaves that run's host scratch directory
        sandbox.sweep_scratch()
        self._restarts += 1
        self._workers[i] = _Worker(self._ctx, self.spec, self.CALLER, self.KIND)

    def _give_up(self, why: str) -> None:
        logger.error("RewardPool: %s; failing all waiting calls", why)
        self._broken = why
        jobs = list(self._queue) + [w.job for w in self._workers if w.job is not None]
        self._queue.clear()
        for w in self._workers:
            w.job, w.deadline = None, math.inf
        for job in jobs:
            self._finish(job, None, why, 0.0)

    def _finish(self, job: _Job, score: Optional[float], error: Optional[str],
                elapsed: float) -> None:
        self._lat_sum += elapsed
        self._lat_n += 1
        self._lat_max = max(self._lat_max, elapsed)
        if error is not None:
            score = self.failure_score
            self._failures += 1
            self._total_failures += 1
            n = self._total_failures
            if n <= _FULL_LOGS:
                logger.warning("%s call failed (%r)%s: %s", self.KIND, job.args[0],
                               f", scored {score:g}" if self.KIND == "reward" else "", error)
            elif n % _SUMMARY_EVERY == 0:
                logger.warning("%d %s calls have failed so far (latest: %r: %.200s)", n,
                               self.KIND, job.args[0], error)
        job.done(score, error)

    # ---- metrics and shutdown ---------------------------------------------------------------

    def _reset_counters(self) -> None:
        self._calls = self._failures = self._timeouts = self._restarts = 0
        self._lat_sum, self._lat_n, self._lat_max = 0.0, 0, 0.0

    def stats(self) -> dict[str, float]:
        """Counters since the last ``pop_stats()`` (or since start)."""
        with self._lock:
            return self._stats_unlocked()

    def pop_stats(self) -> dict[str, float]:
        """``stats()``, then reset the counters (once per training step)."""
        with self._lock:
            out = self._stats_unlocked()
            self._reset_counters()
            return out

    def _stats_unlocked(self) -> dict[str, float]:
        k = self.KIND
        return {f"{k}/calls": self._calls, f"{k}/failures": self._failures,
                f"{k}/timeouts": self._timeouts, f"{k}/worker_restarts": self._restarts,
                f"{k}/latency_mean_s": self._lat_sum / max(1, self._lat_n),
                f"{k}/latency_max_s": self._lat_max, f"{k}/queued": len(self._queue)}

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Stop the workers (and fail calls still waiting); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._queue) + [w.job for w in self._workers if w.job is not None]
            self._queue.clear()
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            w.kill()
        sandbox.sweep_scratch()
        for job in jobs:
            job.done(self.failure_score, "pool closed")
        self._wake_r.close()
        self._wake_w.close()
        atexit.unregister(self._atexit)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
