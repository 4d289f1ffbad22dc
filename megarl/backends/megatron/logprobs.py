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

    if not ps.model_parallel_is_initialized():
        return 1, 0, None  # no Megatron groups (a tool, a unit test): one rank, whole vocab
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
        # H = log Z - E_p[shifted], E_p[shifted] = sum(exp(shifted) * shifted) / sum_exp.
        # Both sums are reduced over TP before the division: a rank's own terms are then all
        # that its logits' gradient needs (the reduction's backward is the identity). Dividing
        # each rank's share by the global sum first would leave out the other ranks' terms of
        # d(sum p * shifted)/d log Z. Masked columns have exp = 0 and shifted = -inf: zero them
        # *before* the product, or backward computes -inf * 0 = NaN through the masked branch.
        finite = torch.where(torch.isfinite(shifted), shifted, torch.zeros_like(shifted))
        w = (shifted.exp() * finite).sum(dim=-1)
        if tp > 1:
            w = reduce_from_tensor_model_parallel_region(w)
        entropy = log_z - w / sum_exp
    return logp, entropy


# --------------------------------------------------------------------- chunked over tokens
# The path above builds several fp32 [tokens, V_local] tensors (the upcast, the shifted
# logits, their exponentials, the probabilities) and autograd keeps most of them for backward:
# at 4k tokens and V = 151,936 each is 2.5 GB. The path below never holds more than one
# chunk's fp32 [chunk, V_local] at a time: forward reduces each chunk to per-token scalars,
# and backward recomputes each chunk's softmax from the logits it saved (which the model's
# output layer holds anyway) and writes that chunk's gradient.

def _blocks(logits: torch.Tensor) -> list[torch.Tensor]:
    """[..., V] as 2-D [rows, V] views with no copy: one view when the leading dims merge
    (contiguous, or a [1, S-1, V] slice), else one per leading index (a [b, S-1, V] slice)."""
    v = logits.shape[-1]
    try:
        return [logits.view(-1, v)]
    except RuntimeError:
        return [blk for row in logits.reshape(-1, *logits.shape[-2:]).unbind(0)
                for blk in _blocks(row)] if logits.dim() > 2 else [logits.contiguous()]


def _chunks(logits: torch.Tensor, chunk: int):
    """(flat token offset, [n, V] view) over every token of `logits`, `chunk` tokens at most."""
    off = 0
    for blk in _blocks(logits):
        for i in range(0, blk.shape[0], chunk):
            part = blk[i:i + chunk]
            yield off + i, part
        off += blk.shape[0]


def _scaled(part: torch.Tensor, temperature: float, n_real: int) -> torch.Tensor:
    """A chunk's fp32 logits / temperature, the padded vocabulary tail at -inf."""
    z = part.float() / temperature
    if n_real < z.shape[-1]:
        z[:, n_real:] = float("-inf")
    return z


class _ChunkedLogprobs(torch.autograd.Function):
    """(logp, entropy) per token of vocab-parallel logits, `chunk` tokens at a time; backward
    recomputes each chunk's softmax. Every TP rank computes the same loss, so each rank's
    logit gradient is its own columns' share, with no collective in backward."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, n_real, start, with_entropy, chunk,
                group, tp):
        ctx.set_materialize_grads(False)
        n = targets.numel()
        flat_t = targets.reshape(-1)
        local_v = logits.shape[-1]
        dev = logits.device
        m_loc = torch.full((n,), float("-inf"), device=dev)
        stats = torch.zeros(3, n, device=dev)  # sum exp(z - m_loc), target z, sum exp(z-m_loc) z
        if n_real > 0:
            for off, part in _chunks(logits, chunk):
                sl = slice(off, off + part.shape[0])
                z = _scaled(part, temperature, n_real)
                m = z.max(dim=-1).values
                e = (z - m.unsqueeze(-1)).exp_()
                m_loc[sl] = m
                stats[0, sl] = e.sum(-1)
                t = flat_t[sl] - start
                owned = (t >= 0) & (t < local_v)
                picked = z.gather(-1, t.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1)
                stats[1, sl] = torch.where(owned, picked, torch.zeros_like(picked))
                if with_entropy:
                    z[:, n_real:] = 0.0  # p = 0 there: 0, not -inf, in the product
                    stats[2, sl] = z.mul_(e).sum(-1)  # in place: two chunk-sized tensors
                del z, e
        m = m_loc.clone()
        if tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        # each rank's sums rescaled from its own max to the global one (log-sum-exp)
        scale = torch.where(torch.isfinite(m_loc), (m_loc - m).exp(), torch.zeros_like(m))
        stats[0].mul_(scale)
        stats[2].mul_(scale)
        if tp > 1:
            dist.all_reduce(stats, group=group)
        log_z = m + stats[0].log()
        logp = stats[1] - log_z
        mean_z = stats[2] / stats[0]  # E_p[z]
        ent = log_z - mean_z if with_entropy else logp.new_zeros(0)
        ctx.save_for_backward(logits, flat_t, log_z, mean_z)
        ctx.args = (temperature, n_real, start, chunk)
        return logp.view(targets.shape), ent.view(targets.shape) if with_entropy else ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, flat_t, log_z, mean_z = ctx.saved_tensors
        temperature, n_real, start, chunk = ctx.args
        # contiguous, so a token's flat index is its row in `flat` whatever the logits' strides
        grad = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
        if n_real == 0 or (g_logp is None and g_ent is None):
            return (grad,) + (None,) * 8
        local_v = logits.shape[-1]
        g_logp = g_logp.reshape(-1) if g_logp is not None else None
        g_ent = g_ent.reshape(-1) if g_ent is not None else None
        flat = grad.view(-1, local_v)
        for off, part in _chunks(logits, chunk):
            sl = slice(off, off + part.shape[0])
            # two chunk-sized fp32 tensors at most: z, turned in place into the gradient, and p
            z = _scaled(part, temperature, n_real)
            p = (z - log_z[sl].unsqueeze(-1)).exp_()
            if g_ent is not None:
                # dH/dz_j = -p_j (z_j - E_p[z]); padded columns have p = 0
                z[:, n_real:] = 0.0
                gz = z.sub_(mean_z[sl].unsqueeze(-1)).mul_(p).mul_(-g_ent[sl].unsqueeze(-1))
            else:
                gz = z.zero_()
            if g_logp is not None:
                # dlogp/dz_j = [j = target] - p_j
                gz.addcmul_(p, g_logp[sl].unsqueeze(-1), value=-1.0)
                t = flat_t[sl] - start
                owned = (t >= 0) & (t < local_v)
                gz.scatter_add_(-1, t.clamp(0, local_v - 1).unsqueeze(-1),
                                torch.where(owned, g_logp[sl], torch.zeros_like(g_logp[sl]))
                                .unsqueeze(-1))
            flat[sl] = gz.div_(temperature)
            del z, p, gz
        return (grad,) + (None,) * 8


def chunked_vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                                    vocab_size: int, temperature: float = 1.0,
                                    with_entropy: bool = False, chunk_size: int = 2048):
    """`vocab_parallel_logprobs`, equal to it, holding one chunk of `chunk_size` tokens'
    fp32 logits at a time in forward and in backward (which recomputes the chunk's softmax)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    tp, rank, group = _tp()
    local_v = logits.shape[-1]
    start = rank * local_v
    n_real = max(0, min(local_v, vocab_size - start))
    logp, ent = _ChunkedLogprobs.apply(logits, targets, float(temperature), n_real, start,
                                       bool(with_entropy), int(chunk_size), group, tp)
    return logp, ent if with_entropy else None


def token_logprobs(logits, targets, vocab_size, temperature=1.0, with_entropy=False,
                   chunk_size: int | None = None):
    """The chunked path when `chunk_size` is set (verl's
    `entropy_from_logits_with_chunking` / `entropy_from_logits_chunk_size`), else the plain
    one."""
    if chunk_size:
        return chunked_vocab_parallel_logprobs(logits, targets, vocab_size, temperature,
                                               with_entropy, chunk_size)
    return vocab_parallel_logprobs(logits, targets, vocab_size, temperature, with_entropy)
