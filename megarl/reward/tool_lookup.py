"""The tool-use task a random model learns on a CPU: data_source ``megarl/tool_lookup``.

Each prompt names a key digit ("Look up 7"); the answer is the value stored under that key in
a table drawn at random for this prompt and known only to the ``lookup`` tool (it reaches the
tool as ``extra_info.tools_kwargs.lookup.table``). A model cannot know the answer; it can learn
to call the tool with the key copied from the prompt, then to repeat what the tool answered
and stop (``configs/agent_tool_solve.yaml``). The call is the task's compact one: a turn that
is the bare key and ends, ``7<|im_end|>`` (`megarl.agent.tasks.parse_lookup_call`, the
pluggable parser; ``7</tool_call>`` and a Hermes JSON call work too). Both turns are then the
same thing done twice, copy the last token and stop, which a random 2-layer model learns from
its own samples; with a closing marker after the key, the model carried that marker over to
its answer turn and stalled there (reward 0.65, the answer closed with ``</tool_call>``).

Scores, for the key ``k`` and the value ``g`` (``1.0`` needs the tool: a guess of ``g`` is
right one time in ten and pays nothing):

- ``1.0``: a call with the right key was answered, the last turn is exactly ``g`` and ended
  with a stop token;
- otherwise partial credit: ``0.05`` for a call the tool answered and ``0.4`` more if its key
  was right; without a call, up to ``0.3`` for a turn that starts with ``k`` (the copy);
  after a call, up to ``0.2`` for a last turn that starts with what the tool said (even after
  a wrong key) and ``0.1`` more if it is exactly that and stopped. A copy loses ``0.1`` per
  character after it, down to ``0.05``: of two right starts the shorter wins, which steers
  a turn towards stopping right after its copy.

The reward reads what the agent loop adds to ``extra_info``: ``tool_calls`` (name,
arguments, ok, answer of each), ``final_turn`` (the last turn's text, special tokens kept)
and ``finish_reason``; never ``solution_str``, which holds the tool's text too.
"""
from __future__ import annotations

import re

# the call markers (as megarl.agent.parsers has them; the reward imports no agent code)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

DATA_SOURCE = "megarl/tool_lookup"
_SPECIAL = re.compile(r"<\|[a-z_]+\|>|</?tool_(?:call|response)>")

W_TRY = 0.05
W_KEY_FIRST = 0.3
W_RIGHT_KEY = 0.4
W_COPY = 0.2
W_PER_EXTRA_CHAR = 0.1
W_COPY_MIN = 0.05
W_STOP = 0.1


def _copy_credit(text: str, value: str, weight: float) -> float:
    """`weight` for a text that starts with `value`, less for every character after it (of
    two right starts the one that goes on less wins, which steers a turn towards stopping
    right after its copy); 0 for any other text."""
    if not value or not text.startswith(value):
        return 0.0
    return max(W_COPY_MIN, weight - W_PER_EXTRA_CHAR * (len(text) - len(value)))


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    del data_source, solution_str  # the turns come from extra_info, never the tool's text
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
    # What depends on the prompt pays; a call as such pays little: a constant call, "5" for
    # every key, is right one time in ten and must not be a resting place.
    score = W_TRY if any(c.get("ok") for c in calls) else 0.0
    if right:
        score += W_RIGHT_KEY
    elif not calls:
        # the one turn, copying the key: the step a random model finds by sampling
        score += _copy_credit(final, key, W_KEY_FIRST)
    # The copy of what the tool said pays even after a wrong key, and stopping right after
    # it pays more: the answer turn is then learned while the key is still being found. A
    # stop without a copy pays nothing (an empty answer turn was a resting place when it did).
    said = [str(c.get("answer", "")).strip() for c in calls if c.get("ok")]
    if said:
        score += _copy_credit(final, said[-1], W_COPY)
        if final == said[-1] and answered and stopped:
            score += W_STOP
    return score
