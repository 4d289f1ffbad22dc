"""Finding the tool calls in one assistant turn's text.

A parser is ``fn(text) -> (calls, errors)``: the well-formed calls in order, and a message for
each call the model tried to write but got wrong (shown to the model as the tool's answer, so
it can learn the format). ``multi_turn.format`` picks one: ``hermes`` (Qwen2.5/Qwen3 and
Hermes models: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), or any
``module:function`` of that shape.

The text is the turn decoded with its special tokens kept, so markers that are special tokens
(as in Qwen's vocabulary) are seen. Decoding is only for finding calls: the tokens trained are
always the ones generated.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable

from megarl.utils.imports import load_callable

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)",
                     re.DOTALL)


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict


Parser = Callable[[str], "tuple[list[ToolCall], list[str]]"]


def parse_hermes(text: str) -> tuple[list[ToolCall], list[str]]:
    """Every ``<tool_call>...</tool_call>`` (an unclosed one at the end counts: the turn may
    have stopped on the closing marker without emitting it) holding a JSON object with a
    string ``name`` and an object ``arguments`` (a JSON string of one is accepted too)."""
    calls, errors = [], []
    for m in _HERMES.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            errors.append(f"tool call is not valid JSON ({err.msg} at char {err.pos}): "
                          f"{body[:80]!r}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append('tool call must be {"name": ..., "arguments": {...}}')
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            errors.append(f"tool call {obj['name']!r}: arguments must be a JSON object")
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls, errors


PARSERS: dict[str, Parser] = {"hermes": parse_hermes}


def load_parser(fmt: str) -> Parser:
    if fmt in PARSERS:
        return PARSERS[fmt]
    return load_callable(fmt, "actor_rollout_ref.rollout.multi_turn.format")
