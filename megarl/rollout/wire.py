"""Reading request bodies: bounded JSON, then typed fields, every refusal naming its field.

Owns the first look at each body the rollout server gets. `read_body` takes the bytes within
a size limit; `parse_object` turns them into a JSON object within fixed structure limits,
checked once before any handler sees the body, so no handler meets a value Python or torch
cannot afford: the C JSON parser recurses once per nesting level, `int()` refuses literals
over 4,300 digits with a bare ValueError, and torch refuses integers beyond 64 bits. `Fields`
then reads typed values out of the object. Each refusal is a `BadRequest` whose `field` names
the key (dotted for nested objects, list indices in the message), answered with a 4xx.

Stock SGLang reads its integers as 64-bit (`_expect_int(..., expected="i64")` in its API
types), so a JSON integer here has at most 20 digits, and `Fields.get_int` keeps each value in
the signed 64-bit range unless the caller narrows it further. JSON's `NaN` and `Infinity` parse
(Python's and stock's parsers accept them); the readers of number fields refuse them.
"""
from __future__ import annotations

import json
from typing import Any

from megarl.rollout.protocol import BadRequest, short_repr

MAX_DEPTH = 32  # nesting of objects and arrays; megarl's requests use 3
MAX_INT_DIGITS = 20  # 2**64 has 20 digits
MAX_FLOAT_CHARS = 64  # a float64 literal needs ~25 characters; longer ones are padding
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


class BodyTooLarge(BadRequest):
    """A body over the endpoint's size limit (HTTP 413)."""

    status = 413


async def read_body(request, limit: int) -> bytes:
    """The request's body, refused as soon as it is known to exceed `limit` bytes: from its
    Content-Length before anything is read, or while a chunked body streams in."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyTooLarge("body", f"{declared} bytes; this endpoint takes at most {limit}")
    chunks, size = [], 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge("body", f"more than {limit} bytes; this endpoint takes at most "
                               f"{limit}")
        chunks.append(chunk)
    return b"".join(chunks)


class _Oversized:
    """A number literal past the limits, kept as text until the structure walk names where it
    sits (the parser's hooks do not know the key)."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def _parse_int(text: str):
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else _Oversized(text)


def _parse_float(text: str):
    return float(text) if len(text) <= MAX_FLOAT_CHARS else _Oversized(text)


def parse_object(raw: bytes) -> dict:
    """A JSON object from `raw` (an empty body is `{}`), within the structure limits."""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float)
    except RecursionError:
        raise BadRequest("body", f"JSON nested too deeply; at most {MAX_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
        raise BadRequest("body", f"malformed JSON: {short_repr(str(e), 200)}") from None
    if not isinstance(body, dict):
        raise BadRequest("body", f"expected a JSON object, got {type(body).__name__}")
    _check_structure(body)
    return body


def _check_structure(body: dict) -> None:
    """Refuse nesting deeper than MAX_DEPTH and the oversized numbers the parser marked.
    Looks inside a container only when it holds one of those (`set(map(type, ...))` runs in
    C), so a long flat list of token ids costs next to nothing."""
    stack: list[tuple[Any, tuple, int]] = [(body, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BadRequest(_field(path), f"{_where(path)}: nested deeper than {MAX_DEPTH} "
                             "levels")
        items = value.items() if type(value) is dict else enumerate(value)
        kinds = set(map(type, value.values() if type(value) is dict else value))
        if not kinds & {dict, list, _Oversized}:
            continue
        for key, item in items:
            kind = type(item)
            if kind is _Oversized:
                raise BadRequest(_field(path + (key,)), f"{_where(path + (key,))}: number "
                                 f"{short_repr(item.text, 40)} ({len(item.text)} characters) "
                                 f"is beyond 64 bits")
            if kind is dict or kind is list:
                stack.append((item, path + (key,), depth + 1))


def _field(path: tuple) -> str:
    """The dotted key path without list indices: `sampling_params.top_k`."""
    return ".".join(short_repr(k, 64, quote=False) for k in path if isinstance(k, str)) or "body"


def _where(path: tuple) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (("." if out else "")
                                                     + short_repr(k, 64, quote=False))
    return out or "body"


def describe(value: Any) -> str:
    """A value's JSON type and a short rendering of it, for error messages."""
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)
    return f"{kind} {short_repr(value, 60)}"


class Fields:
    """Typed reads of one JSON object. A missing key or a null takes the default (stock sends
    null for "unset"); `required=True` refuses both. Each reader raises BadRequest naming
    `prefix + key`."""

    def __init__(self, body: dict, prefix: str = ""):
        self.body, self.prefix = body, prefix

    def _get(self, key: str, required: bool):
        value = self.body.get(key)
        if value is None and required:
            raise BadRequest(self.prefix + key, "missing")
        return value

    def _refuse(self, key: str, want: str, value) -> BadRequest:
        return BadRequest(self.prefix + key, f"must be {want}, got {describe(value)}")

    def get_str(self, key: str, default: str | None = None, *, required: bool = False,
                choices: tuple[str, ...] | None = None, nonempty: bool = False) -> str | None:
        value = self._get(key, required)
        if value is None:
            return default
        if not isinstance(value, str) or (nonempty and not value):
            raise self._refuse(key, "a non-empty string" if nonempty else "a string", value)
        if choices is not None and value not in choices:
            raise self._refuse(key, f"one of {list(choices)}", value)
        return value

    def get_int(self, key: str, default: int | None = None, *, required: bool = False,
                lo: int = I64_MIN, hi: int = I64_MAX) -> int | None:
        value = self._get(key, required)
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise self._refuse(key, f"an integer in [{lo}, {hi}]", value)
        return value

    def get_bool(self, key: str, default: bool | None = None, *,
                 required: bool = False) -> bool | None:
        value = self._get(key, required)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._refuse(key, "true or false", value)
        return value

    def get_str_list(self, key: str, *, required: bool = False) -> list[str] | None:
        value = self._get(key, required)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._refuse(key, "a list of strings", value)
        return value
