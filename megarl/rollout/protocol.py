"""The rollout engine protocol: requests, outputs and the async interface every engine offers.

This module owns the data that crosses the rollout boundary and its SGLang wire form
(`/generate` JSON with `input_ids`, `sampling_params`, `return_logprob`; `output_ids` and
`meta_info` back). Two engines implement `RolloutEngine`: the in-process `EmbeddedEngine`
(megarl.rollout.engine) and `SGLangEngine` (megarl.backends.sglang.engine), which drives a real
SGLang server, or the embedded server, over HTTP.

Log-probs (the behaviour policy). For every sampled token the engine reports
``log_softmax(logits / temperature)[token]`` over the model's real vocabulary, computed in
float32 from the logits the token was sampled from, *before* top-p / top-k / min-p truncation.
With temperature 0 (greedy) it reports ``log_softmax(logits)[token]`` (temperature 1). This is
the distribution the Megatron trainer recomputes (megarl.backends.megatron.logprobs) and the
one SGLang returns by default, so rollout and trainer log-probs compare token by token; it is
not the truncated distribution the token was actually drawn from when top-p/top-k are active.

Weight versions. On the wire (and inside an engine) a version is a string, SGLang's convention;
inside megarl it is an integer (`version_int` converts, at this edge only). A response carries
SGLang's ``meta_info.weight_versions``: ``[{version, start, end}]`` spans over output
positions (SGLang 0.5.20+), more than one when weights changed while the request was
generating, and ``meta_info.weight_version``, the version of the last span.

Routed experts (routing replay, R3), stock SGLang 0.5.23's contract. A request with
``return_routed_experts`` (one bool) to a server started with ``--enable-return-routed-experts``
gets ``meta_info.routed_experts``: base64 of raw little-endian int32 of shape
[tokens, num_hidden_layers, num_experts_per_tok], no shape sent (`decode_routed_experts`).
The rows are positions [routed_experts_start_len, seqlen - 1) of prompt + output, seqlen =
len(prompt) + len(output): the last generated token never runs through the model. Within a
row the k experts are in descending routing probability (a sorted top-k). It comes only with
a request that finished or was aborted while running; a server without the flag (or a dense
model), and a request aborted while queued, answer without the key. A start_len outside
[0, len(prompt)] is refused, but only when routed experts are asked for (stock ignores it
otherwise).

Deliberately left out: text-in/text-out beyond what the embedded server's tokenizer offers,
streaming responses, input-token log-probs and multimodal inputs.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

PAUSE_MODES = ("abort", "retract", "in_place")


I64_MAX = 2**63 - 1  # stock SGLang reads its integers as 64-bit


class BadRequest(ValueError):
    """A request the engine refuses; `field` names the offending input (HTTP `status`)."""

    status = 400

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class EngineClosed(BadRequest):
    """A call that reaches an engine after its close began (a run shutting down while a
    trainer still syncs): refused with 503, which a client treats as a lost engine."""

    status = 503

    def __init__(self):
        super().__init__("engine", "closed (shutting down)")


def short_repr(value: Any, limit: int = 80, quote: bool = True) -> str:
    """`repr(value)` (or `str` with quote=False) cut to `limit` characters, for error messages
    that echo client input: a message must not be as large as the body it refuses."""
    if isinstance(value, (list, dict)) and len(value) > limit:
        text = f"<{type(value).__name__} of {len(value)} items>"
    else:
        try:
            text = repr(value) if quote else str(value)
        except (RecursionError, ValueError):  # deep nesting; ints past str()'s digit limit
            text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class SamplingParams:
    """SGLang's `sampling_params` subset that RL uses; unknown keys are refused, not ignored."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    n: int = 1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None
    # Text-only knobs: accepted for SGLang compatibility, they change no token.
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise BadRequest(f"sampling_params.{unknown[0]}",
                             f"unknown sampling parameter; supported: {sorted(names)}")
        # SGLang sends null for "unset"; drop those so the defaults apply.
        params = cls(**{k: v for k, v in d.items() if v is not None or k == "sampling_seed"})
        params.validate()
        return params

    def validate(self) -> None:
        def need(ok: bool, name: str, msg: str):
            if not ok:
                raise BadRequest(f"sampling_params.{name}", msg)

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def is_count(v, lo):  # an int that fits stock's i64
            return is_int(v) and lo <= v <= I64_MAX

        need(is_count(self.max_new_tokens, 1), "max_new_tokens",
             f"must be an integer > 0, got {short_repr(self.max_new_tokens)}")
        need(is_num(self.temperature) and self.temperature >= 0, "temperature",
             f"must be a number >= 0, got {short_repr(self.temperature)}")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p",
             f"must be in (0, 1], got {short_repr(self.top_p)}")
        need(is_int(self.top_k) and (self.top_k == -1 or is_count(self.top_k, 1)), "top_k",
             f"must be -1 (off) or an integer >= 1, got {short_repr(self.top_k)}")
        need(is_num(self.min_p) and 0 <= self.min_p < 1, "min_p",
             f"must be in [0, 1), got {short_repr(self.min_p)}")
        need(is_count(self.min_new_tokens, 0) and self.min_new_tokens <= self.max_new_tokens,
             "min_new_tokens", f"must be an integer in [0, max_new_tokens], got "
             f"{short_repr(self.min_new_tokens)}")
        need(is_count(self.n, 1), "n", f"must be an integer >= 1, got {short_repr(self.n)}")
        need(isinstance(self.stop_token_ids, (list, tuple))
             and all(is_count(t, 0) for t in self.stop_token_ids), "stop_token_ids",
             f"must be a list of token ids, got {short_repr(self.stop_token_ids)}")
        self.stop_token_ids = list(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            need(isinstance(getattr(self, name), bool), name,
                 f"must be true or false, got {short_repr(getattr(self, name))}")
        # torch.Generator.manual_seed and stock's i64 both stop at 64 bits.
        need(self.sampling_seed is None or (is_int(self.sampling_seed)
                                            and -I64_MAX - 1 <= self.sampling_seed <= I64_MAX),
             "sampling_seed", f"must be a 64-bit signed integer or null, got "
             f"{short_repr(self.sampling_seed)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class GenerateRequest:
    """One sample to generate (n == 1; `expand` turns an n-sample request into n of these)."""

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = True
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Routing replay (see the module docstring): report the experts of positions
    # [routed_experts_start_len, seqlen - 1). Sent on the wire only when asked for.
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0

    def validate(self, vocab_size: int | None = None) -> None:
        ids = self.input_ids
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids", "must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise BadRequest("input_ids", "must contain only non-negative integers")
        if vocab_size is not None and max(ids) >= vocab_size:
            raise BadRequest("input_ids", f"token id {max(ids)} >= vocabulary size {vocab_size}")
        if not isinstance(self.return_routed_experts, bool):
            raise BadRequest("return_routed_experts", f"must be true or false, got "
                             f"{short_repr(self.return_routed_experts)}")
        start = self.routed_experts_start_len
        if not (isinstance(start, int) and not isinstance(start, bool)
                and -I64_MAX - 1 <= start <= I64_MAX):
            raise BadRequest("routed_experts_start_len", f"must be a 64-bit integer, got "
                             f"{short_repr(start)}")
        # Stock checks the range only when routed experts are asked for (scheduler.py), and
        # then aborts the request with HTTP 400.
        if self.return_routed_experts and not 0 <= start <= len(ids):
            raise BadRequest("routed_experts_start_len", f"{start} is outside [0, {len(ids)}] "
                             "(the number of input tokens)")
        self.sampling.validate()

    def expand(self) -> list["GenerateRequest"]:
        """n samples as n requests: rids `rid-i`, seeds derived so sample i is reproducible."""
        if self.sampling.n == 1:
            return [self]
        out = []
        for i in range(self.sampling.n):
            seed = self.sampling.sampling_seed
            if seed is not None:
                # Spread sample seeds far apart so seed s, sample 1 != seed s+1, sample 0.
                seed = (seed * 1_000_003 + i) % (2**63)
            sp = dataclasses.replace(self.sampling, n=1, sampling_seed=seed,
                                     stop_token_ids=list(self.sampling.stop_token_ids))
            out.append(dataclasses.replace(self, input_ids=list(self.input_ids), sampling=sp,
                                           rid=f"{self.rid}-{i}"))
        return out


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | None = None  # the stop token, for "stop"
    length: int | None = None  # tokens generated, for "length"
    message: str | None = None  # why, for "abort"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            d["matched"] = self.matched
        elif self.type == "length":
            d["length"] = self.length
        else:
            d["message"] = self.message
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "FinishReason":
        d = d or {"type": "abort", "message": "no finish_reason in response"}
        return cls(d.get("type", "abort"), d.get("matched"), d.get("length"), d.get("message"))


@dataclass
class GenerateOutput:
    """A finished (or aborted, partial) sample; see the module docstring for log-probs/versions."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: FinishReason
    weight_version: str
    weight_version_spans: list[tuple[str, int, int]] = field(default_factory=list)
    e2e_latency: float = 0.0
    text: str | None = None
    # meta_info.routed_experts as on the wire (base64 int32); `decode_routed_experts` reads it
    routed_experts: str | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason.type == "abort"

    def token_versions(self) -> list[int]:
        """megarl's integer weight version of every output token, from the spans."""
        out = []
        for v, start, end in self.weight_version_spans:
            out.extend([version_int(v)] * (end - start))
        return out

    def to_sglang(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason.to_dict(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "weight_versions": [{"version": v, "start": a, "end": b}
                                for v, a, b in self.weight_version_spans],
            "e2e_latency": self.e2e_latency,
        }
        if self.output_logprobs is not None:
            # SGLang's shape: (logprob, token_id, token_text or None) per output token.
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(self.output_logprobs, self.output_ids)]
        if self.routed_experts is not None:
            meta["routed_experts"] = self.routed_experts
        d: dict[str, Any] = {"output_ids": list(self.output_ids), "meta_info": meta}
        if self.text is not None:
            d["text"] = self.text
        return d

    @classmethod
    def from_sglang(cls, d: dict[str, Any]) -> "GenerateOutput":
        meta = d.get("meta_info", {})
        lps = meta.get("output_token_logprobs")
        output_ids = list(d.get("output_ids") or ([t for _, t, *_ in lps] if lps else []))
        version = str(meta.get("weight_version", "default"))
        spans = [(s["version"], s["start"], s["end"]) for s in meta.get("weight_versions") or []]
        if not spans and output_ids:
            spans = [(version, 0, len(output_ids))]  # SGLang before 0.5.20: no spans
        return cls(
            rid=str(meta.get("id", "")),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            output_ids=output_ids,
            output_logprobs=[float(x[0]) for x in lps] if lps is not None else None,
            finish_reason=FinishReason.from_dict(meta.get("finish_reason")),
            weight_version=version,
            weight_version_spans=[(str(v), int(a), int(b)) for v, a, b in spans],
            e2e_latency=float(meta.get("e2e_latency", 0.0)),
            text=d.get("text"),
            routed_experts=meta.get("routed_experts"),
        )


def encode_routed_experts(routed: np.ndarray) -> str:
    """Stock's wire form of a [tokens, layers, topk] array: base64 of its raw int32 bytes."""
    return base64.b64encode(np.ascontiguousarray(routed, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(b64: str, num_layers: int, topk: int) -> np.ndarray:
    """`meta_info.routed_experts` as an int32 array [tokens, num_layers, topk]. The wire carries
    no shape, so the model's `num_hidden_layers` and `num_experts_per_tok` give it."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise ValueError(f"meta_info.routed_experts: not base64 ({e})") from None
    row = 4 * num_layers * topk
    if row <= 0 or len(raw) % row:
        raise ValueError(f"meta_info.routed_experts: {len(raw)} bytes are not a whole number "
                         f"of tokens of {num_layers} layers x top-{topk} int32 ({row} bytes "
                         "each); does the model's config match the server's?")
    return np.frombuffer(raw, dtype="<i4").astype(np.int32).reshape(-1, num_layers, topk)


def version_int(v: str | int) -> int:
    """megarl's integer version of an engine's version string. "default" is what a server
    launched without `--weight-version` reports for the weights it loaded: megarl's v0."""
    if isinstance(v, int):
        return v
    if v == "default":
        return 0
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ValueError(f"meta_info.weight_versions: version {v!r} is not one megarl set "
                         "(an integer); was the server updated by another trainer?") from None


def continuation(request: GenerateRequest, so_far: list[int]) -> GenerateRequest:
    """A request resuming an aborted sample: prompt + the tokens generated so far (`so_far`,
    over every attempt), the budget left.

    The caller keeps the earlier attempts' tokens, log-probs and versions and appends the
    continuation's (partial rollout: the tail resumes later under newer weights).

    Routed experts: an earlier attempt reported positions up to seqlen - 1, not the last token
    it generated (that token was never run through the model), so the continuation starts
    at that token, `len(prompt) + len(so_far) - 1`, and the attempts' rows join end to end.
    This assumes each earlier attempt that generated tokens reported them; one aborted while
    queued (after a retract) reports none, and the caller then sets the start itself.
    """
    done = len(so_far)
    sp = dataclasses.replace(
        request.sampling, n=1, stop_token_ids=list(request.sampling.stop_token_ids),
        max_new_tokens=max(1, request.sampling.max_new_tokens - done),
        min_new_tokens=max(0, request.sampling.min_new_tokens - done))
    start = (len(request.input_ids) + done - 1 if done
             else request.routed_experts_start_len)  # nothing generated: nothing covered yet
    return GenerateRequest(list(request.input_ids) + list(so_far), sp,
                           request.return_logprob, f"{request.rid}+{done}",
                           request.return_routed_experts, start)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout manager needs from an engine. All methods are coroutines.

    `generate` resolves when that one sample finishes, so a caller that gathers many with
    `asyncio.as_completed` gets short responses first. Weight-update methods raise
    `BadRequest` for a rejected update, which leaves the old weights in place.
    """

    async def generate(self, request: GenerateRequest) -> GenerateOutput: ...

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None: ...

    async def pause(self, mode: str = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def flush_cache(self) -> bool: ...

    async def get_weight_version(self) -> str: ...

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, group_name: str,
                                        backend: str = "gloo") -> None: ...

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              weight_version: str | None = None,
                                              flush_cache: bool = True,
                                              load_format: str | None = None) -> None: ...

    async def update_weights_from_tensor(self, named_tensors: list, weight_version: str | None
                                         = None, flush_cache: bool = True) -> None: ...

    async def begin_weight_update(self) -> None: ...

    async def end_weight_update(self) -> None: ...

    async def close(self) -> None: ...
