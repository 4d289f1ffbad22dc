"""The embedded engine over HTTP, on SGLang's native paths and JSON shapes.

Owns the wire: request parsing and validation, response shapes, and the process entry point
`python -m megarl.rollout.server --model-path DIR [--port N]`, which accepts the server
arguments megarl's SGLang launcher passes, so one launcher starts either server. Bad input
(malformed or over-deep JSON, numbers past 64 bits, unknown fields, wrong types, bad sampling
params, ports or backends, rejected weight updates) is answered with HTTP 400, a body over
its endpoint's size limit with 413, each as `{"error": {"message", "field"}}`; the server
stays up. Update-group calls (join, receive, teardown) run on daemon threads, never on the
event loop, and a join is given the engine's `update_group_timeout_s`.

Paths: /health, /health_generate, /model_info (/get_model_info), /server_info
(/get_server_info), /generate, /pause_generation, /continue_generation, /abort_request,
/flush_cache, /init_weights_update_group, /destroy_weights_update_group,
/update_weights_from_distributed, /update_weights_from_tensor, /begin_weight_update,
/end_weight_update, /update_weight_version, /get_weights_by_name, /weights_checker (checksum).
With `--sglang-contract` it also behaves as stock SGLang does where the embedded engine would
otherwise do better: each weight-update call loads into the live weights at once, and
`sampling_seed` is honoured only with `--enable-deterministic-inference`.
`--enable-return-routed-experts` adds `meta_info.routed_experts` for the requests that ask
(a MoE model; as stock, without the flag the ask is ignored and a dense model will not start).

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

from megarl.rollout import auth as rollout_auth
from megarl.rollout.engine import EmbeddedEngine
from megarl.rollout.protocol import (I64_MAX, PAUSE_MODES, BadRequest, GenerateRequest,
                                     SamplingParams, short_repr)
from megarl.rollout.weights import deserialize_named_tensors
from megarl.rollout.wire import Fields, describe, parse_object, read_body

logger = logging.getLogger(__name__)

GENERATE_FIELDS = {"input_ids", "text", "sampling_params", "return_logprob", "rid", "stream",
                   "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
                   "return_routed_experts", "routed_experts_start_len"}
DEFAULT_GROUP = "weight_update_group"
SELECTORS = ("target", "draft", "all")  # stock's `selector`; one model here, so all alike
RAW_BODY = web.RequestKey("raw_body", bytes)  # what _fields read, for the recording middleware


def _per_item(value, count: int, name: str, default=None) -> list:
    """SGLang batch convention: a field is one value for all prompts or a list of them."""
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequest(name, f"{len(value)} values for {count} prompts")
        return value
    return [default if value is None else value] * count


def _shapes(value) -> list[list[int]]:
    """`shapes`: one list of non-negative 64-bit dimensions per tensor."""
    if value is None:
        raise BadRequest("shapes", "missing")
    if not isinstance(value, list) or not all(
            isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                        and 0 <= d <= I64_MAX for d in s) for s in value):
        raise BadRequest("shapes", f"must be a list of shapes (lists of integers >= 0), got "
                         f"{describe(value)}")
    return value


# The most rows of a tensor /get_weights_by_name returns (megarl asks for 100 at most).
MAX_TRUNCATE_ROWS = 4096


class RolloutServer:
    """aiohttp application around one engine.

    Every body is read within a size limit (`max_body_bytes`; `max_weights_body_bytes` for
    `/update_weights_from_tensor`, which carries whole tensors) and parsed within the
    structure limits of megarl.rollout.wire before a handler reads a field of it.
    """

    def __init__(self, engine: EmbeddedEngine, skip_tokenizer_init: bool = False,
                 record: list | None = None, max_body_bytes: int = 256 << 20,
                 max_weights_body_bytes: int = 1 << 34, max_samples_per_call: int = 16384,
                 api_key: str | None = None):
        """`api_key`: the token every request but /health must bring (`Authorization:
        Bearer`), as stock SGLang with `--api-key`; None: the run's (megarl.rollout.auth), or
        none where this process has none."""
        self.engine = engine
        self.api_key = api_key if api_key is not None else rollout_auth.api_key()
        self.skip_tokenizer_init = skip_tokenizer_init or engine.tokenizer is None
        self.max_body_bytes, self.max_weights_body_bytes = max_body_bytes, max_weights_body_bytes
        self.max_samples_per_call = max_samples_per_call  # n × prompts of one /generate
        # record: (path, request JSON, status, response JSON) of every call, for the contract
        # tests that check what megarl sends against stock SGLang's own request types.
        self.record = record
        middlewares = [self._errors] if record is None else [self._record, self._errors]
        middlewares.insert(0, self._auth)
        # Bodies are read by read_body under the limits above; aiohttp's own cap stays out of
        # the way.
        self.app = web.Application(client_max_size=max(max_body_bytes, max_weights_body_bytes),
                                   middlewares=middlewares)
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

    async def _fields(self, request: web.Request, allowed: set[str],
                      limit: int | None = None) -> Fields:
        """The body as a JSON object (empty: `{}`), with only `allowed` keys."""
        raw = await read_body(request, self.max_body_bytes if limit is None else limit)
        request[RAW_BODY] = raw
        body = parse_object(raw)
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise BadRequest(short_repr(unknown[0], 64, quote=False),
                             f"unknown field; expected some of {sorted(allowed)}")
        return Fields(body)

    @web.middleware
    async def _record(self, request, handler):
        resp = await handler(request)
        try:
            raw = request.get(RAW_BODY)
            sent = json.loads(raw) if raw else None
        except ValueError:
            sent = None
        body = getattr(resp, "body", None)
        try:
            out = json.loads(body) if body else None
        except (TypeError, ValueError):
            out = None
        self.record.append((request.path, sent, resp.status, out))
        return resp

    @web.middleware
    async def _auth(self, request, handler):
        # before a byte of the body is read: a caller without the token gets nothing done
        if not rollout_auth.authorized(request.path, request.headers.get("Authorization"),
                                       self.api_key):
            logger.warning("401 on %s from %s: no valid token", request.path, request.remote)
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except BadRequest as e:
            logger.info("%d on %s: %s", e.status, request.path, e)
            return web.json_response({"success": False, "message": str(e),
                                      "error": {"message": str(e), "field": e.field}},
                                     status=e.status)

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
        # tp_size, dtype and enable_deterministic_inference under stock's names: clients
        # read them from stock servers to check TP, what a weight update is cast to (verify
        # mode skips what cannot compare) and whether sampling seeds are honoured.
        dtype = str(next(self.engine.model.parameters()).dtype).removeprefix("torch.")
        return web.json_response({**self.engine.stats(), "engine": "megarl-embedded",
                                  "dtype": dtype,
                                  "max_running_requests": self.engine.max_running_requests,
                                  "tp_size": self.engine.tp_size,
                                  "enable_deterministic_inference": self.engine.honour_seeds})

    # -- generation -------------------------------------------------------------------------
    def _requests(self, f: Fields) -> tuple[list[GenerateRequest], bool]:
        if f.get_bool("stream", False):
            raise BadRequest("stream", "streaming is not supported by the embedded server")
        if f.get_int("logprob_start_len", -1) != -1:
            raise BadRequest("logprob_start_len", "input log-probs are not supported; "
                             "output_token_logprobs come with return_logprob")
        if f.get_int("top_logprobs_num", 0) != 0:
            raise BadRequest("top_logprobs_num", "top log-probs are not supported; "
                             "output_token_logprobs come with return_logprob")
        f.get_bool("return_text_in_logprobs")
        # One value for every prompt of a batch, as in stock (a list is refused there too);
        # the start's range is the engine's check (GenerateRequest.validate).
        routed = f.get_bool("return_routed_experts", False)
        routed_start = f.get_int("routed_experts_start_len", 0)
        body = f.body
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
        if not all(isinstance(sp, dict) for sp in sps):
            raise BadRequest("sampling_params", "must be an object (or a list of them)")
        if not all(isinstance(lp, bool) for lp in lps):
            raise BadRequest("return_logprob", "must be true or false (or a list of them)")
        if not all(rid is None or isinstance(rid, str) for rid in rids):
            raise BadRequest("rid", "must be a string (or a list of them)")
        params = [SamplingParams.from_dict(sp) for sp in sps]
        if sum(p.n for p in params) > self.max_samples_per_call:
            raise BadRequest("sampling_params.n", f"{sum(p.n for p in params)} samples in one "
                             f"call; this server takes at most {self.max_samples_per_call}")
        reqs = []
        for p, sp, lp, rid in zip(ids, params, lps, rids):
            r = GenerateRequest(p, sp, lp, return_routed_experts=routed,
                                routed_experts_start_len=routed_start)
            if rid is not None:
                r.rid = rid
            reqs.extend(r.expand())
        return reqs, single and len(reqs) == 1

    async def generate(self, request):
        reqs, single = self._requests(await self._fields(request, GENERATE_FIELDS))
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
        f = await self._fields(request, {"mode"})
        await self.engine.pause(f.get_str("mode", "abort", choices=PAUSE_MODES))
        return self._ok("Generation paused")

    async def resume(self, request):
        (await self._fields(request, {"torch_empty_cache"})).get_bool("torch_empty_cache")
        await self.engine.resume()
        return self._ok("Generation continued")

    async def abort(self, request):
        f = await self._fields(request, {"rid", "abort_all"})
        await self.engine.abort(f.get_str("rid", ""), abort_all=f.get_bool("abort_all", False))
        return web.Response(status=200)

    async def flush_cache(self, request):
        if await self.engine.flush_cache():
            return web.Response(text="Cache flushed.\n")
        return web.Response(text="Cache not flushed: requests are in flight.\n", status=400)

    # -- weights ----------------------------------------------------------------------------
    # Field sets and types are stock SGLang's request structs (io_struct.py of the pinned
    # release), so a request the stock server would read in part is refused here as a whole.
    # Values the engine alone can judge (ports, backends, rank layout) it checks itself,
    # before any connection.
    async def init_group(self, request):
        f = await self._fields(request, {"master_address", "master_port", "rank_offset",
                                         "world_size", "group_name", "backend"})
        await self.engine.init_weights_update_group(
            f.get_str("master_address", required=True),
            f.get_int("master_port", required=True), f.get_int("rank_offset", required=True),
            f.get_int("world_size", required=True), f.get_str("group_name", DEFAULT_GROUP),
            f.get_str("backend", "nccl"))
        return self._ok("Succeeded to initialize custom process group.")

    async def destroy_group(self, request):
        f = await self._fields(request, {"group_name"})
        await self.engine.destroy_weights_update_group(f.get_str("group_name", DEFAULT_GROUP))
        return self._ok()

    async def update_distributed(self, request):
        f = await self._fields(request, {"names", "dtypes", "shapes", "group_name",
                                         "flush_cache", "abort_all_requests", "weight_version",
                                         "load_format", "selector", "torch_empty_cache"})
        names = f.get_str_list("names", required=True)
        dtypes = f.get_str_list("dtypes", required=True)
        shapes = _shapes(f.body.get("shapes"))
        group = f.get_str("group_name", DEFAULT_GROUP)
        flush, version = f.get_bool("flush_cache", True), f.get_str("weight_version")
        load_format = f.get_str("load_format")
        f.get_str("selector", choices=SELECTORS)  # checked, not used: one model here
        f.get_bool("torch_empty_cache")
        if f.get_bool("abort_all_requests", False):
            await self.engine.abort(abort_all=True, message="aborted for a weight update")
        await self.engine.update_weights_from_distributed(names, dtypes, shapes, group, version,
                                                          flush, load_format)
        return self._ok("Succeeded to update parameter online.")

    async def update_tensor(self, request):
        f = await self._fields(request, {"serialized_named_tensors", "load_format",
                                         "flush_cache", "weight_version", "abort_all_requests",
                                         "selector", "torch_empty_cache"},
                               limit=self.max_weights_body_bytes)
        data = f.body.get("serialized_named_tensors")
        if isinstance(data, list):
            if len(data) != 1:  # one entry per TP rank; the embedded engine has one
                raise BadRequest("serialized_named_tensors", f"{len(data)} TP shards for 1 rank")
            data = data[0]
        if not isinstance(data, str):
            raise BadRequest("serialized_named_tensors", "missing or not a base64 string")
        if f.get_str("load_format") not in (None, "direct"):
            raise BadRequest("load_format", f"{short_repr(f.body['load_format'])} is not "
                             "supported")
        flush, version = f.get_bool("flush_cache", True), f.get_str("weight_version")
        abort_all = f.get_bool("abort_all_requests", False)
        f.get_str("selector", choices=SELECTORS)  # checked, not used: one model here
        f.get_bool("torch_empty_cache")
        named = await asyncio.to_thread(deserialize_named_tensors, data)
        if abort_all:
            await self.engine.abort(abort_all=True, message="aborted for a weight update")
        await self.engine.update_weights_from_tensor(named, version, flush)
        return self._ok("Succeeded to update model weights.")

    async def begin_update(self, request):
        (await self._fields(request, {"selector"})).get_str("selector", choices=SELECTORS)
        await self.engine.begin_weight_update()
        return self._ok()

    async def end_update(self, request):
        await self._fields(request, set())  # stock's EndWeightUpdateReqInput has no fields
        await self.engine.end_weight_update()
        return self._ok()

    async def update_version(self, request):
        f = await self._fields(request, {"new_version", "abort_all_requests"})
        version = f.get_str("new_version", required=True)
        await self.engine.update_weight_version(version,
                                                f.get_bool("abort_all_requests", True))
        return web.json_response({"success": True, "new_version": version,
                                  "message": f"Weight version updated to {version}"})

    async def get_weights(self, request):
        f = await self._fields(request, {"name", "truncate_size"})
        name = f.get_str("name", required=True)
        # bounded: a reply is built in memory as JSON, and a whole large tensor (an embedding
        # of 150k rows) would take gigabytes; stock SGLang reads the same field unbounded
        return web.json_response(self.engine.get_weights_by_name(
            name, f.get_int("truncate_size", 100, lo=0, hi=MAX_TRUNCATE_ROWS)))

    async def weights_checker(self, request):
        f = await self._fields(request, {"action", "allow_quant_error", "skip_tensor_list",
                                         "selector"})
        action, skip = f.get_str("action", "checksum"), f.get_str_list("skip_tensor_list")
        f.get_bool("allow_quant_error")  # checked, not used: no quantized weights here
        f.get_str("selector", choices=SELECTORS)
        out = await self.engine.check_weights(action, skip)
        return self._ok("Success", **out)


class ServerThread:
    """Serve an engine on a background thread with its own event loop (tests, notebooks).

    The engine binds to that loop; use it only through HTTP while the thread runs.
    """

    def __init__(self, engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0,
                 record: list | None = None, **server_options):
        """`server_options`: RolloutServer's limits (max_body_bytes, ...)."""
        self.engine, self.host, self.port, self.record = engine, host, port, record
        self.server_options = server_options
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megarl-rollout-server",
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(RolloutServer(self.engine, record=self.record,
                                             **self.server_options).app,
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
    ap.add_argument("--enable-return-routed-experts", action="store_true",
                    help="report the experts each token was routed to, to requests with "
                    "return_routed_experts (a mixture-of-experts model)")
    ap.add_argument("--fail-update-at", type=int, default=None,
                    help="fault injection for tests: refuse the Nth weight-update call")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--api-key", default=None,
                    help="the token every request but /health must bring (Authorization: "
                    "Bearer), as stock SGLang's; default: $MEGARL_ROLLOUT_API_KEY, which keeps "
                    "it off the command line (readable by every user of the node)")
    ap.add_argument("--update-group-timeout", type=float, default=300.0,
                    help="seconds a weight-update group's rendezvous, and each of its "
                    "operations, may take")
    ap.add_argument("--tp-size", type=int, default=1,
                    help="update-group ranks to hold (one model runs; see EngineRanks)")
    # SGLang server arguments the launcher passes that mean nothing for one in-process model.
    ap.add_argument("--base-gpu-id", type=int, default=None,
                    help="with --device cuda, the GPU to use")
    ap.add_argument("--mem-fraction-static", type=float, default=None, help="ignored")
    ap.add_argument("--nccl-port", type=int, default=None, help="ignored")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="let transformers run the model's and tokenizer's own code")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tp_size < 1:
        logger.error("--tp-size: must be >= 1, got %d", args.tp_size)
        return 2
    if not 0 < args.update_group_timeout < float("inf"):
        logger.error("--update-group-timeout: must be a number of seconds > 0, got %s",
                     args.update_group_timeout)
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
                            fail_update_at=args.fail_update_at,
                            update_group_timeout_s=args.update_group_timeout,
                            enable_return_routed_experts=args.enable_return_routed_experts,
                            trust_remote_code=args.trust_remote_code)
    app = RolloutServer(engine, skip_tokenizer_init=args.skip_tokenizer_init,
                        api_key=args.api_key).app

    async def close_engine(_app):
        await engine.close()

    app.on_cleanup.append(close_engine)
    logger.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
