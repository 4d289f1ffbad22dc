"""The embedded rollout engine: a Hugging Face causal LM behind the rollout protocol.

Owns the engine's run state: the waiting queue, the in-flight requests and their futures,
pause state, the current weight version and the weight-update groups. The model, its KV cache
and the running batch (megarl.rollout.batch) are touched only on one model thread, and only
under `_lock`, one step at a time; everything else happens on the asyncio event loop, so no
other locking is needed.

Scheduling: the loop admits waiting requests up to `max_running_requests`, runs one step
(prefill the newcomers, one decode token for every row) on the model thread, and resolves the
future of every row that finished, so a short response is handed back while long ones still
run. Aborts, pauses and weight swaps take `_lock` too, which makes the gap between two steps
the one safe point where any of them happens.

Weight updates follow stock SGLang's contract (see megarl.rollout.weights): a session
(`begin_weight_update` ... `end_weight_update`) holds update calls, each of which receives its
tensors on the update group (one rank per engine TP rank) and loads them. How they load is the
engine's own business behind that API:
- staged (default): received on a worker thread while generation goes on, staged in a second
  buffer, and swapped in together at `end_weight_update`, at one safe point between decode
  steps, by reference (the displaced tensors stage the next version, so nothing is
  allocated per version);
- live (`live_updates`, the `--sglang-contract` server): each call loads into the live
  weights at once, between two steps, and its `weight_version` takes effect there, as stock
  SGLang does; a failure half-way leaves the model partly updated, as there.

Routed experts (`enable_return_routed_experts`, stock's `--enable-return-routed-experts`) are
recorded by megarl.rollout.routing in the same forward passes, for the requests that ask.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hashlib
import logging
import random
import socket
import time
from pathlib import Path

import torch

from megarl.rollout.batch import DecodeBatch, Sequence
from megarl.rollout.protocol import (PAUSE_MODES, BadRequest, EngineClosed, GenerateOutput,
                                     GenerateRequest, short_repr)
from megarl.rollout.routing import RoutedBatch, RoutingRecorder
from megarl.rollout.weights import (LOAD_FORMAT, EngineRanks, WeightStore, bucket_layout,
                                    in_daemon_thread, overall_checksum, parse_dtype,
                                    tensor_checksum, unpack_bucket)

logger = logging.getLogger(__name__)


UPDATE_BACKENDS = ("gloo", "nccl")  # torch backends an update group is built with here


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _close_late_join(join: concurrent.futures.Future) -> None:
    if join.exception() is None:
        logger.warning("an update-group join completed after its deadline; leaving the group")
        join.result().close()


def _first_line(e: BaseException) -> str:
    """torch's distributed errors append a C++ stack trace to their message."""
    return short_repr((str(e).strip().splitlines() or [type(e).__name__])[0], 300, quote=False)


@contextlib.contextmanager
def _allocation(field: str, what: str):
    """A receive buffer the request's shapes ask for, refused (naming `field`) when torch
    cannot make it: a negative or over-64-bit dimension, or more memory than there is."""
    try:
        yield
    except (RuntimeError, ValueError, TypeError, OverflowError, MemoryError) as e:
        raise BadRequest(field, f"cannot allocate {what}: {_first_line(e)}") from None


class UpdateRefused(BadRequest):
    """A weight-update call stock SGLang answers with `success: false` (HTTP 400)."""

    def __init__(self, message: str):
        super().__init__("weights", message)


# model_type -> the transformers config class that reads it: Kimi-K2's config.json names
# its own model_type (with remote code) for DeepSeek-V3's architecture
_MODEL_TYPE_AS = {"kimi_k2": "DeepseekV3Config"}


def hf_config(model_path: str, trust_remote_code: bool = False):
    """transformers' config of `model_path`; a model_type transformers does not register
    (`_MODEL_TYPE_AS`) is read by the class of the architecture it ships, without remote
    code."""
    import json
    from pathlib import Path

    import transformers

    try:
        raw = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    as_cls = _MODEL_TYPE_AS.get(raw.get("model_type")) if isinstance(raw, dict) else None
    if as_cls is None or trust_remote_code:
        return transformers.AutoConfig.from_pretrained(model_path,
                                                       trust_remote_code=trust_remote_code)
    return getattr(transformers, as_cls).from_dict(
        {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")})


def load_model(model_path: str, device: str, dtype: str | None, load_format: str,
               trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype) if dtype and dtype != "auto" else None
    cfg = hf_config(model_path, trust_remote_code)
    if load_format == "dummy":
        # SGLang's dummy format: the architecture with random weights, for engines whose real
        # weights arrive from the trainer before the first rollout.
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype or torch.float32,
                                                 trust_remote_code=trust_remote_code)
    elif load_format == "auto":
        model = AutoModelForCausalLM.from_pretrained(model_path, config=cfg,
                                                     dtype=torch_dtype or "auto",
                                                     trust_remote_code=trust_remote_code)
    else:
        raise ValueError(f"load_format: {load_format!r} is not supported; use auto or dummy")
    text_cfg = model.config.get_text_config()
    layer_types = set(getattr(text_cfg, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(text_cfg, "use_sliding_window", False):
        raise ValueError(f"{model_path}: only full-attention models are supported by the "
                         f"embedded engine (layer types {sorted(layer_types)})")
    return model.to(device).eval()


class EmbeddedEngine:
    """In-process engine implementing `megarl.rollout.protocol.RolloutEngine`."""

    def __init__(self, model_path: str | Path, *, device: str = "cpu", dtype: str | None = None,
                 load_format: str = "auto", max_running_requests: int = 64,
                 context_length: int | None = None, seed: int = 0,
                 load_tokenizer: bool = True, weight_version: str = "default",
                 tp_size: int = 1, live_updates: bool = False, honour_seeds: bool = True,
                 fail_update_at: int | None = None, update_group_timeout_s: float = 300.0,
                 enable_return_routed_experts: bool = False, trust_remote_code: bool = False):
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.model = load_model(self.model_path, device, dtype, load_format, trust_remote_code)
        cfg = self.model.config.get_text_config()
        self.vocab_size = cfg.vocab_size
        self.context_length = context_length or cfg.max_position_embeddings
        self.max_running_requests = max_running_requests
        self.tokenizer = None
        if load_tokenizer:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path,
                                                           trust_remote_code=trust_remote_code)
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = cfg.eos_token_id if eos is None else eos
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.weight_version = weight_version
        self.tp_size = int(tp_size)  # update-group ranks this engine holds (see EngineRanks)
        # Stock SGLang's behaviour (the --sglang-contract server): each update call loads into
        # the live weights at once; sampling seeds only with deterministic inference.
        self.live_updates, self.honour_seeds = live_updates, honour_seeds
        self.fail_update_at = fail_update_at  # fault injection: refuse the Nth update call
        self.update_group_timeout_s = update_group_timeout_s
        self.update_calls = 0
        self.weights = WeightStore(self.model)
        self._spare: dict[str, torch.Tensor] = {}  # displaced live tensors, to stage into
        # Without the flag a request's return_routed_experts is ignored, as by stock.
        self.routing = (RoutingRecorder.for_model(self.model) if enable_return_routed_experts
                        else None)
        self.batch = (DecodeBatch(self.model, self.device) if self.routing is None
                      else RoutedBatch(self.model, self.device, self.routing))
        self._rng = random.Random(seed)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-model")
        self._closed = False
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._seqs: dict[str, Sequence] = {}
        self._futures: dict[str, asyncio.Future] = {}
        self._paused = False
        self._txn: dict[str, torch.Tensor] | None = None  # the open update session's staging
        self._txn_version: str | None = None
        self._groups: dict[str, EngineRanks] = {}
        self._joining: set[str] = set()  # groups whose rendezvous is under way
        self._join_threads: set[concurrent.futures.Future] = set()  # incl. abandoned ones
        self._recv_bufs: dict[str, torch.Tensor] = {}  # flattened-bucket receive, per group
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self.generated_tokens = 0
        self.model_steps = 0  # batched forward passes (prefill + decode): a load-free cost
        logger.info("embedded engine: %s on %s (%s), context %d, eos %s", self.model_path,
                    self.device, next(self.model.parameters()).dtype, self.context_length,
                    sorted(self.eos_token_ids))

    # -- event-loop plumbing ----------------------------------------------------------------
    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        if self._seqs:
            self._drop_orphans()
        # (Re)bind to this loop: asyncio primitives belong to the loop that first awaits them.
        self._loop = loop
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._schedule(), name="megarl-embedded-scheduler")

    def _drop_orphans(self) -> None:
        """Forget requests left behind by a loop that has gone away (their callers are gone)."""
        self._executor.submit(lambda: None).result()  # let a step still running finish
        orphans = self.batch.take_all()
        logger.warning("dropping %d requests orphaned by a closed event loop", len(self._seqs))
        del orphans
        self._waiting.clear()
        self._seqs.clear()
        self._futures.clear()
        if self.routing is not None:
            self.routing.forget()

    def _alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _on_model_thread(self, fn, *args):
        if self._closed:  # the executor is shut down: refused, not a RuntimeError and a 500
            raise EngineClosed()
        return await self._loop.run_in_executor(self._executor, fn, *args)

    async def _schedule(self) -> None:
        """Consumes the waiting queue; waits while paused or idle; woken by `_wake`."""
        while True:
            if self._paused or not self._seqs:
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                if self._paused:  # paused while this loop waited for the lock
                    continue
                room = self.max_running_requests - len(self.batch)
                admit = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                try:
                    finished = await self._on_model_thread(self._step, admit, self.weight_version)
                except Exception as e:  # a model failure must not leave callers waiting forever
                    logger.exception("engine step failed; aborting all requests")
                    finished = list({id(s): s for s in self.batch.take_all() + admit}.values())
                    for s in finished:
                        s.abort_message = f"engine error: {e}"
            self._resolve(finished)
            if not finished:
                await asyncio.sleep(0)  # let request handlers and aborts in between steps

    def _step(self, admit: list[Sequence], version: str) -> list[Sequence]:
        self.model_steps += bool(admit) + bool(len(self.batch) or admit)
        finished = self.batch.take_finished()  # rows flagged for abort since the last step
        if admit:
            self.batch.admit(admit, version)
            finished += self.batch.take_finished()
        if len(self.batch):
            self.batch.decode(version)
            finished += self.batch.take_finished()
        return finished

    def _resolve(self, seqs: list[Sequence], queued: bool = False) -> None:
        """Hand back finished or aborted sequences; `queued`: aborted from the waiting queue,
        which stock answers without routed experts (even a retracted one's)."""
        for s in seqs:
            self._seqs.pop(s.rid, None)
            fut = self._futures.pop(s.rid, None)
            self.generated_tokens += len(s.output_ids)
            routed = self.routing.take(s) if self.routing is not None else None  # drops it
            if fut is not None and not fut.done():
                out = s.output(self.weight_version)
                out.routed_experts = None if queued else routed
                fut.set_result(out)

    # -- generation -------------------------------------------------------------------------
    def check(self, request: GenerateRequest) -> None:
        """Raise BadRequest if this engine cannot take `request` now."""
        request.validate(self.vocab_size)
        if request.sampling.n != 1:
            raise BadRequest("sampling_params.n", "one sample per engine request; use expand()")
        if request.rid in self._seqs:
            raise BadRequest("rid", f"request {request.rid!r} is already in flight")
        if len(request.input_ids) >= self.context_length:
            raise BadRequest("input_ids", f"prompt of {len(request.input_ids)} tokens does not "
                             f"fit the context length {self.context_length}")

    def make_sequence(self, request: GenerateRequest) -> Sequence:
        self.check(request)
        sp = request.sampling
        room = self.context_length - len(request.input_ids)
        gen = torch.Generator(device=self.device)
        seeded = sp.sampling_seed is not None and self.honour_seeds
        gen.manual_seed(sp.sampling_seed if seeded else self._rng.getrandbits(63))
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids))
        return Sequence(request, min(sp.max_new_tokens, room), frozenset(stops), gen)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self._ensure_started()
        seq = self.make_sequence(request)
        fut = self._loop.create_future()
        self._seqs[seq.rid], self._futures[seq.rid] = seq, fut
        self._waiting.append(seq)
        self._wake.set()
        try:
            out = await asyncio.shield(fut)
        except asyncio.CancelledError:
            # The caller went away (client disconnect): stop spending compute on it. When the
            # whole loop is shutting down the scheduler is gone too; the next loop cleans up.
            if self._alive():
                await asyncio.shield(self.abort(seq.rid))
            raise
        if self.tokenizer is not None:
            out.text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        return out

    async def abort(self, rid: str | None = None, abort_all: bool = False,
                    message: str = "aborted by request") -> None:
        """Abort one or all requests; returns once their (partial) outputs are handed back.
        As in stock SGLang, `rid` matches every request whose rid starts with it, and an empty
        rid without `abort_all` aborts nothing."""
        self._ensure_started()
        if not abort_all and not rid:
            logger.warning("abort_request with an empty rid and abort_all=false: ignored")
            return
        targets = list(self._seqs.values()) if abort_all else [
            s for r, s in self._seqs.items() if r.startswith(rid)]
        if not targets:
            return
        for s in targets:
            s.abort_message = message
        hit = {s.rid for s in targets}
        queued = [s for s in self._waiting if s.rid in hit]
        self._waiting = collections.deque(s for s in self._waiting if s.rid not in hit)
        self._resolve(queued, queued=True)
        async with self._lock:
            self._resolve(await self._on_model_thread(self.batch.take_finished))

    async def pause(self, mode: str = "abort") -> None:
        """SGLang's modes: abort everything, retract running rows to the queue (their KV is
        dropped and rebuilt on resume), or hold them in place."""
        if mode not in PAUSE_MODES:
            raise BadRequest("mode", f"unknown pause mode {mode!r}; expected one of {PAUSE_MODES}")
        self._ensure_started()
        self._paused = True
        if mode == "abort":
            await self.abort(abort_all=True, message="aborted by pause_generation")
            return
        async with self._lock:  # after this, no step is running and none will start
            if mode == "retract":
                running = await self._on_model_thread(self.batch.take_all)
                self._waiting.extendleft(reversed(running))
        logger.info("generation paused (%s); %d requests held", mode, len(self._seqs))

    async def resume(self) -> None:
        self._ensure_started()
        self._paused = False
        self._wake.set()

    @property
    def paused(self) -> bool:
        return self._paused

    async def flush_cache(self) -> bool:
        # No KV outlives its request here, so there is nothing to flush; like stock SGLang,
        # refuse while requests run, but not while a pause holds them all retracted (queued,
        # without KV), which stock allows.
        return not self._seqs or (self._paused and not len(self.batch))

    async def get_weight_version(self) -> str:
        return self.weight_version

    def stats(self) -> dict:
        return {"running": len(self.batch), "waiting": len(self._waiting),
                "paused": self._paused, "weight_version": self.weight_version,
                "generated_tokens": self.generated_tokens, "model_steps": self.model_steps,
                "staging_bytes": sum(t.numel() * t.element_size() for d in (self._spare,
                                     self._txn or {}) for t in d.values())}

    # -- weight updates ---------------------------------------------------------------------
    # Stock SGLang's contract: every update call sits inside a begin/end session; the update
    # group has one rank per engine TP rank; an update call receives its bytes, loads them,
    # and records its `weight_version` (the version of every token generated after it).
    def _session_open(self, what: str) -> None:
        if self._txn is None:
            raise UpdateRefused(f"{what} must run between begin_weight_update() and "
                                "end_weight_update()")

    async def _load(self, named: list[tuple[str, torch.Tensor]], weight_version: str | None,
                    flush_cache: bool) -> None:
        """Validate, then stage (swapped in at `end_weight_update`) or, in live mode, load into
        the live weights at the next safe point, as stock SGLang does."""
        try:
            self.weights.check([n for n, _ in named], [t.shape for _, t in named])
        except BadRequest as e:
            raise UpdateRefused(f"Failed to update parameter online: {e}") from None
        if self.live_updates:
            async with self._lock:  # the model-update lock: between two decode steps
                await self._on_model_thread(self.weights.load_live, named)
                if weight_version is not None:
                    self.weight_version = weight_version
        else:
            staged = await asyncio.to_thread(self.weights.stage, named, self._spare)
            self._txn.update(staged)
            if weight_version is not None:
                self._txn_version = weight_version
        if flush_cache and self._seqs:
            # Stock refuses a flush while requests are held, and fails the call for it.
            raise UpdateRefused("Weights were updated, but the cache was not flushed because "
                                "requests are still running or queued. Retract or finish them, "
                                "then call /flush_cache.")

    async def update_weights_from_tensor(self, named_tensors, weight_version=None,
                                         flush_cache=True) -> None:
        self._ensure_started()
        self._session_open("update_weights_from_tensor")
        await self._load(list(named_tensors), weight_version, flush_cache)

    async def init_weights_update_group(self, master_address, master_port, rank_offset,
                                        world_size, group_name, backend="gloo") -> None:
        """Join the trainer's update group. Everything is checked before any connection is
        tried; the rendezvous runs on a daemon thread and is given `update_group_timeout_s`.
        A join that misses it is abandoned (a peer that accepts but never answers can hold
        torch's TCPStore past its own timeout); should it complete later, its group is closed.
        """
        self._ensure_started()
        if group_name in self._groups or group_name in self._joining:
            raise BadRequest("group_name", f"update group {group_name!r} already exists"
                             + (" (its rendezvous is under way)" if group_name in self._joining
                                else ""))
        self._check_group_args(master_address, master_port, rank_offset, world_size, backend)
        timeout = self.update_group_timeout_s
        where = f"{master_address}:{master_port}"

        def rendezvous() -> EngineRanks:
            try:  # a name that does not resolve is the address's fault, not the port's
                socket.getaddrinfo(master_address, master_port, type=socket.SOCK_STREAM)
            except (OSError, UnicodeError) as e:
                raise BadRequest("master_address", f"cannot resolve {master_address!r}: "
                                 f"{e}") from None
            return EngineRanks.join(master_address, master_port, rank_offset, world_size,
                                    group_name, backend, self.tp_size, timeout)

        join = in_daemon_thread(rendezvous)
        self._join_threads.add(join)
        join.add_done_callback(self._join_threads.discard)
        self._joining.add(group_name)
        try:
            # The join's own steps give up at `timeout` with a more specific error; a second
            # more is the hard bound for the steps that can outlive it (see the docstring).
            waiter = asyncio.wrap_future(join)
            done, _ = await asyncio.wait([waiter], timeout=timeout + 1.0)
        finally:
            self._joining.discard(group_name)
        if not done:
            waiter.cancel()  # nobody reads its outcome now; the running join is not stopped
            join.add_done_callback(_close_late_join)
            raise BadRequest("master_port", f"no weight-update group {group_name!r} formed at "
                             f"{where} within {timeout:g} s (update_group_timeout_s)")
        try:
            self._groups[group_name] = waiter.result()
        except BadRequest:
            raise
        except Exception as e:  # noqa: BLE001 - the transport's failure, answered as stock does
            raise BadRequest("master_port", f"failed to join weight-update group "
                             f"{group_name!r} at {where}: {_first_line(e)}") from None

    def _check_group_args(self, master_address, master_port, rank_offset, world_size,
                          backend) -> None:
        if backend not in UPDATE_BACKENDS:
            raise BadRequest("backend", f"{backend!r}; the embedded engine joins with one of "
                             f"{list(UPDATE_BACKENDS)}")
        if backend == "nccl" and self.device.type != "cuda":
            raise BadRequest("backend", "nccl needs a CUDA engine; this one runs on "
                             f"{self.device.type}, use gloo")
        if not isinstance(master_address, str) or not master_address:
            raise BadRequest("master_address", f"must be a host name or address, got "
                             f"{short_repr(master_address)}")
        if not _is_int(master_port) or not 1 <= master_port <= 65535:
            raise BadRequest("master_port", f"must be a TCP port in [1, 65535], got "
                             f"{short_repr(master_port)}")
        if not _is_int(world_size) or not self.tp_size < world_size < 2**31:
            raise BadRequest("world_size", f"must be an integer in ({self.tp_size}, 2**31): "
                             f"the trainer and this engine's {self.tp_size} TP ranks at least, "
                             f"got {short_repr(world_size)}")
        if not (_is_int(rank_offset) and 0 < rank_offset
                and rank_offset + self.tp_size <= world_size):
            raise BadRequest("rank_offset", f"need 0 < rank_offset and rank_offset + tp_size "
                             f"({self.tp_size}) <= world_size ({world_size}), got "
                             f"{short_repr(rank_offset)} (rank 0 is the trainer)")

    async def destroy_weights_update_group(self, group_name: str) -> None:
        self._ensure_started()
        group = self._groups.pop(group_name, None)
        if group is None:
            raise BadRequest("group_name", f"no update group {group_name!r}")
        self._recv_bufs.pop(group_name, None)  # a receive left pending may still hold it
        # Tearing a process group down waits on its transport: not on the event loop.
        await asyncio.wrap_future(in_daemon_thread(group.close))

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name,
                                              weight_version=None, flush_cache=True,
                                              load_format=None) -> None:
        """Receive (one broadcast per tensor, or one for a flattened bucket), then load. As in
        stock SGLang, a call refused before its receive (no session, unknown group, a bad
        bucket layout) receives nothing: the sender must not broadcast for it."""
        self._ensure_started()
        self._session_open("update_weights_from_distributed")
        ranks = self._groups.get(group_name)
        if ranks is None:
            raise UpdateRefused(f"Group {group_name} not in {list(self._groups)}. Please call "
                                "`init_weights_update_group` first.")
        if load_format not in (None, LOAD_FORMAT):
            raise BadRequest("load_format", f"{load_format!r}: the distributed path knows "
                             f"null (one broadcast per tensor) and {LOAD_FORMAT!r}")
        if load_format == LOAD_FORMAT:
            layout = bucket_layout(list(names), list(dtypes), list(shapes))
            with _allocation("shapes", f"a {layout[-1][4]}-byte bucket"):
                flat = self._receive_buffer(group_name, layout[-1][4])
        else:
            if not (len(names) == len(dtypes) == len(shapes)):
                raise BadRequest("names", "names, dtypes and shapes differ in length")
            bufs = []
            for n, d, s in zip(names, dtypes, shapes):
                with _allocation("shapes", f"{n!r} of shape {short_repr(s)}"):
                    bufs.append(torch.empty(tuple(s), dtype=parse_dtype(d), device=self.device))
        # A worker thread, not the model thread: generation may go on during the transfer.
        t0 = time.perf_counter()
        try:
            got = await asyncio.wrap_future(in_daemon_thread(
                lambda: ranks.receive([flat] if load_format else bufs)))
        except Exception as e:  # noqa: BLE001 - the transport's failure, answered as stock does
            raise UpdateRefused(f"Failed to receive weights: {e}") from None
        named = unpack_bucket(flat, layout) if load_format else list(zip(names, got))
        t1 = time.perf_counter()
        self.update_calls += 1
        if self.fail_update_at is not None and self.update_calls == self.fail_update_at:
            raise UpdateRefused(f"Failed to update parameter online: injected fault at update "
                                f"call {self.update_calls} (--fail-update-at)")
        await self._load(named, weight_version, flush_cache)
        logger.debug("update call %d: %d tensors received in %.1f ms, loaded in %.1f ms",
                     self.update_calls, len(named), (t1 - t0) * 1e3,
                     (time.perf_counter() - t1) * 1e3)

    def _receive_buffer(self, group_name: str, nbytes: int) -> torch.Tensor:
        """One flattened-bucket buffer per group, kept between calls: a fresh allocation per
        bucket costs its page faults inside the receive (on CPU, ~150 ms for 200 MB against
        ~20 ms to refill a kept one). Calls of one group never overlap (the sender awaits each
        answer), and what is received is copied out before the call returns."""
        buf = self._recv_bufs.get(group_name)
        if buf is None or buf.numel() < nbytes:
            buf = self._recv_bufs[group_name] = torch.empty(nbytes, dtype=torch.uint8,
                                                            device=self.device)
        return buf[:nbytes]

    async def begin_weight_update(self) -> None:
        self._ensure_started()
        if self._txn is not None:
            raise UpdateRefused("a weight-update session is already open; call "
                                "end_weight_update() first")
        self._txn, self._txn_version = {}, None

    async def end_weight_update(self) -> None:
        """Close the session; staged weights go live together, at one safe point."""
        self._ensure_started()
        if self._txn is None:
            raise UpdateRefused("no weight-update session is open; call begin_weight_update() "
                                "first")
        staged, version = self._txn, self._txn_version
        self._txn = None
        if not staged and version is None:
            return
        async with self._lock:  # the safe point between two steps
            displaced = await self._on_model_thread(self.weights.swap, staged)
            old, self.weight_version = self.weight_version, version or self.weight_version
        self._spare = displaced  # the old live tensors stage the next version
        logger.info("weights updated: %d tensors, version %s -> %s", len(staged), old,
                    self.weight_version)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True
                                    ) -> None:
        self._ensure_started()
        if abort_all_requests:
            await self.abort(abort_all=True, message="aborted by update_weight_version")
        self.weight_version = str(new_version)

    async def check_weights(self, action: str = "checksum",
                            skip_tensor_list: list[str] | None = None) -> dict:
        """Stock SGLang's `/weights_checker` checksum over this engine's HF-named tensors: one
        entry per TP rank (each embedded "rank" holds the whole model)."""
        if action != "checksum":
            raise BadRequest("action", f"the embedded engine computes `checksum` only, not "
                             f"{action!r}")
        self._ensure_started()
        skip = set(skip_tensor_list or ())
        async with self._lock:  # not in the middle of a swap
            sums = await self._on_model_thread(lambda: {
                n: tensor_checksum(t) for n, t in self.weights.params.items() if n not in skip})
        per_gpu = overall_checksum(sums)
        ranks = [{"checksums": sums, "per_gpu_checksum": per_gpu, "parallelism_info": [
            {"role": "target", "tp_rank": r, "tp_size": self.tp_size, "dp_rank": 0,
             "dp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": r}]}
            for r in range(self.tp_size)]
        h = hashlib.sha256()
        for info in ranks:
            h.update(info["per_gpu_checksum"].encode())
        return {"ranks": ranks, "per_engine_checksum": h.hexdigest()}

    async def read_weights(self, fn):
        """`fn(get, version)` on the model thread with the live weights held still (no swap
        in between): `get(name)` is the HF-named tensor, `version` the weight version. The
        logp group's replicas copy a version into their Megatron model this way."""
        self._ensure_started()
        async with self._lock:
            return await self._on_model_thread(fn, self.weights.get, self.weight_version)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self.weights.get(name).detach()[:truncate_size].float().cpu().tolist()

    async def close(self) -> None:
        if self._alive():
            if self._seqs:
                await self.abort(abort_all=True, message="engine closed")
            self._task.cancel()
        self._closed = True
        self._executor.shutdown(wait=True)
        for group in self._groups.values():
            group.close()
        self._groups.clear()
        if self._join_threads:
            # A join that returns from torch's C++ while the interpreter shuts down aborts the
            # process ("terminate called without an active exception"): give those still
            # running a little time to end. One whose peer never answers may not; it is then
            # left, as it does no harm unless that peer goes away during the exit.
            _, left = await asyncio.to_thread(concurrent.futures.wait, list(self._join_threads),
                                              min(self.update_group_timeout_s, 10.0))
            if left:
                logger.warning("closing with %d update-group joins still waiting on their peer",
                               len(left))
