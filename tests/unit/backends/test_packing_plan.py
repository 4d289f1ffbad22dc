"""Token-budget planning and packing (megarl/backends/megatron/packing.py), without a model:
partitions, budgets, the packed layout and its unpacking, data-parallel balance, config."""
import random

import pytest
import torch

from megarl.backends.megatron.packing import (TokenBudget, balanced_partition,
                                              count_micro_batches, micro_batching, pack,
                                              row_lengths, unpack_shifted)
from megarl.cluster.group import dp_order
from megarl.config import load_config
from megarl.controller.micro_batches import micro_batch_tokens
from megarl.controller.micro_batches import micro_batching as pass_micro_batching

CAP = 512


def long_tail(n: int, seed: int = 0) -> list[int]:
    """The issue's mix: median about CAP/8, a tenth of the samples at CAP."""
    rng = random.Random(seed)
    return [CAP if rng.random() < 0.1 else max(1, min(CAP, int(rng.lognormvariate(4.2, 0.6))))
            for _ in range(n)]


def right_padded(lengths: list[int], width: int | None = None) -> dict:
    width = width or max(lengths)
    attn = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    ids = torch.randint(1, 100, (len(lengths), width)) * attn
    return {"input_ids": ids, "attention_mask": attn}


def test_long_tail_mix_is_the_issues():
    lengths = sorted(long_tail(2000))
    assert CAP / 10 <= lengths[len(lengths) // 2] <= CAP / 6
    assert 0.08 <= sum(n == CAP for n in lengths) / len(lengths) <= 0.12


@pytest.mark.parametrize("k,equal", [(1, False), (3, False), (4, True), (7, True)])
def test_partition_covers_every_row_once(k, equal):
    w = long_tail(50, seed=k)
    parts = balanced_partition(w, k, equal_size=equal)
    assert len(parts) == k
    assert sorted(j for p in parts for j in p) == list(range(50))
    assert all(p == sorted(p) for p in parts)
    if equal:
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_partition_beats_contiguous_split_on_a_sorted_batch():
    w = sorted(long_tail(64, seed=3))  # worst case for contiguous shares
    parts = balanced_partition(w, 2, equal_size=True)
    sums = [sum(w[j] for j in p) for p in parts]
    assert max(sums) <= 1.01 * sum(w) / 2
    assert sum(w[32:]) > 1.5 * sum(w) / 2  # what the contiguous split would have given


@pytest.mark.parametrize("seed", range(5))
def test_data_parallel_balance_on_the_long_tail(seed):
    """The issue's bar: with DP=2, the slowest rank's tokens <= 1.1x the mean."""
    lengths = long_tail(64, seed=seed)
    batch = right_padded(lengths, CAP)
    shares = dp_order(batch, 2, TokenBudget(4096))
    tokens = [sum(lengths[j] for j in s.tolist()) for s in shares]
    assert max(tokens) <= 1.1 * sum(tokens) / 2, tokens
    assert sorted(torch.cat(shares).tolist()) == list(range(64))
    assert dp_order(batch, 2, 4) is None and dp_order(batch, 1, TokenBudget(9)) is None


@pytest.mark.parametrize("budget", [CAP, 2 * CAP, 3000])
def test_micro_batches_stay_under_the_budget(budget):
    lengths = long_tail(40, seed=budget)
    k = count_micro_batches(lengths, budget)
    parts = balanced_partition(lengths, k)
    assert all(sum(lengths[j] for j in p) <= budget for p in parts)
    assert k >= -(-sum(lengths) // budget)
    if k > 1:  # one fewer does not fit (by the same rule)
        fewer = balanced_partition(lengths, k - 1)
        assert any(sum(lengths[j] for j in p) > budget for p in fewer)


def test_a_row_over_the_budget_goes_alone():
    assert count_micro_batches([50, 3, 4], 10) == 2
    assert balanced_partition([50, 3, 4], 2) == [[0], [1, 2]]
    assert count_micro_batches([], 10) == 1
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBudget(0)


def test_pack_keeps_sequences_apart():
    batch = right_padded([3, 1, 5], 6)
    p = pack(batch["input_ids"], [3, 1, 5], total=12)
    assert p.input_ids.shape == (1, 12)
    assert p.cu_seqlens.tolist() == [0, 3, 4, 9, 12] and p.cu_seqlens.dtype == torch.int32
    assert p.position_ids[0].tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 1, 2]
    assert p.max_seqlen == 5
    assert p.input_ids[0, :9].tolist() == (batch["input_ids"][0, :3].tolist()
                                           + batch["input_ids"][1, :1].tolist()
                                           + batch["input_ids"][2, :5].tolist())
    with pytest.raises(ValueError, match="do not fit"):
        pack(batch["input_ids"], [3, 1, 5], total=8)


def test_unpack_puts_each_prediction_at_its_token():
    lengths, width = [3, 1, 4], 5
    packed_out = torch.arange(1.0, 9.0, requires_grad=True)  # output j at packed position j
    out = unpack_shifted(packed_out, lengths, width)
    # row 0 = packed 0..2: tokens 1, 2 predicted at packed 0, 1; row 1 has no prediction;
    # row 2 = packed 4..7: tokens 1..3 predicted at packed 4..6
    assert out.tolist() == [[0, 1, 2, 0, 0], [0, 0, 0, 0, 0], [0, 5, 6, 7, 0]]
    out.sum().backward()
    assert packed_out.grad.tolist() == [1, 1, 0, 0, 1, 1, 1, 0]


def test_row_lengths_need_right_padding():
    batch = right_padded([2, 4])
    assert row_lengths(batch) == [2, 4]
    assert row_lengths({"input_ids": batch["input_ids"]}) == [4, 4]
    batch["attention_mask"][1] = torch.tensor([0, 1, 1, 1])
    with pytest.raises(ValueError, match="attention_mask row 1"):
        row_lengths(batch)


def test_config_keys_follow_the_actor():
    cfg = load_config(None, [])
    assert pass_micro_batching(cfg, "actor") == cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    assert micro_batching(4, False, 100) == 4
    cfg = load_config(None, ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=300",
                             "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=900",
                             "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
                             "critic.forward_max_token_len_per_gpu=700"])
    assert pass_micro_batching(cfg, "actor") == TokenBudget(300)
    assert pass_micro_batching(cfg, "ref") == TokenBudget(900)
    assert pass_micro_batching(cfg, "logp") == cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
    assert pass_micro_batching(cfg, "critic") == TokenBudget(300)
    assert pass_micro_batching(cfg, "values") == TokenBudget(700)
    width = cfg.data.max_prompt_length + cfg.data.max_response_length
    assert micro_batch_tokens(cfg, "ref") == max(900, width)
    assert micro_batch_tokens(cfg, "logp") == \
        cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu * width
    with pytest.raises(Exception, match="ppo_max_token_len_per_gpu"):
        load_config(None, ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=0"])


@pytest.mark.parametrize("packed", [False, True])
def test_padding_frac_counts_the_sequence_parallel_padding(packed):
    """Under sequence parallelism the model runs every row (unpacked) or packed row at a
    multiple of TP: those extra positions are computed padding, and padding_frac counts them.
    Issue 47: unpacked rows were counted at their own width."""
    from megarl.backends.megatron.worker import _layout_stats

    lengths, tp = [5, 3, 6], 4
    batch = right_padded(lengths)  # width 6; the model runs 8 positions under SP at TP 4
    if packed:
        # what _packed_micro_batches builds: one packed row of 14 real tokens, run at 16
        mb = dict(batch, _packed=pack(batch["input_ids"], lengths, -(-14 // tp) * tp))
        stats = _layout_stats(batch, [mb], mb["_packed"].input_ids.shape[1])
        assert stats["padding_frac"] == pytest.approx(1 - 14 / 16)
    else:
        mbatches = [{k: v[i:i + 2] for k, v in right_padded(lengths + [0]).items()}
                    for i in (0, 2)]  # two micro-batches of 2 rows, the last with a filler
        stats = _layout_stats(batch, mbatches, 8)
        assert stats["padding_frac"] == pytest.approx(1 - 14 / (4 * 8))
        # without SP (the model's length is the width) only the right padding and filler count
        assert _layout_stats(batch, mbatches, 6)["padding_frac"] == pytest.approx(1 - 14 / 24)
    assert stats["micro_batches"] == (1.0 if packed else 2.0)
