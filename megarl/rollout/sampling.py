"""Token sampling and behaviour log-probs for a batch of rows with per-row parameters.

Owns the one place where logits become tokens. Each row carries its own temperature, top-p,
top-k, min-p and `torch.Generator`, so a seeded request draws the same tokens whichever other
requests share its batch (given the same logits). The log-prob returned for a token is that of
the untruncated tempered distribution (see megarl.rollout.protocol).

Drawing uses one uniform number per row and an inverse CDF over the (truncated) distribution,
which keeps the per-row generator cost to a single `torch.rand` call.
"""
from __future__ import annotations

import torch


class RowSampling:
    """Per-row sampling settings, stacked once per batch composition (not once per step)."""

    def __init__(self, temperature, top_p, top_k, min_p, generators, device):
        self.device = device
        self.n = len(temperature)
        t = torch.tensor(temperature, dtype=torch.float32, device=device)
        self.greedy = (t < 1e-5) | (torch.tensor(top_k, device=device) == 1)
        self.all_greedy = bool(self.greedy.all())
        # Greedy rows report temperature-1 log-probs (SGLang's convention).
        self.temperature = torch.where(self.greedy, torch.ones_like(t), t).unsqueeze(-1)
        self.top_p = torch.tensor(top_p, dtype=torch.float32, device=device).unsqueeze(-1)
        self.top_k = torch.tensor(top_k, dtype=torch.long, device=device)
        self.min_p = torch.tensor(min_p, dtype=torch.float32, device=device).unsqueeze(-1)
        self.needs_truncation = bool(((self.top_p < 1).any() | (self.top_k > 0).any()
                                      | (self.min_p > 0).any()))
        self.generators = generators

    def uniforms(self) -> torch.Tensor:
        u = [torch.rand(1, generator=g, device=g.device) for g in self.generators]
        return torch.cat(u).to(self.device)


def _truncate(probs: torch.Tensor, s: RowSampling) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p and min-p exclude (not renormalized)."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
    k = torch.where(s.top_k > 0, s.top_k, torch.full_like(s.top_k, vocab)).unsqueeze(-1)
    drop = rank >= k
    # Top-p keeps the smallest prefix whose mass reaches p: drop a token when the mass before
    # it already does. The first token always survives.
    before = sorted_p.cumsum(dim=-1) - sorted_p
    drop |= before >= s.top_p
    drop |= sorted_p < s.min_p * sorted_p[:, :1]
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)


def sample(logits: torch.Tensor, s: RowSampling, banned: torch.Tensor | None = None):
    """logits [B, V] (float32) -> (tokens [B] long, logprobs [B] float32).

    `banned` [B, V] bool masks tokens a row may not produce yet (stop tokens before
    min_new_tokens). The log-prob is the drawn token's under the tempered distribution the
    draw was made from, the ban included (renormalised), as stock SGLang reports it (its
    min-new-tokens penalty acts on the logits before its log-softmax): the behaviour policy's
    own probability, which the importance weights against the trainer's need.
    """
    logits = logits.float()
    logp_all = torch.log_softmax(logits / s.temperature, dim=-1)
    masked = logp_all
    if banned is not None:
        masked = logp_all.masked_fill(banned, float("-inf"))
        logp_all = masked = masked - masked.logsumexp(dim=-1, keepdim=True)
    greedy_tokens = masked.argmax(dim=-1)
    if s.all_greedy:
        tokens = greedy_tokens
    else:
        probs = masked.exp()
        if s.needs_truncation:
            probs = _truncate(probs, s)
        cdf = probs.cumsum(dim=-1)
        u = s.uniforms().unsqueeze(-1) * cdf[:, -1:]
        # right=True lands on the first token whose cumulative mass exceeds u: never a token
        # with zero probability, since the CDF is flat across those.
        drawn = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
        tokens = torch.where(s.greedy, greedy_tokens, drawn)
    logprobs = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs
