"""`SGLangEngine`: the rollout protocol over an SGLang-API server (SGLang or embedded).

Owns the translation between megarl.rollout.protocol types and SGLang's JSON; the HTTP calls
themselves are megarl.backends.sglang.client's. One `generate` call is one HTTP request for
one sample, so finished samples come back one by one while the rest still generate.

Request ids: stock SGLang's `/abort_request` aborts every request whose rid STARTS WITH the
given one, so aborting `p-1` would also abort `p-10`. Every rid sent is therefore closed with
`RID_END` (which megarl's rids never contain) and the mark is taken off the answers: no rid
on the wire is then a prefix of another.

Tensor updates are serialized in the server's own format: base64 `torch.save` for megarl's
embedded server (it reports `"engine": "megarl-embedded"` in /model_info), SGLang's
`MultiprocessingSerializer` (CUDA IPC, same host only) for a real SGLang server.
"""
from __future__ import annotations

from megarl.backends.sglang.client import DEFAULT_GROUP, SGLangClient, SGLangError
from megarl.rollout.protocol import BadRequest, GenerateOutput, GenerateRequest, SamplingParams
from megarl.rollout.weights import serialize_named_tensors

# Always sent; the rest only when they differ from the (shared SGLang/megarl) defaults, so an
# older SGLang never sees a key it does not know unless the caller asked for it.
_ALWAYS = ("max_new_tokens", "temperature", "top_p", "top_k")
RID_END = "#"
_DEFAULTS = SamplingParams().to_dict()


def sampling_to_wire(sp: SamplingParams) -> dict:
    d = sp.to_dict()
    return {k: v for k, v in d.items()
            if k in _ALWAYS or (v != _DEFAULTS[k] and k not in ("skip_special_tokens",
                                                                 "no_stop_trim"))}


class SGLangEngine:
    """Implements megarl.rollout.protocol.RolloutEngine against one server URL."""

    def __init__(self, base_url: str, client: SGLangClient | None = None,
                 update_group: str = DEFAULT_GROUP):
        self.client = client or SGLangClient(base_url)
        self.base_url = base_url
        self.update_group = update_group
        self._embedded: bool | None = None

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
        d = await self._guard(self.client.generate(
            input_ids=request.input_ids, sampling_params=sampling_to_wire(request.sampling),
            return_logprob=request.return_logprob, rid=request.rid + RID_END))
        out = GenerateOutput.from_sglang(d)
        out.rid = request.rid
        return out

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self.client.abort_request(rid + RID_END if rid else "", abort_all=abort_all)

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
        if await self._is_embedded():
            data = [serialize_named_tensors(named)]
        else:
            from sglang.srt.utils import MultiprocessingSerializer  # GPU extra

            import base64
            data = [base64.b64encode(MultiprocessingSerializer.serialize(named)).decode()]
        await self._guard(self.client.update_weights_from_tensor(
            data, flush_cache=flush_cache, weight_version=weight_version))

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
