"""Call parsers of the project's own agent tasks (``multi_turn.format`` by import path).

`parse_lookup_call` is the compact call of the CPU tool-use task (``megarl.reward.tool_lookup``,
``configs/agent_tool_solve.yaml``): short enough that a random 2-layer model finds it by
sampling, where a JSON call would take it far longer. Its bare form (the key alone, then the
end of the turn) makes the call turn and the answer turn the same behaviour, copy the last
token and stop, so what is learned for one serves the other.
"""
from __future__ import annotations

import re

from .parsers import CALL_CLOSE, CALL_OPEN, ToolCall, parse_hermes

_SPECIAL = re.compile(r"<\|[a-z_]+\|>|</?tool_(?:call|response)>")
_TURN_END = "<|im_end|>"


def parse_lookup_call(text: str) -> tuple[list[ToolCall], list[str]]:
    """The compact call. A turn that is one bare character, a key, and ends its turn is the
    call: ``7<|im_end|>`` -> lookup(key="7"), the form the CPU task learns. With the markers,
    the turn's text up to ``</tool_call>`` is the key (an opening ``<tool_call>`` is allowed,
    not needed): ``7</tool_call>`` -> lookup(key="7"); a JSON body goes to the Hermes
    parser. Any other turn is an answer."""
    if CALL_CLOSE not in text and CALL_OPEN not in text:
        bare = _SPECIAL.sub("", text).strip()
        if len(bare) == 1 and bare.isalnum() and text.rstrip().endswith(_TURN_END):
            return [ToolCall("lookup", {"key": bare})], []
        return [], []
    body = text.split(CALL_CLOSE, 1)[0].rsplit(CALL_OPEN, 1)[-1]
    if body.strip().startswith("{"):
        return parse_hermes(text)
    body = _SPECIAL.sub("", body).strip()
    if not body:
        return [], ["write the key to look up before </tool_call>"]
    return [ToolCall("lookup", {"key": body})], []
