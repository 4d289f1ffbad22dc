"""The tool-use task a random model learns on a CPU: data_source ``megarl/tool_lookup``.

Each prompt names a key digit ("Look up 7"); the answer is the value stored under that key in
a table drawn at random for this prompt and known only to the ``lookup`` tool (it reaches the
tool as ``extra_info.tools_kwargs.lookup.table``). A model cannot know the answer; it can learn
to call the tool with the key copied from the prompt, then to repeat what the tool answered
and stop (``configs/agent_tool_solve.yaml``). The call is written compactly, the key and the
closing marker, ``7</tool_call>`` (`megarl.agent.tasks.parse_lookup_call`, the pluggable
parser: two tokens a random 2-layer model finds by sampling); a Hermes JSON call
``<tool_call>{"name": "lookup", "arguments": {"key": "7"}}</tool_call>`` works too.

Scores, for the value ``g`` (``1.0`` needs the tool: a guess is right one time in ten):

- ``1.0``: a call with the right key was answered, the last turn is exactly ``g`` and ended
  with a stop token;
- otherwise partial credit, at most ``0.75``: ``0.05`` for trying a call, ``0.4`` more for
  a call with the right key that the tool answered (else ``0.1`` if the response starts with
  the key), ``0.2`` more if the last turn's text starts with ``g`` (special tokens aside:
  the answer copied, though the turn may not end right), and ``0.1`` more if a turn after
  a call ended with the stop token rather than another call. Calling as such pays little: a
  constant call would otherwise collapse the policy onto it.

The reward reads what the agent loop adds to ``extra_info``: ``tool_calls`` (name,
arguments, ok, answer of each), ``final_turn`` (the last turn's text, special tokens kept)
and ``finish_reason``.
"""
from __future__ import annotations

import re

# the call markers (as megarl.agent.parsers has them; the reward imports no agent code)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

DATA_SOURCE = "megarl/tool_lookup"
_SPECIAL = re.compile(r"<\|[a-z_]+\|>|</?tool_(?:call|response)>")

W_TRY = 0.05
W_KEY_FIRST = 0.1
W_RIGHT_KEY = 0.4
W_ANSWER_START = 0.2
W_STOP = 0.1


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    del data_source
    info = extra_info or {}
    answer = str(ground_truth).strip()
    key = str(info.get("key", "")).strip()
    calls = info.get("tool_calls") or []
    right = any(c.get("ok") and c.get("name") == "lookup"
                and str((c.get("arguments") or {}).get("key", "")).strip() == key
                for c in calls)
    last = str(info.get("final_turn", ""))
    final = "".join(_SPECIAL.sub("", last).split())
    answered = CALL_OPEN not in last and CALL_CLOSE not in last  # the last turn is no call
    stopped = info.get("finish_reason", "stop") == "stop"
    if right and answered and final == answer and stopped:
        return 1.0
    # What depends on the prompt pays; calling as such pays only a little (a constant call,
    # "5</tool_call>" for every key, must not be a resting place: it is right one time in
    # ten). Writing the key first is the step a random model finds by sampling, and the
    # closing marker one token after it is what the small calling credit makes it find.
    score = W_TRY if calls else 0.0
    if right:
        score += W_RIGHT_KEY
    elif key and solution_str.lstrip().startswith(key):
        score += W_KEY_FIRST
    if final.startswith(answer):  # even if it then (wrongly) calls again: the copy is right
        score += W_ANSWER_START
    # Ending the turn after a call with the stop token pays from the first steps on. Without
    # it the stop was learned last, after "digits then </tool_call>" had been reinforced by
    # every good call, and then found only by sampling (1 run in 3 stalled at 0.65, its
    # answer turn closed with </tool_call>); with it every run measured stopped right by
    # v250-v600 (docs/agents.md).
    if calls and answered and stopped:
        score += W_STOP
    return score
