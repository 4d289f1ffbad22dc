"""`SGLangEngine`: the rollout protocol over an SGLang-API server (SGLang or embedded).

Owns the translation between megarl.rollout.protocol types and SGLang's JSON; the HTTP calls
themselves are megarl.backends.sglang.client's. One `generate` call is one HTTP request for
one sample, so finished samples come back one by one while the rest still generate.

Request ids: stock SGLang's `/abort_request` aborts every request whose rid STARTS WITH the
given one, so aborting `p-1` would also abort `p-10`. Every rid sent is therefore closed with
`RID_END` (which megarl's rids never contain) and the mark is taken off the answers: no rid
on the wire is then a prefix of another.

Tensor updates (`/update_weights_from_tensor`) go to megarl's embedded server only (it
reports `"engine": "megarl-embedded"` in /model_info), base64 `torch.save` data, inside the
caller's begin/end session. Stock SGLang reads one entry per TP rank in its own
`MultiprocessingSerializer` format (CUDA IPC handles, same host), which megarl does not
produce: megarl updates stock servers through `/update_weights_from_distributed`, and a
tensor update aimed at one is refused here, before anything is sent.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

from megarl.backends.sglang.client import DEFAULT_GROUP, SGLangClient, SGLangError
from megarl.rollout.protocol import (BadRequest, FinishReason, GenerateOutput, GenerateRequest,
                                     SamplingParams)
from megarl.rollout.weights import serialize_named_tensors

# Always sent; the rest only when they differ from the (shared SGLang/megarl) defaults, so an
# older SGLang never sees a key it does not know unless the caller asked for it.
_ALWAYS = ("max_new_tokens", "temperature", "top_p", "top_k")
RID_END = "#"
ABANDONED = "aborted; no answer from the server after the abort (see SGLangEngine._abandon)"
logger = logging.getLogger(__name__)
_DEFAULTS = SamplingParams().to_dict()


def sampling_to_wire(sp: SamplingParams) -> dict:
    d = sp.to_dict()
    return {k: v for k, v in d.items()
            if k in _ALWAYS or (v != _DEFAULTS[k] and k not in ("skip_special_tokens",
                                                                 "no_stop_trim"))}


class SGLangEngine:
    """Implements megarl.rollout.protocol.RolloutEngine against one server URL."""

    def __init__(self, base_url: str, client: SGLangClient | None = None,
                 update_group: str = DEFAULT_GROUP, abort_grace_s: float = 5.0):
        self.client = client or SGLangClient(base_url)
        self.abort_grace_s = abort_grace_s
        self.base_url = base_url
        self.update_group = update_group
        self._embedded: bool | None = None
        self._seeds: bool | None = None  # the server honours sampling_seed
        self._inflight: dict[str, asyncio.Future] = {}  # rid -> its /generate call
        self._abandoned: set[str] = set()

    async def honours_seeds(self) -> bool:
        """Stock SGLang validates `sampling_seed` and then ignores it unless the server runs
        with `--enable-deterministic-inference` (0.5.23): read once from `/server_info`."""
        if self._seeds is None:
            info = await self.client.server_info()
            self._seeds = bool(info.get("enable_deterministic_inference", False))
            if not self._seeds:
                logger.warning("%s ignores sampling seeds (started without "
                               "--enable-deterministic-inference): megarl sends none, and its "
                               "samples are not reproducible from trainer.seed; add the flag "
                               "to rollout.server_extra_args to have them honoured",
                               self.base_url)
        return self._seeds

    async def _guard(self, coro):
        try:
            return await coro
        except SGLangError as e:
            if e.status == 400:
                raise BadRequest(e.field or e.endpoint, e.message) from None
            raise

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        if request.sampling.n != 1:
            raise BadRequest("sampling_params.n", "one sample per engine request; use expand()")
        if RID_END in request.rid:
            raise BadRequest("rid", f"{request.rid!r}: megarl rids may not contain {RID_END!r}")
        sampling = request.sampling
        if sampling.sampling_seed is not None and not await self.honours_seeds():
            # a field the server would drop silently is not sent (the warning says so once)
            sampling = dataclasses.replace(sampling, sampling_seed=None)
        call = asyncio.ensure_future(self._guard(self.client.generate(
            input_ids=request.input_ids, sampling_params=sampling_to_wire(sampling),
            return_logprob=request.return_logprob, rid=request.rid + RID_END,
            return_routed_experts=request.return_routed_experts,
            routed_experts_start_len=request.routed_experts_start_len)))
        self._inflight[request.rid] = call
        try:
            d = await asyncio.shield(call)
        except asyncio.CancelledError:
            if request.rid not in self._abandoned:
                call.cancel()
                raise
            # see `abort`: answered as aborted before any token; the caller resumes it whole
            return GenerateOutput(request.rid, len(request.input_ids), [],
                                  [] if request.return_logprob else None,
                                  FinishReason("abort", message=ABANDONED),
                                  await self.get_weight_version())
        finally:
            self._inflight.pop(request.rid, None)
            self._abandoned.discard(request.rid)
        out = GenerateOutput.from_sglang(d)
        out.rid = request.rid
        return out

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self.client.abort_request(rid + RID_END if rid else "", abort_all=abort_all)
        call = self._inflight.get(rid) if rid and not abort_all else None
        if call is not None:
            asyncio.get_running_loop().call_later(self.abort_grace_s, self._abandon, rid, call)

    def _abandon(self, rid: str, call: asyncio.Future) -> None:
        """Stock SGLang (0.5.23) loses an abort for a request it holds in its tokenizer while
        generation is paused (the scheduler has not seen the rid yet; tokenizer_manager.py
        marks the abort as sent and ignores any later one for that rid), and the request then
        runs to max_new_tokens after the pause. An aborted request still unanswered
        `abort_grace_s` after its abort is therefore answered here as aborted with no tokens
        (it held none it had not been given back), so no step waits for it; the server may
        still spend its budget on it."""
        if not call.done() and self._inflight.get(rid) is call:
            logger.info("%s: %s not answered %.1f s after its abort (held during a pause?); "
                        "taken as aborted", self.base_url, rid, self.abort_grace_s)
            self._abandoned.add(rid)
            call.cancel()

    async def pause(self, mode: str = "abort") -> None:
        await self._guard(self.client.pause_generation(mode))

    async def resume(self) -> None:
        await self.client.continue_generation()

    async def flush_cache(self) -> bool:
        return await self.client.flush_cache()

    async def health(self) -> bool:
        return await self.client.health()

    async def get_weight_version(self) -> str:
        return str((await self.client.model_info()).get("weight_version", "default"))

    async def init_weights_update_group(self, master_address, master_port, rank_offset,
                                        world_size, group_name=None, backend="nccl") -> None:
        await self._guard(self.client.init_weights_update_group(
            master_address, master_port, rank_offset, world_size,
            group_name or self.update_group, backend))

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name=None,
                                              weight_version=None, flush_cache=True,
                                              load_format=None) -> None:
        await self._guard(self.client.update_weights_from_distributed(
            names, dtypes, shapes, group_name or self.update_group, flush_cache, weight_version,
            load_format))

    async def update_weights_from_tensor(self, named_tensors, weight_version=None,
                                         flush_cache=True) -> None:
        named = list(named_tensors)
        if not await self._is_embedded():
            raise NotImplementedError(
                f"{self.base_url}: update_weights_from_tensor is not supported on stock SGLang "
                "servers (it needs one CUDA-IPC entry per TP rank); megarl updates them with "
                "update_weights_from_distributed")
        # inside the caller's begin/end session, as every update
        await self._guard(self.client.update_weights_from_tensor(
            [serialize_named_tensors(named)], flush_cache=flush_cache,
            weight_version=weight_version))

    async def begin_weight_update(self) -> None:
        await self._guard(self.client.begin_weight_update(optional=True))

    async def end_weight_update(self) -> None:
        await self._guard(self.client.end_weight_update(optional=True))

    async def _is_embedded(self) -> bool:
        if self._embedded is None:
            info = await self.client.model_info()
            self._embedded = info.get("engine") == "megarl-embedded"
        return self._embedded

    async def close(self) -> None:
        await self.client.close()
