"""The running batch of the embedded engine: a decode loop over the model's own KV cache.

Owns the KV cache, attention mask and positions of the sequences being generated, and the
per-sequence generation state (tokens, log-probs, version spans). Sequences join between steps
(their prompts are prefilled together and their cache rows merged in) and leave as soon as
they finish, so a finished row is handed back at once and costs no more compute; this is
continuous batching on a Hugging Face `DynamicCache` without a paged allocator.

Layout invariants: every cache layer is [B, heads, L, head_dim]; `mask` [B, L] marks real
tokens (rows are left-padded, so each row's real tokens are a suffix of its mask); `pos` [B]
is the position id of each row's next token, `last` [B] the token to feed next. Positions are
passed explicitly, so leading columns that no row uses can be cut away without renumbering.

Everything here is synchronous and runs on the engine's single model thread. Deliberately
simplified: no prefix sharing between rows, no chunked prefill, full-attention layers only
(sliding-window caches are refused at load).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from megarl.rollout.protocol import FinishReason, GenerateOutput, GenerateRequest
from megarl.rollout.sampling import RowSampling, sample


@dataclass
class Sequence:
    """Engine-side state of one request, from admission until it is handed back."""

    request: GenerateRequest
    max_new_tokens: int  # the request's budget clamped to the context window
    stop_ids: frozenset[int]
    generator: torch.Generator
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list] = field(default_factory=list)  # [version, start, end)
    finish: FinishReason | None = None
    abort_message: str | None = None  # set from the event loop; honoured between steps

    @property
    def rid(self) -> str:
        return self.request.rid

    def prefill_ids(self) -> list[int]:
        # A retracted sequence re-enters with what it has generated so far.
        return self.request.input_ids + self.output_ids

    def append(self, token: int, logprob: float, version: str) -> None:
        i = len(self.output_ids)
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = i + 1
        else:
            self.spans.append([version, i, i + 1])
        sp = self.request.sampling
        n = len(self.output_ids)
        if token in self.stop_ids and n >= sp.min_new_tokens:
            self.finish = FinishReason("stop", matched=token)
        elif n >= self.max_new_tokens:
            self.finish = FinishReason("length", length=n)

    def output(self, current_version: str) -> GenerateOutput:
        finish = self.finish or FinishReason("abort", message=self.abort_message or "aborted")
        return GenerateOutput(
            rid=self.rid, prompt_tokens=len(self.request.input_ids),
            output_ids=list(self.output_ids),
            output_logprobs=list(self.logprobs) if self.request.return_logprob else None,
            finish_reason=finish,
            weight_version=self.spans[-1][0] if self.spans else current_version,
            weight_version_spans=[tuple(s) for s in self.spans],
            e2e_latency=time.monotonic() - self.arrival)


def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    extra = length - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class DecodeBatch:
    def __init__(self, model, device: torch.device):
        self.model = model
        self.device = device
        self.rows: list[Sequence] = []
        self.cache: DynamicCache | None = None
        self.mask = self.pos = self.last = None
        self._sampling: RowSampling | None = None
        self.vocab = model.config.get_text_config().vocab_size

    def __len__(self) -> int:
        return len(self.rows)

    # -- composition ------------------------------------------------------------------------
    def _restack_sampling(self) -> None:
        sps = [s.request.sampling for s in self.rows]
        self._sampling = RowSampling([p.temperature for p in sps], [p.top_p for p in sps],
                                     [p.top_k for p in sps], [p.min_p for p in sps],
                                     [s.generator for s in self.rows], self.device)

    def remove(self, keep_mask: list[bool]) -> None:
        """Drop rows whose flag is False from the cache; cut columns no row uses any more."""
        if all(keep_mask):
            return
        self.rows = [s for s, k in zip(self.rows, keep_mask) if k]
        if not self.rows:
            self.cache = self.mask = self.pos = self.last = self._sampling = None
            return
        idx = torch.tensor([i for i, k in enumerate(keep_mask) if k], device=self.device)
        self.mask, self.pos, self.last = self.mask[idx], self.pos[idx], self.last[idx]
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else self.mask.shape[1]
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, first:]
            layer.values = layer.values[idx, :, first:]
        self._restack_sampling()

    def _merge(self, cache: DynamicCache, mask, pos, last) -> None:
        if self.cache is None:
            self.cache, self.mask, self.pos, self.last = cache, mask, pos, last
            return
        length = max(self.mask.shape[1], mask.shape[1])
        self.mask = torch.cat([_left_pad(self.mask, length, 1), _left_pad(mask, length, 1)])
        for mine, new in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, length, 2), _left_pad(new.keys, length, 2)])
            mine.values = torch.cat([_left_pad(mine.values, length, 2),
                                     _left_pad(new.values, length, 2)])
        self.pos = torch.cat([self.pos, pos])
        self.last = torch.cat([self.last, last])

    # -- compute ----------------------------------------------------------------------------
    def _banned(self, rows: list[Sequence]) -> torch.Tensor | None:
        # Stop tokens may not end a sequence before its min_new_tokens.
        young = [(i, s) for i, s in enumerate(rows)
                 if len(s.output_ids) < s.request.sampling.min_new_tokens and s.stop_ids]
        if not young:
            return None
        banned = torch.zeros(len(rows), self.vocab, dtype=torch.bool, device=self.device)
        for i, s in young:
            banned[i, [t for t in s.stop_ids if t < self.vocab]] = True
        return banned

    def _emit(self, rows, logits, sampling, version) -> None:
        tokens, logprobs = sample(logits, sampling, self._banned(rows))
        for s, t, lp in zip(rows, tokens.tolist(), logprobs.tolist()):
            s.append(t, lp, version)
        return tokens

    def admit(self, seqs: list[Sequence], version: str) -> None:
        """Prefill `seqs`, sample each one's next token, merge them into the batch.

        Prefill runs in chunks of similar length: a resumed request (prompt + hundreds of
        tokens generated before an abort) padded together with fresh short prompts would
        spend most of the prefill's compute on padding."""
        chunk: list[Sequence] = []
        for s in sorted(seqs, key=lambda q: len(q.prefill_ids())):
            if chunk and len(s.prefill_ids()) > 1.5 * len(chunk[0].prefill_ids()) + 16:
                self._admit_chunk(chunk, version)
                chunk = []
            chunk.append(s)
        if chunk:
            self._admit_chunk(chunk, version)

    @torch.inference_mode()
    def _admit_chunk(self, seqs: list[Sequence], version: str) -> None:
        prompts = [s.prefill_ids() for s in seqs]
        length = max(len(p) for p in prompts)
        ids = torch.zeros(len(seqs), length, dtype=torch.long)
        mask = torch.zeros(len(seqs), length, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, length - len(p):] = torch.tensor(p)
            mask[i, length - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        # The same position ids transformers' generate gives a left-padded batch.
        positions = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        sampling = RowSampling([s.request.sampling.temperature for s in seqs],
                               [s.request.sampling.top_p for s in seqs],
                               [s.request.sampling.top_k for s in seqs],
                               [s.request.sampling.min_p for s in seqs],
                               [s.generator for s in seqs], self.device)
        tokens = self._emit(seqs, out.logits[:, -1], sampling, version)
        self._merge(out.past_key_values, mask, mask.sum(-1), tokens)
        self.rows.extend(seqs)
        self._restack_sampling()

    @torch.inference_mode()
    def decode(self, version: str) -> None:
        """One more token for every row (finished rows must have been taken out first)."""
        ones = torch.ones(len(self.rows), 1, dtype=self.mask.dtype, device=self.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        out = self.model(input_ids=self.last.unsqueeze(-1), attention_mask=self.mask,
                         position_ids=self.pos.unsqueeze(-1), past_key_values=self.cache,
                         use_cache=True)
        self.last = self._emit(self.rows, out.logits[:, -1], self._sampling, version)
        self.pos = self.pos + 1

    def take_finished(self) -> list[Sequence]:
        """Remove and return finished or abort-flagged rows (their outputs are complete)."""
        done = [s.finish is not None or s.abort_message is not None for s in self.rows]
        out = [s for s, d in zip(self.rows, done) if d]
        self.remove([not d for d in done])
        return out

    def take_all(self) -> list[Sequence]:
        out, self.rows = self.rows, []
        self.cache = self.mask = self.pos = self.last = self._sampling = None
        return out
