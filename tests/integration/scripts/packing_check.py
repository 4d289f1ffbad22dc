"""Rank program: packed token-budget micro-batches against padded ones, on one ragged batch.

argv: out.json tp pp model_dir [cp]  (cp: both workers at that context parallelism)
PACKING_ATTENTION=padded:packed (default auto:auto): each policy worker's attention_backend,
e.g. unfused:flex (SDPA's math kernel, the plain path, against FlexAttention's document mask;
the critics, the same attention code, keep auto: FlexAttention's eager CPU reference is slow).

Pairs of workers from the same HF weights, one padded (fixed micro-batch rows), one packed (a
token budget): a policy and a critic. Over a few optimizer steps, rank 0 writes the largest
relative differences of the log-probs, entropies, values, losses and grad norms (equal grad
norms and equal outputs after each step: equal gradients). Data parallel ranks get different
rows (and row counts) of the batch. At TP > 1 the packed workers run with sequence
parallelism (packed rows padded to a multiple of TP, the critic's head gathering the sequence,
the norms' grads summed over TP) against padded ones without it: the same numbers.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from megarl.backends.megatron.parallel import rank_program

ROWS, WIDTH, STEPS = 11, 24, 10


def ragged_batch(vocab: int, dp_rank: int, dp: int):
    """Rows of 1 token to the full width (a long tail), right-padded. With DP=2, rank 0
    takes 9 rows (89 tokens: three micro-batches under the budget) and rank 1 two (8 tokens),
    so rank 1 runs a micro-batch with no rows of its own (a filler)."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor([1, WIDTH, 3, 5, WIDTH, 2, 9, 4, 17, 6, 2])
    ids = torch.randint(1, vocab, (ROWS, WIDTH), generator=g)
    attn = (torch.arange(WIDTH).unsqueeze(0) < lengths.unsqueeze(1)).long()
    loss_mask = attn.clone()
    loss_mask[:, :2] = 0  # a 2-token "prompt"
    adv = torch.randn(ROWS, WIDTH, generator=g)
    sl = slice(0, ROWS) if dp == 1 else [slice(0, ROWS - 2), slice(ROWS - 2, ROWS)][dp_rank]
    batch = {"input_ids": ids * attn, "attention_mask": attn, "loss_mask": loss_mask,
             "advantages": adv * loss_mask}
    return {k: v[sl] for k, v in batch.items()}, float(loss_mask.sum())


def main():
    out, tp, pp, model_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    from megarl.backends.megatron.optim import OptimConfig
    from megarl.backends.megatron.packing import TokenBudget
    from megarl.backends.megatron.worker import MegatronWorker

    backends = os.environ.get("PACKING_ATTENTION", "auto:auto").split(":")

    def worker(critic, packs):
        return MegatronWorker(model_dir, tp, pp, optim=OptimConfig(lr=1e-3, weight_decay=0.0),
                              value_model=critic, sequence_parallel=packs and tp > 1,
                              context_parallel=cp,
                              attention_backend="auto" if critic else backends[int(packs)])

    padded, packed = worker(False, False), worker(False, True)
    ps = padded.ps
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batch, tokens = ragged_batch(padded.args.vocab_size, dp_rank, dp)
    # several micro-batches, one of them a long row alone (the budget counts per CP rank)
    budget = TokenBudget(-(-(WIDTH + 6) // cp))
    real = batch["attention_mask"].bool()
    diffs = {}

    def note(name, a, b):
        # Per-token outputs on real tokens only: the padded path computes garbage on padding,
        # which every consumer masks; the packed one leaves it 0. Relative to the value's
        # size where it is over 1 (log-probs near -10 agree to ~1e-6 of themselves).
        if torch.is_tensor(a):
            d = float(((a - b).abs() / a.abs().clamp(min=1.0))[real].max())
        else:
            d = abs(a - b) / max(1.0, abs(a))
        diffs[name] = max(diffs.get(name, 0.0), d)

    def loss_fn(logprobs, entropy, mb):  # token-sum shares: any split sums to the same
        m = mb["loss_mask"].float()
        loss = -(logprobs * mb["advantages"] * m).sum() / tokens \
            - 0.01 * (entropy * m).sum() / tokens
        return loss, {"ent": (entropy * m).sum() / tokens}

    for _ in range(STEPS):
        a = padded.compute_logp(batch, 1.0, 3, with_entropy=True)
        b = packed.compute_logp(batch, 1.0, budget, with_entropy=True)
        note("logprobs", a["logprobs"], b["logprobs"])
        note("entropy", a["entropy"], b["entropy"])
        sa = padded.train_step(batch, loss_fn, 3, with_entropy=True)
        sb = packed.train_step(batch, loss_fn, budget, with_entropy=True)
        for k in ("loss", "ent", "grad_norm"):
            note(k, sa[k], sb[k])
    note("logprobs", padded.compute_logp(batch, 1.0, 3)["logprobs"],
         packed.compute_logp(batch, 1.0, budget)["logprobs"])

    def vloss(values, mb):
        m = mb["loss_mask"].float()
        loss = ((values - mb["advantages"]) ** 2 * m).sum() / tokens
        return loss, {"vsum": (values * m).sum() / tokens}

    vpadded, vpacked = worker(True, False), worker(True, True)
    for _ in range(STEPS):
        note("values", vpadded.compute_values(batch, 3)["values"],
             vpacked.compute_values(batch, budget)["values"])
        a, b = vpadded.train_values(batch, vloss, 3), vpacked.train_values(batch, vloss, budget)
        for k in ("loss", "vsum", "grad_norm"):
            note(f"critic_{k}", a[k], b[k])
    note("values", vpadded.compute_values(batch, 3)["values"],
         vpacked.compute_values(batch, budget)["values"])
    # how the packed worker split this rank's rows: micro-batches and filler ones
    mbatches = packed._micro_batches(batch, budget)[0]
    plan = torch.tensor([len(mbatches), sum(int((m["_rows"] < 0).all()) for m in mbatches)])
    plans = [torch.zeros_like(plan) for _ in range(dist.get_world_size())]
    dist.all_gather(plans, plan)
    # the largest difference over all ranks
    names = sorted(diffs)
    t = torch.tensor([diffs[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"diffs": dict(zip(names, t.tolist())), "dp": dp,
                       "micro_batches": [int(x[0]) for x in plans],
                       "fillers": [int(x[1]) for x in plans]}, f)


if __name__ == "__main__":
    with rank_program():
        main()
