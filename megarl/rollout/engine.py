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

Weight updates are dual-buffered: tensors are received (from a broadcast group, on a worker
thread) and validated into a staging buffer while generation goes on; the swap into the live
parameters waits for the next safe point. Between `begin_weight_update` and
`end_weight_update` all updates stage into one buffer and swap together. As in SGLang, an
update without `weight_version` keeps the current version string. Bucketed updates
(`load_format="megarl_bucket"`) are received by megarl.weight_sync.consumer and swap in here
once every pipeline stage of their version has arrived; the swap takes the staged tensors by
reference where it can, and the displaced ones go back to the consumer as its next staging
buffer.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import random
from pathlib import Path

import torch

from megarl.rollout.batch import DecodeBatch, Sequence
from megarl.rollout.protocol import (PAUSE_MODES, BadRequest, GenerateOutput,
                                     GenerateRequest)
from megarl.rollout.weights import WeightStore, new_update_group

logger = logging.getLogger(__name__)


def load_model(model_path: str, device: str, dtype: str | None, load_format: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype) if dtype and dtype != "auto" else None
    if load_format == "dummy":
        # SGLang's dummy format: the architecture with random weights, for engines whose real
        # weights arrive from the trainer before the first rollout.
        cfg = AutoConfig.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype or torch.float32)
    elif load_format == "auto":
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype or "auto")
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
                 load_tokenizer: bool = True, weight_version: str = "default"):
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.model = load_model(self.model_path, device, dtype, load_format)
        cfg = self.model.config.get_text_config()
        self.vocab_size = cfg.vocab_size
        self.context_length = context_length or cfg.max_position_embeddings
        self.max_running_requests = max_running_requests
        self.tokenizer = None
        if load_tokenizer:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = cfg.eos_token_id if eos is None else eos
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.weight_version = weight_version
        self.weights = WeightStore(self.model)
        self.batch = DecodeBatch(self.model, self.device)
        self._rng = random.Random(seed)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-model")
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._seqs: dict[str, Sequence] = {}
        self._futures: dict[str, asyncio.Future] = {}
        self._paused = False
        self._txn: dict[str, torch.Tensor] | None = None  # staging between begin/end update
        self._groups: dict[str, object] = {}
        self._buckets = None  # megarl.weight_sync BucketConsumer, made on first use
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

    def _alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _on_model_thread(self, fn, *args):
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

    def _resolve(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self._seqs.pop(s.rid, None)
            fut = self._futures.pop(s.rid, None)
            self.generated_tokens += len(s.output_ids)
            if fut is not None and not fut.done():
                fut.set_result(s.output(self.weight_version))

    # -- generation -------------------------------------------------------------------------
    def check(self, request: GenerateRequest) -> None:
        """Raise BadRequest if this engine cannot take `request` now."""
        request.validate(self.vocab_size)
        if self.weights_broken:
            raise BadRequest("weights", f"engine unhealthy: {self.weights_broken}")
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
        gen.manual_seed(sp.sampling_seed if sp.sampling_seed is not None
                        else self._rng.getrandbits(63))
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
        """Abort one or all requests; returns once their (partial) outputs are handed back."""
        self._ensure_started()
        targets = list(self._seqs.values()) if abort_all else (
            [self._seqs[rid]] if rid in self._seqs else [])
        if not targets:
            return
        for s in targets:
            s.abort_message = message
        hit = {s.rid for s in targets}
        queued = [s for s in self._waiting if s.rid in hit]
        self._waiting = collections.deque(s for s in self._waiting if s.rid not in hit)
        self._resolve(queued)
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
        # No KV outlives its request here, so there is nothing to flush; like SGLang, refuse
        # while requests are in flight.
        return not self._seqs

    async def get_weight_version(self) -> str:
        return self.weight_version

    def stats(self) -> dict:
        return {"running": len(self.batch), "waiting": len(self._waiting),
                "paused": self._paused, "weight_version": self.weight_version,
                "generated_tokens": self.generated_tokens, "model_steps": self.model_steps,
                "weights_broken": self.weights_broken, **self.weight_memory()}

    # -- weight updates ---------------------------------------------------------------------
    async def _commit(self, staged: dict[str, torch.Tensor], weight_version: str | None
                      ) -> dict[str, torch.Tensor] | None:
        """Swap `staged` in at the next safe point (or add it to the open update); returns the
        tensors no longer live after the swap (None while an update is open)."""
        if self._txn is not None:
            self._txn.update(staged)
            if weight_version is not None:
                self._txn_version = weight_version
            return None
        async with self._lock:  # the safe point between two steps
            displaced = await self._on_model_thread(self.weights.swap, staged)
            old, self.weight_version = self.weight_version, weight_version or self.weight_version
        logger.info("weights updated: %d tensors, version %s -> %s", len(staged), old,
                    self.weight_version)
        return displaced

    async def update_weights_from_tensor(self, named_tensors, weight_version=None,
                                         flush_cache=True) -> None:
        self._ensure_started()
        staged = await asyncio.to_thread(self.weights.stage, list(named_tensors))
        await self._commit(staged, weight_version)

    async def init_weights_update_group(self, master_address, master_port, rank_offset,
                                        world_size, group_name, backend="gloo") -> None:
        self._ensure_started()
        if group_name in self._groups:
            raise BadRequest("group_name", f"update group {group_name!r} already exists")
        if backend == "nccl" and self.device.type != "cuda":
            raise BadRequest("backend", "nccl needs a CUDA engine; this one runs on "
                             f"{self.device.type}, use gloo")
        if not (isinstance(world_size, int) and isinstance(rank_offset, int)
                and 0 < rank_offset < world_size):
            raise BadRequest("rank_offset", f"need 0 < rank_offset < world_size, got "
                             f"{rank_offset!r} of {world_size!r} (rank 0 is the trainer)")
        # One engine process = one rank (no TP inside the embedded engine).
        self._groups[group_name] = await asyncio.to_thread(
            new_update_group, master_address, master_port, rank_offset, world_size, group_name,
            backend)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        self._ensure_started()
        group = self._groups.pop(group_name, None)
        if group is None:
            raise BadRequest("group_name", f"no update group {group_name!r}")
        await asyncio.to_thread(group.close)

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name,
                                              weight_version=None, flush_cache=True,
                                              load_format=None, bucket=None):
        self._ensure_started()
        pg = self._groups.get(group_name)
        if pg is None:
            raise BadRequest("group_name", f"no update group {group_name!r}; call "
                             "init_weights_update_group first")
        if load_format == "megarl_bucket":
            return await self._update_from_bucket(pg, bucket)
        if load_format not in (None, "direct"):
            raise BadRequest("load_format", f"{load_format!r} is not supported")
        if not all(isinstance(s, (list, tuple)) and all(isinstance(d, int) and d >= 0 for d in s)
                   for s in shapes):
            raise BadRequest("shapes", "must be a list of lists of non-negative integers")
        # A worker thread, not the model thread: generation continues during the transfer.
        staged = await asyncio.to_thread(self.weights.receive, pg, list(names), list(dtypes),
                                         list(shapes), self.device)
        await self._commit(staged, weight_version)

    async def _update_from_bucket(self, pg, bucket) -> dict:
        from megarl.weight_sync.consumer import BucketConsumer
        from megarl.weight_sync.protocol import BucketMeta

        try:
            meta = BucketMeta.from_json(bucket)
        except Exception as e:  # noqa: BLE001 - any malformed metadata is the client's
            raise BadRequest("bucket", f"malformed bucket metadata: {e}") from None
        if self._buckets is None:
            self._buckets = BucketConsumer(self.weights)
        # Off the model thread: generation goes on while the bytes arrive (staged mode).
        result = await asyncio.to_thread(self._buckets.receive, pg, meta, self.device,
                                         self._paused)
        if result["complete"]:
            staged, direct = self._buckets.take(meta.version)
            if direct:  # already written into the (paused) live weights
                self.weight_version = meta.version
                logger.info("weights updated in place: version %s", meta.version)
            else:
                displaced = await self._commit(staged, meta.version)
                if displaced:  # the old live tensors become the next staging buffer
                    self._buckets.recycle(displaced)
        return {**result, "weight_version": self.weight_version}

    @property
    def weights_broken(self) -> str | None:
        """Why this engine must not serve (a direct update failed half-way), or None."""
        return self._buckets.broken if self._buckets is not None else None

    def weight_memory(self) -> dict:
        """Bytes held for bucketed updates: the staging buffer and the largest receive piece."""
        b = self._buckets
        return {"staging_bytes": b.staging_bytes if b else 0,
                "peak_piece_bytes": b.peak_piece_bytes if b else 0}

    async def weights_digest(self, names: list[str] | None = None) -> dict[str, str]:
        """Checksum of each live tensor's bytes (verify mode: compare with the trainer's)."""
        from megarl.weight_sync.protocol import byte_view, digest

        self._ensure_started()
        names = list(self.weights.params) if names is None else names
        unknown = [n for n in names if n not in self.weights.params]
        if unknown:
            raise BadRequest("names", f"unknown parameter {unknown[0]!r}")
        async with self._lock:  # not in the middle of a swap
            return await self._on_model_thread(lambda: {
                n: digest(byte_view(self.weights.params[n].detach().contiguous()))
                for n in names})

    async def begin_weight_update(self) -> None:
        self._ensure_started()
        if self._txn is not None:
            raise BadRequest("begin_weight_update", "a weight update is already open")
        self._txn, self._txn_version = {}, None

    async def end_weight_update(self, weight_version: str | None = None) -> None:
        self._ensure_started()
        if self._txn is None:
            raise BadRequest("end_weight_update", "no weight update is open")
        staged, version = self._txn, weight_version or self._txn_version
        self._txn = None
        await self._commit(staged, version)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self.weights.get(name).detach()[:truncate_size].float().cpu().tolist()

    async def close(self) -> None:
        if self._alive():
            if self._seqs:
                await self.abort(abort_all=True, message="engine closed")
            self._task.cancel()
        self._executor.shutdown(wait=True)
        for group in self._groups.values():
            group.close()
        self._groups.clear()
