"""The embedded engine over HTTP, on SGLang's native paths and JSON shapes.

Owns the wire: request parsing and validation, response shapes, and the process entry point
`python -m megarl.rollout.server --model-path DIR [--port N]`, which accepts the server
arguments megarl's SGLang launcher passes, so one launcher starts either server. Bad input
(malformed JSON, unknown fields, bad sampling params, rejected weight updates) is answered
with HTTP 400 and `{"error": {"message", "field"}}`; the server stays up.

Paths: /health, /health_generate, /model_info (/get_model_info), /server_info
(/get_server_info), /generate, /pause_generation, /continue_generation, /abort_request,
/flush_cache, /init_weights_update_group, /destroy_weights_update_group,
/update_weights_from_distributed, /update_weights_from_tensor, /begin_weight_update,
/end_weight_update, /update_weight_version, /get_weights_by_name, /weights_checker (checksum).
With `--sglang-contract` it also behaves as stock SGLang does where the embedded engine would
otherwise do better: each weight-update call loads into the live weights at once, and
`sampling_seed` is honoured only with `--enable-deterministic-inference`.

`/update_weights_from_tensor` takes `serialized_named_tensors` as base64 `torch.save` data
(megarl.rollout.weights.serialize_named_tensors), loaded with `weights_only=True`. SGLang's
own format is a pickled CUDA IPC handle that only works within one host's GPU processes;
the client sends whichever format its server wants.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading

from aiohttp import web

from megarl.rollout.engine import EmbeddedEngine
from megarl.rollout.protocol import PAUSE_MODES, BadRequest, GenerateRequest, SamplingParams
from megarl.rollout.weights import deserialize_named_tensors

logger = logging.getLogger(__name__)

GENERATE_FIELDS = {"input_ids", "text", "sampling_params", "return_logprob", "rid", "stream",
                   "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"}


async def _body(request: web.Request, allowed: set[str] | None = None) -> dict:
    raw = await request.read()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest("body", f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("body", "expected a JSON object")
    if allowed is not None:
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise BadRequest(unknown[0], f"unknown field; expected some of {sorted(allowed)}")
    return body


def _per_item(value, count: int, name: str, default=None) -> list:
    """SGLang batch convention: a field is one value for all prompts or a list of them."""
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequest(name, f"{len(value)} values for {count} prompts")
        return value
    return [default if value is None else value] * count


class RolloutServer:
    """aiohttp application around one engine."""

    def __init__(self, engine: EmbeddedEngine, skip_tokenizer_init: bool = False,
                 record: list | None = None):
        self.engine = engine
        self.skip_tokenizer_init = skip_tokenizer_init or engine.tokenizer is None
        # record: (path, request JSON, status, response JSON) of every call, for the contract
        # tests that check what megarl sends against stock SGLang's own request types.
        self.record = record
        middlewares = [self._errors] if record is None else [self._record, self._errors]
        self.app = web.Application(client_max_size=1 << 34, middlewares=middlewares)
        r = self.app.router
        for path, fn in [("/health", self.health), ("/health_generate", self.health),
                         ("/model_info", self.model_info), ("/get_model_info", self.model_info),
                         ("/server_info", self.server_info),
                         ("/get_server_info", self.server_info),
                         ("/flush_cache", self.flush_cache)]:
            r.add_get(path, fn)
            r.add_post(path, fn)
        for path, fn in [("/generate", self.generate), ("/pause_generation", self.pause),
                         ("/continue_generation", self.resume), ("/abort_request", self.abort),
                         ("/init_weights_update_group", self.init_group),
                         ("/destroy_weights_update_group", self.destroy_group),
                         ("/update_weights_from_distributed", self.update_distributed),
                         ("/update_weights_from_tensor", self.update_tensor),
                         ("/begin_weight_update", self.begin_update),
                         ("/end_weight_update", self.end_update),
                         ("/update_weight_version", self.update_version)]:
            r.add_post(path, fn)
        for path, fn in [("/get_weights_by_name", self.get_weights),
                         ("/weights_checker", self.weights_checker)]:
            r.add_get(path, fn)
            r.add_post(path, fn)

    @web.middleware
    async def _record(self, request, handler):
        raw = await request.read()  # aiohttp keeps it for the handler
        resp = await handler(request)
        body = getattr(resp, "body", None)
        try:
            out = json.loads(body) if body else None
        except (TypeError, ValueError):
            out = None
        self.record.append((request.path, json.loads(raw) if raw else None, resp.status, out))
        return resp

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except BadRequest as e:
            logger.info("400 on %s: %s", request.path, e)
            return web.json_response({"success": False, "message": str(e),
                                      "error": {"message": str(e), "field": e.field}}, status=400)

    @staticmethod
    def _ok(message: str = "Success", **extra) -> web.Response:
        return web.json_response({"success": True, "message": message, **extra})

    async def health(self, request):
        return web.Response(status=200)

    async def model_info(self, request):
        e = self.engine
        return web.json_response({
            "model_path": e.model_path, "tokenizer_path": e.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": e.weight_version,
            "context_length": e.context_length, "vocab_size": e.vocab_size,
            "engine": "megarl-embedded"})

    async def server_info(self, request):
        return web.json_response({**self.engine.stats(), "engine": "megarl-embedded",
                                  "max_running_requests": self.engine.max_running_requests})

    # -- generation -------------------------------------------------------------------------
    def _requests(self, body: dict) -> tuple[list[GenerateRequest], bool]:
        if body.get("stream"):
            raise BadRequest("stream", "streaming is not supported by the embedded server")
        if body.get("logprob_start_len") not in (None, -1) or body.get("top_logprobs_num"):
            raise BadRequest("logprob_start_len", "input/top log-probs are not supported; "
                             "output_token_logprobs come with return_logprob")
        ids, text = body.get("input_ids"), body.get("text")
        if (ids is None) == (text is None):
            raise BadRequest("input_ids", "give exactly one of input_ids and text")
        if text is not None:
            if self.engine.tokenizer is None:
                raise BadRequest("text", "this server has no tokenizer; send input_ids")
            single = isinstance(text, str)
            texts = [text] if single else text
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise BadRequest("text", "must be a string or a list of strings")
            ids = [self.engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        else:
            if not isinstance(ids, list) or not ids:
                raise BadRequest("input_ids", "must be a non-empty list of token ids (or of lists)")
            single = not isinstance(ids[0], list)
            ids = [ids] if single else ids
        n = len(ids)
        sps = _per_item(body.get("sampling_params"), n, "sampling_params", {})
        lps = _per_item(body.get("return_logprob"), n, "return_logprob", False)
        rids = _per_item(body.get("rid"), n, "rid", None)
        reqs = []
        for i, (p, sp, lp, rid) in enumerate(zip(ids, sps, lps, rids)):
            if not isinstance(sp, dict):
                raise BadRequest("sampling_params", "must be an object (or a list of them)")
            r = GenerateRequest(p, SamplingParams.from_dict(sp), bool(lp))
            if rid is not None:
                r.rid = str(rid)
            reqs.extend(r.expand())
        return reqs, single and len(reqs) == 1

    async def generate(self, request):
        reqs, single = self._requests(await _body(request, GENERATE_FIELDS))
        for r in reqs:  # refuse the whole batch before any of it starts
            self.engine.check(r)
        if len({r.rid for r in reqs}) != len(reqs):
            raise BadRequest("rid", "duplicate rids in one batch")
        outs = await asyncio.gather(*[self.engine.generate(r) for r in reqs])
        payload = []
        for o in outs:
            d = o.to_sglang()
            if self.skip_tokenizer_init:
                d.pop("text", None)
            payload.append(d)
        return web.json_response(payload[0] if single else payload)

    async def pause(self, request):
        body = await _body(request, {"mode"})
        if body.get("mode", "abort") not in PAUSE_MODES:
            raise BadRequest("mode", f"{body['mode']!r}; expected one of {list(PAUSE_MODES)}")
        await self.engine.pause(body.get("mode", "abort"))
        return self._ok("Generation paused")

    async def resume(self, request):
        await _body(request, {"torch_empty_cache"})
        await self.engine.resume()
        return self._ok("Generation continued")

    async def abort(self, request):
        body = await _body(request, {"rid", "abort_all"})
        await self.engine.abort(str(body.get("rid") or ""),
                                abort_all=bool(body.get("abort_all", False)))
        return web.Response(status=200)

    async def flush_cache(self, request):
        if await self.engine.flush_cache():
            return web.Response(text="Cache flushed.\n")
        return web.Response(text="Cache not flushed: requests are in flight.\n", status=400)

    # -- weights ----------------------------------------------------------------------------
    # Field sets are stock SGLang's request structs (io_struct.py of the pinned release), so a
    # request the stock server would read in part is refused here as a whole.
    async def init_group(self, request):
        b = await _body(request, {"master_address", "master_port", "rank_offset", "world_size",
                                  "group_name", "backend"})
        for key in ("master_address", "master_port", "rank_offset", "world_size"):
            if key not in b:
                raise BadRequest(key, "missing")
        await self.engine.init_weights_update_group(
            b["master_address"], int(b["master_port"]), b["rank_offset"], b["world_size"],
            b.get("group_name", "weight_update_group"), b.get("backend", "nccl"))
        return self._ok("Succeeded to initialize custom process group.")

    async def destroy_group(self, request):
        b = await _body(request, {"group_name"})
        await self.engine.destroy_weights_update_group(b.get("group_name", "weight_update_group"))
        return self._ok()

    async def update_distributed(self, request):
        b = await _body(request, {"names", "dtypes", "shapes", "group_name", "flush_cache",
                                  "abort_all_requests", "weight_version", "load_format",
                                  "selector", "torch_empty_cache"})
        for key in ("names", "dtypes", "shapes"):
            if not isinstance(b.get(key), list):
                raise BadRequest(key, "missing or not a list")
        if b.get("abort_all_requests"):
            await self.engine.abort(abort_all=True, message="aborted for a weight update")
        await self.engine.update_weights_from_distributed(
            b["names"], b["dtypes"], b["shapes"], b.get("group_name", "weight_update_group"),
            _version(b), b.get("flush_cache", True), b.get("load_format"))
        return self._ok("Succeeded to update parameter online.")

    async def update_tensor(self, request):
        b = await _body(request, {"serialized_named_tensors", "load_format", "flush_cache",
                                  "weight_version", "abort_all_requests", "selector",
                                  "torch_empty_cache"})
        data = b.get("serialized_named_tensors")
        if isinstance(data, list):
            if len(data) != 1:  # one entry per TP rank; the embedded engine has one
                raise BadRequest("serialized_named_tensors", f"{len(data)} TP shards for 1 rank")
            data = data[0]
        if not isinstance(data, str):
            raise BadRequest("serialized_named_tensors", "missing or not a base64 string")
        if b.get("load_format") not in (None, "direct"):
            raise BadRequest("load_format", f"{b['load_format']!r} is not supported")
        named = await asyncio.to_thread(deserialize_named_tensors, data)
        if b.get("abort_all_requests"):
            await self.engine.abort(abort_all=True, message="aborted for a weight update")
        await self.engine.update_weights_from_tensor(named, _version(b), b.get("flush_cache", True))
        return self._ok("Succeeded to update model weights.")

    async def begin_update(self, request):
        await _body(request, {"selector"})
        await self.engine.begin_weight_update()
        return self._ok()

    async def end_update(self, request):
        await _body(request, set())  # stock's EndWeightUpdateReqInput has no fields
        await self.engine.end_weight_update()
        return self._ok()

    async def update_version(self, request):
        b = await _body(request, {"new_version", "abort_all_requests"})
        if not isinstance(b.get("new_version"), str):
            raise BadRequest("new_version", "missing or not a string")
        await self.engine.update_weight_version(b["new_version"],
                                                bool(b.get("abort_all_requests", True)))
        return web.json_response({"success": True, "new_version": b["new_version"],
                                  "message": f"Weight version updated to {b['new_version']}"})

    async def get_weights(self, request):
        b = await _body(request, {"name", "truncate_size"})
        if not isinstance(b.get("name"), str):
            raise BadRequest("name", "missing or not a string")
        return web.json_response(self.engine.get_weights_by_name(
            b["name"], int(b.get("truncate_size", 100))))

    async def weights_checker(self, request):
        b = await _body(request, {"action", "allow_quant_error", "skip_tensor_list", "selector"})
        out = await self.engine.check_weights(b.get("action", "checksum"),
                                              b.get("skip_tensor_list"))
        return self._ok("Success", **out)


def _version(body: dict) -> str | None:
    v = body.get("weight_version")
    return None if v is None else str(v)


class ServerThread:
    """Serve an engine on a background thread with its own event loop (tests, notebooks).

    The engine binds to that loop; use it only through HTTP while the thread runs.
    """

    def __init__(self, engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0,
                 record: list | None = None):
        self.engine, self.host, self.port, self.record = engine, host, port, record
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megarl-rollout-server",
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(RolloutServer(self.engine, record=self.record).app,
                               access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, self.host, self.port)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("rollout server did not start within 60 s")
        return self

    def __exit__(self, *exc) -> None:
        async def stop():
            await self.engine.close()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(60)


def build_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megarl.rollout.server",
                                 description="megarl's embedded rollout engine, SGLang HTTP API")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1", help="loopback by default")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--random-seed", type=int, default=0)
    ap.add_argument("--skip-tokenizer-init", action="store_true")
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--sglang-contract", action="store_true",
                    help="behave as stock SGLang: updates load live, seeds need "
                    "--enable-deterministic-inference")
    ap.add_argument("--enable-deterministic-inference", action="store_true",
                    help="with --sglang-contract: honour sampling_seed")
    ap.add_argument("--fail-update-at", type=int, default=None,
                    help="fault injection for tests: refuse the Nth weight-update call")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--tp-size", type=int, default=1,
                    help="update-group ranks to hold (one model runs; see EngineRanks)")
    # SGLang server arguments the launcher passes that mean nothing for one in-process model.
    ap.add_argument("--base-gpu-id", type=int, default=None,
                    help="with --device cuda, the GPU to use")
    ap.add_argument("--mem-fraction-static", type=float, default=None, help="ignored")
    ap.add_argument("--nccl-port", type=int, default=None, help="ignored")
    ap.add_argument("--trust-remote-code", action="store_true", help="ignored")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tp_size < 1:
        logger.error("--tp-size: must be >= 1, got %d", args.tp_size)
        return 2
    device = args.device
    if device == "cuda" and args.base_gpu_id is not None:
        device = f"cuda:{args.base_gpu_id}"
    engine = EmbeddedEngine(args.model_path, device=device, dtype=args.dtype,
                            load_format=args.load_format, context_length=args.context_length,
                            max_running_requests=args.max_running_requests,
                            seed=args.random_seed, load_tokenizer=not args.skip_tokenizer_init,
                            weight_version=args.weight_version, tp_size=args.tp_size,
                            live_updates=args.sglang_contract,
                            honour_seeds=(not args.sglang_contract
                                          or args.enable_deterministic_inference),
                            fail_update_at=args.fail_update_at)
    app = RolloutServer(engine, skip_tokenizer_init=args.skip_tokenizer_init).app

    async def close_engine(_app):
        await engine.close()

    app.on_cleanup.append(close_engine)
    logger.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
