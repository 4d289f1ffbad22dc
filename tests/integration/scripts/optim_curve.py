"""Rank program: optimizer steps on a fixed batch, each data-parallel rank training on its
share; rank 0 writes the curve (loss of its share, global grad norm, lr).

argv: out.json model_dir steps resume_at [override ...] [--then override ...]

resume_at > 0: after that many steps the worker saves a checkpoint, a second worker is built
in the same processes, loads it and trains the remaining steps (the curve is both together).
Overrides are run-config keys in the CLI's syntax (the layout, the optimizer, the dtype);
those after `--then` apply to the second worker only (a bf16 run resumed in fp32, say).
OPTIM_TOKEN_BUDGET: packed micro-batches of that many tokens (per CP rank) instead of 2 rows.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from megarl.backends.megatron.parallel import rank_program

ROWS, SEQ = 8, 16


def main():
    out, model_dir, steps, resume_at, *overrides = sys.argv[1:]
    steps, resume_at = int(steps), int(resume_at)
    then = overrides[overrides.index("--then") + 1:] if "--then" in overrides else []
    overrides = overrides[:len(overrides) - len(then) - (1 if then or "--then" in overrides else 0)]
    from megarl.backends.megatron.worker import MegatronWorker
    from megarl.cluster.spec import megatron_spec
    from megarl.config import load_config

    def spec(extra=()):
        cfg = load_config(None, [f"actor_rollout_ref.model.path={model_dir}",
                                 "actor_rollout_ref.actor.optim.weight_decay=0.0",
                                 f"trainer.n_gpus_per_node={os.environ['WORLD_SIZE']}",
                                 *overrides, *extra])
        return megatron_spec(cfg, "actor", schedule_steps=steps).model

    w = MegatronWorker.from_spec(spec())
    dp, rank = w.ps.get_data_parallel_world_size(), w.ps.get_data_parallel_rank()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, w.args.vocab_size, (ROWS, SEQ), generator=g)
    share = slice(rank * ROWS // dp, (rank + 1) * ROWS // dp)
    batch = {"input_ids": ids[share], "loss_mask": torch.ones(ROWS // dp, SEQ)}
    batch["loss_mask"][:, 0] = 0
    tokens = batch["loss_mask"].sum().item()

    def loss_fn(logprobs, entropy, mb):  # this rank's token mean; DDP averages over ranks
        return -(logprobs.float() * mb["loss_mask"]).sum() / tokens, {}

    budget = os.environ.get("OPTIM_TOKEN_BUDGET")
    if budget:
        from megarl.backends.megatron.packing import TokenBudget

        micro = TokenBudget(int(budget))
    else:
        micro = 2
    curve = []
    for i in range(steps):
        if resume_at and i == resume_at:
            path = os.path.join(os.path.dirname(out), "ckpt")
            w.save(path)
            w = MegatronWorker.from_spec(spec(then))  # fresh weights from HF, fresh optimizer
            w.load(path)
        curve.append(w.train_step(batch, loss_fn, micro_batch_size=micro))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(curve, f)


if __name__ == "__main__":
    with rank_program():
        main()
