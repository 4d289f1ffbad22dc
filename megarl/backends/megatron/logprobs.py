"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocab.

Each TP rank holds logits for its slice [start, end) of the padded vocabulary. Log-softmax
needs only two scalars per token from every rank (a max and a sum of exponentials), and the
target's logit from the one rank that owns it, so the full vocabulary never sits on one rank.

Distribution: softmax(logits / temperature) over the model's real vocabulary (padded columns
are masked out). This is the distribution the rollout engine reports for sampled tokens at the
same temperature, before top-p/top-k truncation, so the two can be compared token by token.

Gradients: the reductions use Megatron's `reduce_from_tensor_model_parallel_region` (all-reduce
forward, identity backward), which is correct because every TP rank computes the same loss.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _tp():
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group())


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                            temperature: float = 1.0, with_entropy: bool = False):
    """logits [..., V_local] (this rank's vocab slice), targets [...] global token ids.

    Returns (logprobs [...], entropy [...] or None), in float32.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    tp, rank, group = _tp()
    local_v = logits.shape[-1]
    start = rank * local_v
    z = logits.float() / temperature
    # Mask the padded vocabulary tail so it carries no probability mass.
    n_real = max(0, min(local_v, vocab_size - start))
    if n_real < local_v:
        z = torch.cat([z[..., :n_real],
                       torch.full_like(z[..., n_real:], float("-inf"))], dim=-1)

    # The max is only a numerical shift: no gradient flows through it.
    m = z.detach().max(dim=-1).values
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = z - m.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    local_t = targets - start
    owned = (local_t >= 0) & (local_t < local_v)
    picked = shifted.gather(-1, local_t.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    if tp > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
        picked = reduce_from_tensor_model_parallel_region(picked)
    log_z = sum_exp.log()
    logp = picked - log_z
    entropy = None
    if with_entropy:
        p = (shifted - log_z.unsqueeze(-1)).exp()
        # H = log Z - E_p[shifted]. Masked columns have p = 0 and shifted = -inf: zero them
        # *before* the product, or backward computes -inf * 0 = NaN through the masked branch.
        finite = torch.where(torch.isfinite(shifted), shifted, torch.zeros_like(shifted))
        p_dot = (p * finite).sum(dim=-1)
        if tp > 1:
            p_dot = reduce_from_tensor_model_parallel_region(p_dot)
        entropy = log_z - p_dot
    return logp, entropy
