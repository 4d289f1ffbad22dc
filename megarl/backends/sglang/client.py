"""An async HTTP client for SGLang's native server API: one method per endpoint.

Owns the wire calls only: payload shapes as SGLang 0.5.x expects them, and errors turned into
`SGLangError` (status, endpoint, message, and the offending field when the server names one).
It knows nothing of megarl's request types; megarl.backends.sglang.engine adapts it to the
rollout protocol. The same client drives megarl's embedded server (megarl.rollout.server),
which is how CI exercises it.

SGLang 0.5.21+ wants `begin_weight_update` / `end_weight_update` around distributed or tensor
updates; older servers answer 404 there, which `begin/end_weight_update(optional=True)` treat
as "not needed".
"""
from __future__ import annotations

import logging
from typing import Any

import aiohttp

from megarl.rollout import auth as rollout_auth

logger = logging.getLogger(__name__)

DEFAULT_GROUP = "weight_update_group"


class SGLangError(RuntimeError):
    def __init__(self, endpoint: str, status: int, message: str, field: str | None = None):
        super().__init__(f"{endpoint}: HTTP {status}: {message}")
        self.endpoint, self.status, self.message, self.field = endpoint, status, message, field


class SGLangClient:
    """`async with SGLangClient("http://127.0.0.1:30000") as c: await c.generate(...)`."""

    def __init__(self, base_url: str, timeout_s: float | None = None,
                 session: aiohttp.ClientSession | None = None, api_key: str | None = None):
        """`api_key`: sent as `Authorization: Bearer` on every call (stock SGLang's
        `--api-key`); None: the run's token (megarl.rollout.auth), if this process has one."""
        self.base_url = base_url.rstrip("/")
        self._headers = rollout_auth.headers(api_key) or None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._own_session = session is None

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
        self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection cap: one open request per in-flight sample is the point.
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0))
            self._own_session = True
        return self._session

    async def _call(self, method: str, endpoint: str, payload: dict | None = None,
                    *, want: str = "json") -> Any:
        async with self._sess().request(method, self.base_url + endpoint, json=payload,
                                        headers=self._headers) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise _error(endpoint, resp.status, body)
            if want == "json":
                return await resp.json(content_type=None) if body else None
            return body.decode(errors="replace")

    # -- status -----------------------------------------------------------------------------
    async def health(self) -> bool:
        """Liveness: the server process answers. Read from `/model_info`, not `/health`: stock
        SGLang's `/health` runs a one-token generation (0.5.23 `http_server.py`), which waits
        while generation is paused for a weight update, answers 503 after
        `SGLANG_HEALTH_CHECK_TIMEOUT` (20 s) and then marks the server unhealthy, so a long
        sync would get a healthy engine replaced. `/model_info` is answered by the HTTP
        process alone; a scheduler that dies takes the whole server down with it (sglang
        kills its process tree), which this still sees as a refused connection."""
        try:
            await self._call("GET", "/model_info")
            return True
        except (aiohttp.ClientError, SGLangError):
            return False

    async def health_generate(self) -> None:
        await self._call("GET", "/health_generate", want="text")

    async def model_info(self) -> dict:
        return await self._get_either("/model_info", "/get_model_info")

    async def server_info(self) -> dict:
        return await self._get_either("/server_info", "/get_server_info")

    async def _get_either(self, path: str, older: str) -> Any:
        """GET `path`, or `older` where the server predates it (SGLang renamed both)."""
        try:
            return await self._call("GET", path)
        except SGLangError as e:
            if e.status != 404:
                raise
            return await self._call("GET", older)

    # -- generation -------------------------------------------------------------------------
    async def generate(self, input_ids: list[int] | list[list[int]] | None = None,
                       sampling_params: dict | list[dict] | None = None,
                       return_logprob: bool = False, rid: str | list[str] | None = None,
                       text: str | list[str] | None = None, return_routed_experts: bool = False,
                       routed_experts_start_len: int = 0, **extra) -> dict | list[dict]:
        payload: dict[str, Any] = {"sampling_params": sampling_params or {},
                                   "return_logprob": return_logprob, **extra}
        if return_routed_experts:
            # Only when asked: a server that predates the fields never sees them otherwise.
            payload["return_routed_experts"] = True
            payload["routed_experts_start_len"] = routed_experts_start_len
        if input_ids is not None:
            payload["input_ids"] = input_ids
        if text is not None:
            payload["text"] = text
        if rid is not None:
            payload["rid"] = rid
        return await self._call("POST", "/generate", payload)

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all},
                         want="text")

    async def flush_cache(self) -> bool:
        try:
            await self._call("POST", "/flush_cache", want="text")
            return True
        except SGLangError as e:
            if e.status == 400:  # requests still in flight
                return False
            raise

    # -- weights ----------------------------------------------------------------------------
    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int,
                                        group_name: str = DEFAULT_GROUP,
                                        backend: str = "nccl") -> dict:
        """Blocks until every rank has joined: fire it before the trainer joins."""
        return await self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend})

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> dict:
        return await self._call("POST", "/destroy_weights_update_group",
                                {"group_name": group_name})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]],
                                              group_name: str = DEFAULT_GROUP,
                                              flush_cache: bool = True,
                                              weight_version: str | None = None,
                                              load_format: str | None = None) -> dict:
        """`load_format=None`: the server receives one broadcast per name, in order;
        `"flattened_bucket"`: one uint8 broadcast of all of them packed back to back. The
        call returns once the server has received and loaded them."""
        payload = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        return await self._call("POST", "/update_weights_from_distributed", payload)

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str],
                                         load_format: str | None = None,
                                         flush_cache: bool = True,
                                         weight_version: str | None = None) -> dict:
        """`serialized_named_tensors`: one entry per server TP rank, in the server's format."""
        payload = {"serialized_named_tensors": serialized_named_tensors,
                   "load_format": load_format, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._call("POST", "/update_weights_from_tensor", payload)

    async def begin_weight_update(self, optional: bool = False) -> None:
        await self._maybe_missing("/begin_weight_update", {}, optional)

    async def end_weight_update(self, optional: bool = False) -> None:
        """No fields: the version is set by an update call or `update_weight_version`."""
        await self._maybe_missing("/end_weight_update", {}, optional)

    async def update_weight_version(self, new_version: str,
                                    abort_all_requests: bool = False) -> dict:
        return await self._call("POST", "/update_weight_version",
                                {"new_version": new_version,
                                 "abort_all_requests": abort_all_requests})

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return await self._call("POST", "/get_weights_by_name",
                                {"name": name, "truncate_size": truncate_size})

    async def weights_checker(self, action: str = "checksum") -> dict:
        """`{"success", "message", "ranks": [{"checksums": {name: hex}, "per_gpu_checksum",
        "parallelism_info"}], "per_engine_checksum"}` for action `checksum`."""
        return await self._call("POST", "/weights_checker", {"action": action})

    async def _maybe_missing(self, endpoint: str, payload: dict, optional: bool) -> None:
        try:
            await self._call("POST", endpoint, payload)
        except SGLangError as e:
            if not (optional and e.status == 404):
                raise
            logger.debug("%s: not served (SGLang < 0.5.21); skipped", endpoint)


def _error(endpoint: str, status: int, body: bytes) -> SGLangError:
    import json

    message, field = body.decode(errors="replace").strip(), None
    try:
        d = json.loads(body)
        err = d.get("error") if isinstance(d, dict) else None
        if isinstance(err, dict):
            message, field = err.get("message", message), err.get("field")
        elif isinstance(d, dict) and "message" in d:
            message = d["message"]
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    return SGLangError(endpoint, status, message, field)
