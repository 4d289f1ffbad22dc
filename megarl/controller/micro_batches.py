"""Each model pass's micro-batching from the run config: rows per micro-batch, or a token
budget (verl's ``use_dynamic_bsz`` keys; the log-prob passes' and the critic's nulls follow the
actor's), and what that means for the largest micro-batch (the memory estimate)."""
from __future__ import annotations

from megarl.backends.megatron.packing import TokenBudget
from megarl.backends.megatron.packing import micro_batching as of

def micro_batching(cfg, role: str):
    """What one pass's micro-batches are (`megarl.backends.megatron.packing.micro_batching`):
    rows, or a token budget (verl's ``use_dynamic_bsz`` keys, nulls following the actor's).
    `role`: actor (training), logp, ref, critic (training) or values."""
    arr = cfg.actor_rollout_ref
    a = arr.actor
    follow = lambda v, default: default if v is None else v  # noqa: E731
    if role == "actor":
        return of(a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu)
    if role in ("logp", "ref"):
        sec = arr.rollout if role == "logp" else arr.ref
        return of(sec.log_prob_micro_batch_size_per_gpu,
                  follow(sec.log_prob_use_dynamic_bsz, a.use_dynamic_bsz),
                  follow(sec.log_prob_max_token_len_per_gpu, a.ppo_max_token_len_per_gpu))
    c = cfg.critic
    dynamic = follow(c.use_dynamic_bsz, a.use_dynamic_bsz)
    train_tokens = follow(c.ppo_max_token_len_per_gpu, a.ppo_max_token_len_per_gpu)
    if role == "critic":
        return of(c.ppo_micro_batch_size_per_gpu, dynamic, train_tokens)
    if role == "values":
        return of(c.forward_micro_batch_size_per_gpu or c.ppo_micro_batch_size_per_gpu, dynamic,
                  follow(c.forward_max_token_len_per_gpu, train_tokens))
    raise ValueError(f"micro_batching: unknown role {role!r}")


def micro_batch_tokens(cfg, role: str, cp: int = 1) -> int:
    """Token slots one rank holds of the largest micro-batch of `role`'s pass: rows × the
    padded width, or the token budget (a single sequence longer than the budget goes alone,
    so at least the width); under context parallelism (`cp` ranks) each rank holds 1/CP of
    the sequences, and the budget counts per CP rank."""
    width = cfg.data.max_prompt_length + cfg.data.max_response_length
    micro = micro_batching(cfg, role)
    if isinstance(micro, TokenBudget):
        return max(micro.max_tokens, -(-width // cp))
    return -(-micro * width // cp)
