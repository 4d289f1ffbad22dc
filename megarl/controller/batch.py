"""From finished rollouts to the trainer's batch: token alignment, masks, behaviour log-probs.

A training row is [prompt | response | pad] (right padding, so a causal mask alone keeps real
tokens from seeing pads). Every per-token tensor is aligned with `input_ids`: position t holds
the quantity for token t — the trainer's `logprobs[t] = log p(input_ids[t] | <t)` and the
rollout engine's own log-prob of response token t (the behaviour policy). `response_mask`
is 1 exactly on the response tokens the model generated, so prompt, padding and what a
multi-turn loop appended (tool answers: `Sample.loss_mask` 0) never enter a loss, a KL, an
entropy or a normaliser.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch


@dataclasses.dataclass
class StepRecord:
    """What one training step's states produce, filled in their order (controller/steps.py);
    the Pipeline keeps one per step in flight, from GENERATE until the step's last state.

    GENERATE's start sets `resume_before` (where a checkpoint taken before this step resumes:
    the loader position and the partial-rollout cache before its prompts), then `samples`,
    `scores` (the streaming reward's pending results), `dropped` (too stale), `filtered`
    and `surplus` (dynamic sampling: no spread, or kept beyond the batch); REWARD builds `batch`,
    the tensors REF_LOGP, VALUES and LOGP add to (`ref_logprobs`, `values`, `old_logprobs`)
    and TRAIN reads, with `advantages` (and `returns`) computed at its start. When SYNC has
    finished, the data is released and, with a checkpoint due, `resume_after` holds what
    CHECKPOINT writes for a resume."""
    step: int
    resume_before: dict
    samples: list["Sample"] = dataclasses.field(default_factory=list)
    scores: list = dataclasses.field(default_factory=list)
    dropped: list[str] = dataclasses.field(default_factory=list)
    filtered: list[str] = dataclasses.field(default_factory=list)
    surplus: list[str] = dataclasses.field(default_factory=list)
    batch: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    resume_after: dict | None = None

    def release(self) -> None:
        """Drop the step's data (trained and published): only the resume state may be owed."""
        self.samples, self.scores, self.batch = [], [], {}


@dataclasses.dataclass
class Sample:
    """One generated response with everything the later states attach to it."""
    uid: str                      # the prompt's id: GRPO groups samples by it
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    weight_version: int           # weights that produced the first response token
    token_versions: list[int]     # per response token (a sync may land mid-request)
    finish: str
    ground_truth: Any = None
    data_source: str = ""
    response_text: str = ""
    reward: float = 0.0           # what trains: the score plus any overlong penalty
    score: float | None = None    # the reward function's own score (verl's "acc")
    baseline: float | None = None  # remax: the reward of the prompt's greedy response
    # the other numbers of a reward function's returned dict (verl's reward_extra_info; GDPO's
    # components); None: the call failed and scored reward.failure_score
    reward_extra: dict | None = dataclasses.field(default_factory=dict)
    extra_info: dict = dataclasses.field(default_factory=dict)  # the prompt's, for rewards
    # multi-turn: 1 on the model's own tokens, 0 on what the agent loop appended (tool
    # answers, template); None: every response token is the model's
    loss_mask: list[int] | None = None
    agent: dict | None = None     # multi-turn: turns, tool calls and their answers
    # routing replay: the experts the engine routed positions 0 .. len(prompt + response)
    # - 2 to, [positions, layers, k] (numpy int16); None without it
    routed_experts: Any = None


def build_batch(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    if not samples:
        raise ValueError("build_batch: no samples")
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    S = max(lengths)
    B = len(samples)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    attention = torch.zeros(B, S, dtype=torch.long)
    response = torch.zeros(B, S, dtype=torch.float32)
    rollout_lp = torch.zeros(B, S, dtype=torch.float32)
    versions = torch.zeros(B, S, dtype=torch.long)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, :p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attention[i, :p + r] = 1
        response[i, p:p + r] = 1.0 if s.loss_mask is None else torch.tensor(
            s.loss_mask[:r], dtype=torch.float32)
        if r:
            rollout_lp[i, p:p + r] = torch.tensor(s.rollout_logprobs[:r], dtype=torch.float32)
            versions[i, p:p + r] = torch.tensor(s.token_versions[:r] or [s.weight_version] * r)
    out = {"input_ids": input_ids, "attention_mask": attention, "response_mask": response,
           "rollout_logprobs": rollout_lp, "token_versions": versions,
           "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32)}
    if all(s.baseline is not None for s in samples):  # remax
        out["reward_baselines"] = torch.tensor([s.baseline for s in samples],
                                               dtype=torch.float32)
    routed = [s.routed_experts for s in samples]
    if any(r is not None for r in routed):
        out["routed_experts"] = _routed_experts(routed, S)
    return out


def _routed_experts(routed: list, S: int) -> torch.Tensor:
    """[B, S, layers, k] int16: each sample's engine routing at its positions; experts
    0..k-1 where the engine ran none (each sequence's last token, padding): their outputs
    feed no log-prob that is used, and a router needs k distinct experts everywhere."""
    shape = next(r.shape for r in routed if r is not None)[1:]
    if any(r is None or r.shape[1:] != shape for r in routed):
        raise ValueError("build_batch: routed experts missing or shaped differently for some "
                         "samples of the batch")
    layers, k = shape
    out = torch.arange(k, dtype=torch.int16).expand(len(routed), S, layers, k).clone()
    for i, r in enumerate(routed):
        out[i, :len(r)] = torch.from_numpy(np.asarray(r, dtype=np.int16))
    return out


def mini_batches(batch: dict, n_samples_per_prompt: int, prompts_per_mini: int,
                 epochs: int = 1) -> list[dict]:
    """Split a step's batch into optimizer mini-batches of whole prompt groups."""
    B = batch["input_ids"].shape[0]
    size = max(1, prompts_per_mini * n_samples_per_prompt)
    out = []
    for _ in range(epochs):
        for a in range(0, B, size):
            out.append({k: v[a:a + size] for k, v in batch.items() if torch.is_tensor(v)})
    return out

