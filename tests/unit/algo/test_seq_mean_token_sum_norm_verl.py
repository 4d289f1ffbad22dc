"""``seq-mean-token-sum-norm`` is verl 0.9.1's definition (verl/trainer/ppo/core_algos.py,
``agg_loss``, lines 1181-1193 of the 0.9.1 wheel):

    row_sum_i = sum_t v[i,t] m[i,t]; the sequences are the rows with >= 1 valid token;
    loss = (sum of row_sum_i over the sequences) / global_batch_size * dp_size / C

with global_batch_size the number of sequences of the whole (global) batch and C the
``loss_scale_factor`` (fallback: the padded width mask.shape[-1]). On the whole batch that is
sum_{i,t} v m / (N_seq * C): the mean over sequences of each sequence's token sum, divided by
C. (Older verl releases divided the plain sum by C alone, N_seq times this.) Hand-computed
values below, then a closed form of the formula above (written here, not copied) against
micro-batch and data-parallel splits of random batches."""
import math

import pytest
import torch
from omegaconf import OmegaConf

from megarl.algo.actor_loss import ActorLossSettings, make_actor_loss
from megarl.algo.aggregate import aggregate, global_denom, stats_mode
from megarl.algo.value_loss import make_critic_loss_for_batch, value_loss
from megarl.config.schema import ActorConfig

MODE = "seq-mean-token-sum-norm"
X = 100.0  # junk off the mask

# rows: 3 valid tokens, 2 valid tokens, none (padding), 1 valid token -> N_seq = 3, width 4
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]],
                    dtype=torch.float32)
VALS = torch.tensor([[1.0, 2.0, 3.0, X], [5.0, 6.0, X, X], [X, X, X, X], [7.0, X, X, X]])
# row sums 6, 11, 7 (the padding row is no sequence): total 24


def _verl_091(values, mask, c, global_batch_size=None, dp_size=1):
    """verl 0.9.1's seq-mean-token-sum-norm (core_algos.py:1181-1193) in closed form, for one
    call of its agg_loss on a micro-batch: the valid rows' token sums, summed, over the
    global sequence count (this call's own when None), times dp_size, over c."""
    row_sums = (values * mask).sum(-1)
    is_seq = mask.sum(-1) > 0
    n = float(is_seq.sum()) if global_batch_size is None else global_batch_size
    return row_sums[is_seq].sum() / n * dp_size / c


def test_hand_value_and_gradient_on_a_ragged_mask():
    # C = 4 (the fallback: padded width): 24 / (3 sequences * 4) = 2
    assert global_denom(MASK, MODE) == 3 * 4
    v = VALS.clone().requires_grad_(True)
    out = aggregate(v, MASK, MODE)
    torch.testing.assert_close(out, torch.tensor(2.0))
    (grad,) = torch.autograd.grad(out, v)
    torch.testing.assert_close(grad, MASK / 12)  # d/dv[i,t] = m[i,t] / (N_seq * C)
    # C = 8 given: 24 / (3 * 8) = 1; the pre-0.9.1 formula (sum / C) would give 24 / 8 = 3
    assert global_denom(MASK, MODE, loss_scale_factor=8) == 24.0
    out = aggregate(VALS, MASK, MODE, denom=global_denom(MASK, MODE, 8))
    torch.testing.assert_close(out, torch.tensor(1.0))
    torch.testing.assert_close(out, _verl_091(VALS, MASK, 8))
    # all-masked rows count nowhere; an all-masked batch gives 0 (D = max(1, 0) * C)
    assert global_denom(torch.zeros(2, 4), MODE, 8) == 8.0
    assert aggregate(VALS[:2], torch.zeros(2, 4), MODE) == 0


def test_hand_micro_batch_shares_sum_to_the_batch():
    # denom of the whole batch: 3 * 8 = 24; shares 6/24, (11 + padding)/24, 7/24 -> 1
    denom = global_denom(MASK, MODE, 8)
    shares = [aggregate(VALS[s], MASK[s], MODE, denom)
              for s in (slice(0, 1), slice(1, 3), slice(3, 4))]
    torch.testing.assert_close(torch.stack(shares), torch.tensor([6 / 24, 11 / 24, 7 / 24]))
    torch.testing.assert_close(sum(shares), torch.tensor(1.0))
    # verl: each micro-batch's agg_loss with the global sequence count, summed
    for s, share in zip((slice(0, 1), slice(1, 3), slice(3, 4)), shares):
        torch.testing.assert_close(share, _verl_091(VALS[s], MASK[s], 8, global_batch_size=3))


def test_hand_dp_shards_with_unequal_sequence_counts_average_to_the_batch():
    # dp_size = 2: shard A = rows 0-2 (2 sequences, sum 17), shard B = row 3 (1 sequence, 7);
    # each normalised by D / 2 = 3 * 8 / 2 = 12: 17/12 and 7/12, average 24/24 = 1
    d = global_denom(MASK, MODE, 8, dp_size=2)
    assert d == 12.0
    a = aggregate(VALS[:3], MASK[:3], MODE, d)
    b = aggregate(VALS[3:], MASK[3:], MODE, d)
    torch.testing.assert_close(a, torch.tensor(17 / 12))
    torch.testing.assert_close(b, torch.tensor(7 / 12))
    torch.testing.assert_close((a + b) / 2, torch.tensor(1.0))
    torch.testing.assert_close(a, _verl_091(VALS[:3], MASK[:3], 8, 3, dp_size=2))
    torch.testing.assert_close(b, _verl_091(VALS[3:], MASK[3:], 8, 3, dp_size=2))
    # normalising each shard by its own count would not: (17/16 + 7/8) / 2 = 31/32
    own = (aggregate(VALS[:3], MASK[:3], MODE, global_denom(MASK[:3], MODE, 8))
           + aggregate(VALS[3:], MASK[3:], MODE, global_denom(MASK[3:], MODE, 8))) / 2
    torch.testing.assert_close(own, torch.tensor(31 / 32))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_closed_form_on_random_batches_micro_batches_and_dp(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, c = 8, 6, 5.0
    vals = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.4).float()
    mask[1] = 0
    mask[6] = 0
    n_seq = int((mask.sum(-1) > 0).sum())
    whole = aggregate(vals, mask, MODE, global_denom(mask, MODE, c))
    torch.testing.assert_close(whole, (vals * mask).sum() / (n_seq * c))
    torch.testing.assert_close(whole, _verl_091(vals, mask, c))
    # 2 replicas (rows 0-4, 5-7), each in micro-batches, normalised by D / 2
    d = global_denom(mask, MODE, c, dp_size=2)
    reps = []
    for micro in ([slice(0, 2), slice(2, 5)], [slice(5, 6), slice(6, 8)]):
        mine = sum(aggregate(vals[s], mask[s], MODE, d) for s in micro)
        ref = sum(_verl_091(vals[s], mask[s], c, n_seq, dp_size=2) for s in micro)
        torch.testing.assert_close(mine, ref)
        reps.append(mine)
    torch.testing.assert_close((reps[0] + reps[1]) / 2, whole)


# --- value loss ------------------------------------------------------------------------------
# v = 0 = v_old (the clip is inactive), returns R: per token (v - R)^2 = R^2
RETURNS = torch.tensor([[1.0, 1.0, 2.0, X], [2.0, 1.0, X, X], [X, X, X, X], [3.0, X, X, X]])
# row sums of R^2: 6, 5, 9 -> 20; vf_loss = 0.5 * 20 / (3 * C)


def test_value_loss_hand_value_gradient_and_dp():
    v = torch.zeros(4, 4, requires_grad=True)
    loss, st = value_loss(v, torch.zeros(4, 4), RETURNS, MASK, 0.5, MODE,
                          denom=global_denom(MASK, MODE, 4),
                          stats_denom=global_denom(MASK, stats_mode(MODE)))
    torch.testing.assert_close(loss, torch.tensor(0.5 * 20 / 12))
    (grad,) = torch.autograd.grad(loss, v)
    # d/dv 0.5 (v - R)^2 / 12 = (v - R) / 12 on valid tokens
    torch.testing.assert_close(grad, -RETURNS * MASK / 12)
    torch.testing.assert_close(st["vf_clipfrac"], torch.tensor(0.0))
    # vpred_mean is a per-sequence mean over the 3 sequences: 0
    torch.testing.assert_close(st["vpred_mean"], torch.tensor(0.0))
    # the worker's path: C = max_response_length 4, dp_size 2, shards rows 0-2 and 3
    fn = make_critic_loss_for_batch(0.5, MODE, MASK, dp_size=2, loss_scale_factor=4)
    shards = []
    for s in (slice(0, 3), slice(3, 4)):
        vs = torch.zeros(s.stop - s.start, 4, requires_grad=True)
        out, m = fn(vs, {"values": torch.zeros_like(vs), "returns": RETURNS[s],
                         "response_mask": MASK[s]})
        shards.append(out)
    # shard A: 0.5 * 11 / 6, shard B: 0.5 * 9 / 6 (D / 2 = 3 * 4 / 2 = 6)
    torch.testing.assert_close(shards[0], torch.tensor(0.5 * 11 / 6))
    torch.testing.assert_close(shards[1], torch.tensor(0.5 * 9 / 6))
    torch.testing.assert_close((shards[0] + shards[1]) / 2, torch.tensor(0.5 * 20 / 12))


# --- policy loss -------------------------------------------------------------------------------
# ratios (eps 0.2) and advantages per row; the padding row holds junk
RATIOS = torch.tensor([[1.0, 1.1, 1.5, 7.0], [0.9, 1.0, 7.0, 7.0], [7.0] * 4, [0.5, 7.0, 7.0, 7.0]])
ADV = torch.tensor([1.0, -1.0, 5.0, 2.0])
# per token max(-A r, -A clip(r)): row 0 (A=+1): -1.0, -1.1, -1.2 (clipped, no gradient);
# row 1 (A=-1): 0.9, 1.0; row 3 (A=2): max(-1.0, -1.6) = -1.0. Sum -2.4; d/dlogp = -A r on
# the unclipped tokens.
PG_SUM = -2.4
PG_GRAD = torch.tensor([[-1.0, -1.1, 0.0, 0.0], [0.9, 1.0, 0.0, 0.0], [0.0] * 4,
                        [-1.0, 0.0, 0.0, 0.0]])


def _policy_batch():
    old = torch.full((4, 4), math.log(0.1))
    logp = (old + RATIOS.log()).requires_grad_(True)
    return logp, {"response_mask": MASK, "advantages": ADV, "old_logprobs": old}


@pytest.mark.parametrize("scale,max_len,c", [(None, 4, 4.0), (8.0, 4, 8.0)])
def test_policy_loss_hand_value_gradient_and_metrics(scale, max_len, c):
    """From the config: a null loss_scale_factor is max_response_length (the default,
    Dr. GRPO's sum / (N_seq * max length)); entropy is aggregated like the loss."""
    cfg = OmegaConf.structured(ActorConfig)
    cfg.loss_agg_mode, cfg.loss_scale_factor, cfg.entropy_coeff = MODE, scale, 0.1
    settings = ActorLossSettings.from_config(cfg, max_response_length=max_len)
    assert settings.loss_scale_factor == c
    logp, mb = _policy_batch()
    fn = settings.make(denom=global_denom(MASK, MODE, settings.loss_scale_factor),
                       stats_denom=global_denom(MASK, stats_mode(MODE)))
    ent = torch.ones(4, 4)  # token entropies 1: sum over the 6 valid tokens = 6
    loss, m = fn(logp, ent, mb)
    d = 3 * c
    torch.testing.assert_close(m["actor/pg_loss"], torch.tensor(PG_SUM / d))
    torch.testing.assert_close(m["actor/entropy"], torch.tensor(6 / d))
    torch.testing.assert_close(loss, torch.tensor(PG_SUM / d - 0.1 * 6 / d))
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, PG_GRAD / d)
    # diagnostics stay per-sequence means over the 3 sequences, whatever C
    torch.testing.assert_close(m["actor/pg_clipfrac"], torch.tensor((1 / 3 + 0 + 0) / 3))
    torch.testing.assert_close(m["actor/ratio_mean"],
                               torch.tensor(((1.0 + 1.1 + 1.5) / 3 + 0.95 + 0.5) / 3))


def test_policy_loss_micro_batches_and_dp_shards():
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode=MODE, entropy_coeff=0.0)
    logp, mb = _policy_batch()
    whole, _ = make_actor_loss(**kw, denom=global_denom(MASK, MODE, 4),
                               stats_denom=global_denom(MASK, stats_mode(MODE)))(logp, None, mb)
    torch.testing.assert_close(whole, torch.tensor(PG_SUM / 12))
    fn = make_actor_loss(**kw, denom=global_denom(MASK, MODE, 4, dp_size=2),
                         stats_denom=global_denom(MASK, stats_mode(MODE), dp_size=2))
    # replica A: rows 0-2 as two micro-batches (row sums -3.3, 1.9); replica B: row 3 (-1.0);
    # each over D / 2 = 6
    a = sum(fn(logp[s], None, {k: v[s] for k, v in mb.items()})[0]
            for s in (slice(0, 1), slice(1, 3)))
    b = fn(logp[3:], None, {k: v[3:] for k, v in mb.items()})[0]
    torch.testing.assert_close(a, torch.tensor((-3.3 + 1.9) / 6))
    torch.testing.assert_close(b, torch.tensor(-1.0 / 6))
    mean = (a + b) / 2
    torch.testing.assert_close(mean, whole)
    (g,) = torch.autograd.grad(mean, logp)
    torch.testing.assert_close(g, PG_GRAD / 12)
