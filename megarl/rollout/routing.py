"""Routed experts (routing replay, R3) of the embedded engine, in stock SGLang 0.5.23's contract.

Owns the capture: a forward hook on every MoE layer's router keeps the top-k expert ids the
model itself used in that forward pass (transformers 5's routers return them, a sorted top-k
of the softmax: descending probability, ties as torch.topk breaks them), and `RoutedBatch`
tells the recorder which sequence and position each row of a prefill or decode pass is. So
each position's routing is the one of the forward pass that actually processed it, under the
weights live at that step; a retracted sequence's re-prefill overwrites its earlier rows, as
stock's rebuilt KV slots do. The wire format and the positions reported are
megarl.rollout.protocol's (module docstring there).

Layers without a router (a dense MLP among MoE layers) report expert 0, the value stock's
zero-filled buffer keeps for them. Deliberately left out: a dense model (stock refuses to
start with the flag; so does `RoutingRecorder.for_model`) and routers other than
transformers 5's `(logits, scores, indices)` ones.
"""
from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch

from megarl.rollout.batch import DecodeBatch, Sequence
from megarl.rollout.protocol import encode_routed_experts

logger = logging.getLogger(__name__)


class RoutingRecorder:
    """The routed experts of the sequences that ask for them, by rid, from admission until
    `take` hands them back (or `forget` drops them)."""

    def __init__(self, routers: list[torch.nn.Module | None], topk: int):
        self.num_layers, self.topk = len(routers), topk
        self._captured: dict[int, torch.Tensor] | None = None  # layer -> [tokens, topk]
        self._rows: dict[str, np.ndarray] = {}  # rid -> [capacity - start, layers, topk]
        self._hooks = [r.register_forward_hook(self._hook(i))
                       for i, r in enumerate(routers) if r is not None]

    @classmethod
    def for_model(cls, model) -> "RoutingRecorder":
        """Hooks on every decoder layer's `mlp.gate`; ValueError for a model without experts
        (stock fails at start-up then, on `num_experts_per_tok`)."""
        cfg = model.config.get_text_config()
        topk = getattr(cfg, "num_experts_per_tok", None)
        if not topk:
            raise ValueError(f"enable_return_routed_experts: {type(cfg).__name__} has no "
                             "num_experts_per_tok (a dense model); routed experts need a "
                             "mixture of experts")
        routers = [getattr(layer.mlp, "gate", None) for layer in model.get_decoder().layers]
        if not any(routers):
            raise ValueError(f"enable_return_routed_experts: no layer of "
                             f"{type(model).__name__} has a router at mlp.gate")
        return cls(routers, int(topk))

    def _hook(self, layer: int):
        def keep(module, args, out):
            if self._captured is not None:
                if not (isinstance(out, tuple) and len(out) == 3):
                    raise TypeError(f"layer {layer}: {type(module).__name__} does not return "
                                    "(logits, scores, indices); routed experts cannot be read")
                self._captured[layer] = out[2]
        return keep

    def wants(self, seq: Sequence) -> bool:
        return seq.request.return_routed_experts

    @contextlib.contextmanager
    def capture(self):
        """Around one forward pass: yields a list that then holds [layers, tokens, topk] int32
        on the CPU (one device-to-host copy per pass)."""
        self._captured, got = {}, []
        try:
            yield got
            ref = next(iter(self._captured.values()))
            got.append(torch.stack([self._captured.get(i, torch.zeros_like(ref))
                                    for i in range(self.num_layers)]).to(torch.int32).cpu())
        finally:
            self._captured = None

    def record(self, seq: Sequence, first: int, routed: torch.Tensor) -> None:
        """`routed` [layers, n, topk]: positions first .. first+n-1 of `seq`'s prompt+output."""
        req = seq.request
        start = req.routed_experts_start_len
        rows = self._rows.get(req.rid)
        if rows is None:
            cap = len(req.input_ids) + seq.max_new_tokens - start
            rows = self._rows[req.rid] = np.zeros((max(cap, 0), self.num_layers, self.topk),
                                                  np.int32)
        skip = max(0, start - first)  # positions before start_len are not kept
        if skip < routed.shape[1]:
            at = first + skip - start
            rows[at:at + routed.shape[1] - skip] = routed[:, skip:].permute(1, 0, 2).numpy()

    def take(self, seq: Sequence) -> str | None:
        """The wire string of positions [start_len, seqlen - 1), None when none were asked for
        or computed."""
        rows = self._rows.pop(seq.rid, None)
        if rows is None:
            return None
        req = seq.request
        start = min(req.routed_experts_start_len, len(req.input_ids) + len(seq.output_ids) - 1)
        end = len(req.input_ids) + len(seq.output_ids) - 1
        return encode_routed_experts(rows[: max(0, end - start)])

    def forget(self) -> None:
        """Drop every sequence's rows (the engine orphaned its requests)."""
        self._rows.clear()


class RoutedBatch(DecodeBatch):
    """A DecodeBatch that records, for the rows asking for them, the experts each forward pass
    routed each position to."""

    def __init__(self, model, device: torch.device, recorder: RoutingRecorder):
        super().__init__(model, device)
        self.recorder = recorder

    def _admit_chunk(self, seqs: list[Sequence], version: str) -> None:
        want = [i for i, s in enumerate(seqs) if self.recorder.wants(s)]
        if not want:
            return super()._admit_chunk(seqs, version)
        # read before the forward: it appends each row's first sampled token
        lengths = [len(s.prefill_ids()) for s in seqs]
        with self.recorder.capture() as got:
            super()._admit_chunk(seqs, version)
        width = max(lengths)
        routed = got[0].view(self.recorder.num_layers, len(seqs), width, self.recorder.topk)
        for i in want:  # rows are left-padded: a row's tokens are its last `lengths[i]`
            self.recorder.record(seqs[i], 0, routed[:, i, width - lengths[i]:])

    def decode(self, version: str) -> None:
        want = [i for i, s in enumerate(self.rows) if self.recorder.wants(s)]
        if not want:
            return super().decode(version)
        rows = list(self.rows)
        # each row feeds its last sampled token, at position seqlen - 1
        positions = [len(s.request.input_ids) + len(s.output_ids) - 1 for s in rows]
        with self.recorder.capture() as got:
            super().decode(version)
        routed = got[0]  # [layers, rows, topk]
        for i in want:
            self.recorder.record(rows[i], positions[i], routed[:, i:i + 1])
