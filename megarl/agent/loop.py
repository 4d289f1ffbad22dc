"""The multi-turn agent loop: generate a turn, run the tools it calls, append their answers as
token ids, go on; one trajectory, one reward at the end.

Right by construction, token in and token out:

- the ids trained are the ids the engine generated plus the ids this loop appended, in order;
  text is decoded only to find the tool calls, never re-tokenised into the trajectory;
- what the loop appends (the tool's answer wrapped in the chat template's tool-response
  turn, ``multi_turn.tool_response_template``) carries loss mask 0, behaviour log-prob 0 and
  the version of the token before it; only the model's own tokens have mask 1;
- the trajectory's whole state is its lists (ids, log-probs, versions, mask) and counters, so
  a sample cut by a weight sync mid-turn resumes where it stopped, under any policy (plain,
  partial rollout, a user's rollout function), and survives a checkpoint. Tool calls are
  atomic: a stop asked for while tools run takes effect after their answers are appended.

The budget is the whole response (``data.max_response_length``): generated and appended
tokens together. An answer longer than ``max_tool_response_length`` tokens is cut
(``tool_response_truncate_side``); one that does not fit the budget left ends the sample
with finish ``length``. A turn ends at the model's end-of-turn token or, when the tokenizer
has it as one token, at the closing ``</tool_call>``; a turn with no call ends the sample, as
does ``max_assistant_turns``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Awaitable, Callable

from .executor import ToolPool
from .parsers import CALL_CLOSE, ToolCall, load_parser

logger = logging.getLogger(__name__)

# Qwen2.5 / Qwen3's chat template around tool answers, after the assistant's <|im_end|>
DEFAULT_TEMPLATE = ("\n<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>"
                    "\n<|im_start|>assistant\n")
DEFAULT_SEPARATOR = "\n</tool_response>\n<tool_response>\n"


@dataclasses.dataclass
class AgentState:
    """The agent's part of one trajectory (checkpointed with it)."""
    mask: list[int] = dataclasses.field(default_factory=list)   # 1: generated, 0: appended
    turn_start: int = 0   # index in the response where the current assistant turn began
    turns: int = 0        # assistant turns finished
    calls: list[dict] = dataclasses.field(default_factory=list)  # one per tool call

    def to_dict(self) -> dict:
        return {"mask": list(self.mask), "turn_start": self.turn_start, "turns": self.turns,
                "calls": [dict(c) for c in self.calls]}

    @classmethod
    def from_dict(cls, d: dict | None) -> "AgentState":
        d = d or {}
        return cls(list(d.get("mask", [])), int(d.get("turn_start", 0)),
                   int(d.get("turns", 0)), [dict(c) for c in d.get("calls", [])])

    def summary(self) -> dict:
        """For the reward's extra_info, the metrics and the dump."""
        return {"num_turns": self.turns, "tool_calls": len(self.calls),
                "tool_errors": sum(not c["ok"] for c in self.calls),
                "tool_time_s": sum(c["time_s"] for c in self.calls)}


class AgentLoop:
    """Built from ``actor_rollout_ref.rollout.multi_turn``; owns the tool worker pool."""

    def __init__(self, mt_cfg, tokenizer, eos_ids: list[int], specs: list[dict],
                 clock: Callable[[], float] = time.monotonic, min_turn_tokens: int = 0):
        self.cfg, self.tok, self.clock = mt_cfg, tokenizer, clock
        self.min_turn_tokens = int(min_turn_tokens)  # rollout.min_new_tokens, per turn
        self.parser = load_parser(mt_cfg.format)
        self.max_turns = int(mt_cfg.max_assistant_turns)
        self.max_calls = int(mt_cfg.max_parallel_calls)
        self.max_answer = int(mt_cfg.max_tool_response_length)
        self.side = str(mt_cfg.tool_response_truncate_side)
        self.template = str(mt_cfg.tool_response_template or DEFAULT_TEMPLATE)
        self.separator = str(mt_cfg.tool_response_separator)
        self.eos_ids = set(eos_ids)
        self.eos_id = eos_ids[0] if eos_ids else None
        close = tokenizer.encode(CALL_CLOSE, add_special_tokens=False)
        # stop a turn at its closing call marker when that is one token and one call is all a
        # turn may make: no decoding wasted after it (with parallel calls the turn goes on)
        self.stop_ids = list(close) if len(close) == 1 and self.max_calls == 1 else []
        self.pool = ToolPool(specs, int(mt_cfg.tool_workers), float(mt_cfg.tool_timeout_s))
        self.spans: list[tuple[float, float]] = []  # tool-call times, for the timeline

    def close(self) -> None:
        self.pool.close()

    def turn_minimum(self, t) -> int:
        """`rollout.min_new_tokens` counted from the start of `t`'s current turn, not of its
        response: the tools' answers and earlier turns do not satisfy a later turn's."""
        return max(0, self.min_turn_tokens - (len(t.ids) - t.agent.turn_start))

    # ------------------------------------------------------------------ one trajectory
    async def extend(self, t, budget: int, generate: Callable[..., Awaitable[bool]],
                     context: dict) -> bool:
        """Run `t` (a `Trajectory` with `t.agent`) to its end (True) or until `generate`
        reports a stop (False). `generate(t)` fills one turn as the plain runner does."""
        a = t.agent
        if t.finish is not None:
            return True  # finished before (a cached group's done sample): nothing to redo
        while True:
            if not await generate(t):
                return False
            a.turns += 1
            if t.finish != "stop" or a.turns >= self.max_turns or len(t.ids) >= budget:
                return True  # no answer could be read: its tools are not run
            turn = t.ids[a.turn_start:]
            text = self.tok.decode(turn, skip_special_tokens=False)
            calls, errors = self.parser(text)
            if not calls and not errors:
                return True  # an answer, not a call: the sample is done
            answers = await self._answers(calls, errors, context, len(t.ids))
            a.calls += answers
            ids = self._append_ids([c["answer"] for c in answers],
                                   ended_turn=bool(turn) and turn[-1] in self.eos_ids)
            room = budget - len(t.ids)
            last_v = t.versions[-1] if t.versions else -1
            take = ids[:room]  # room > 0: a full budget returned above
            t.ids += take
            t.logprobs += [0.0] * len(take)
            t.versions += [last_v] * len(take)
            a.mask += [0] * len(take)
            a.turn_start = len(t.ids)  # the last turn is what follows the tools' answers
            if len(ids) >= room:  # nothing left to generate in
                t.finish = "length"
                return True
            t.finish = None

    async def _answers(self, calls: list[ToolCall], errors: list[str], context: dict,
                       at: int) -> list[dict]:
        # over the limit: answered with an error, not run (the model sees why)
        run, extra = calls[:self.max_calls], calls[self.max_calls:]
        kwargs = context.get("tools_kwargs") or {}

        async def one(c: ToolCall) -> dict:
            start = self.clock()
            ok, text, dt = await self.pool.call(c.name, c.arguments, kwargs.get(c.name) or {})
            self.spans.append((start, self.clock()))
            return {"name": c.name, "arguments": c.arguments, "ok": ok,
                    "answer": text if ok else f"Error: {text}", "time_s": dt, "at": at}
        out = list(await asyncio.gather(*[one(c) for c in run]))
        out += [{"name": c.name, "arguments": c.arguments, "ok": False, "time_s": 0.0,
                 "answer": f"Error: more than {self.max_calls} tool call(s) in one turn",
                 "at": at} for c in extra]
        out += [{"name": None, "arguments": None, "ok": False, "time_s": 0.0,
                 "answer": f"Error: {e}", "at": at} for e in errors]
        return out

    def _append_ids(self, answers: list[str], ended_turn: bool) -> list[int]:
        """The tokens after a turn that called tools: the end-of-turn token if the turn
        stopped on its closing call marker instead, then the template around the answers
        (each cut to `max_tool_response_length` tokens, joined by the separator: Qwen puts
        consecutive tool answers in one user turn), ending with the next assistant header."""
        pieces = []
        for ans in answers:
            # a tool's text is data: a marker in it ("<|im_end|>", "</tool_call>") stays
            # plain text, never becomes the special token that would end or fake a turn
            body = self.tok.encode(ans, add_special_tokens=False, split_special_tokens=True)
            if len(body) > self.max_answer:
                body = _cut(body, self.max_answer, self.side)
            pieces.append(body)
        head, _, tail = self.template.partition("{content}")
        enc = lambda text: self.tok.encode(text, add_special_tokens=False)  # noqa: E731
        # the turn stopped on its closing call marker: close it as the template would
        ids = [] if ended_turn or self.eos_id is None else [self.eos_id]
        ids += enc(head)
        for i, body in enumerate(pieces):
            ids += (enc(self.separator) if i else []) + body
        return ids + enc(tail)

    # ------------------------------------------------------------------ metrics, dumps
    def pop_spans(self) -> list[tuple[float, float]]:
        out, self.spans = self.spans, []
        return out


def _cut(ids: list[int], n: int, side: str) -> list[int]:
    if side == "left":
        return ids[-n:]
    if side == "right":
        return ids[:n]
    half = n // 2
    return ids[:half] + ids[len(ids) - (n - half):]


def step_metrics(samples) -> dict[str, float]:
    """``rollout/turns_mean`` and the tool metrics of a step's samples (multi-turn ones)."""
    infos = [s.agent for s in samples if getattr(s, "agent", None)]
    if not infos:
        return {}
    n = len(infos)
    return {"rollout/turns_mean": sum(i["num_turns"] for i in infos) / n,
            "rollout/tool_calls_mean": sum(i["tool_calls"] for i in infos) / n,
            "rollout/tool_errors": float(sum(i["tool_errors"] for i in infos)),
            "rollout/tool_time_s": sum(i["tool_time_s"] for i in infos)}


def trajectory_json(sample, tokenizer) -> dict:
    """One sample's trajectory for inspection: its turns (model text and appended text, with
    their token ids and mask), the calls and answers, the reward."""
    mask = sample.loss_mask or [1] * len(sample.response_ids)
    segments, i = [], 0
    ids = sample.response_ids
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        segments.append({"role": "model" if mask[i] else "appended", "start": i, "end": j,
                         "ids": ids[i:j],
                         "text": tokenizer.decode(ids[i:j], skip_special_tokens=False)})
        i = j
    return {"uid": sample.uid, "prompt": tokenizer.decode(sample.prompt_ids,
                                                          skip_special_tokens=False),
            "reward": sample.reward, "finish": sample.finish, "segments": segments,
            "calls": (sample.agent or {}).get("calls", []),
            "summary": {k: v for k, v in (sample.agent or {}).items() if k != "calls"}}
