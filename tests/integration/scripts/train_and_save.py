"""Rank program: train a few steps at TP/PP, record the trained logits, save a checkpoint.

argv: out_dir tp pp model_dir steps
Writes (rank 0) out_dir/logits.pt {"input_ids", "before", "after"} (fp32 full-vocab logits of
the model before and after training, from Megatron's own forward), out_dir/rank_bytes.json
(parameter bytes each rank holds, in rank order) and the checkpoint out_dir/ckpt (with
optimizer state, as a training run saves it).
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.backends.megatron.parallel import rank_program


def main():
    out, tp, pp, model_dir, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4], int(sys.argv[5])
    from megarl.backends.megatron.optim import OptimConfig
    from megarl.backends.megatron.worker import MegatronWorker

    w = MegatronWorker(model_dir, tp, pp, optim=OptimConfig(lr=3e-3))
    g = torch.Generator().manual_seed(7)
    probe = torch.randint(0, w.args.vocab_size, (3, 12), generator=g)
    before = w.forward_logits(probe)

    ids = torch.randint(0, w.args.vocab_size, (4, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[:, 0] = 0  # position 0 predicts nothing
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}

    def nll(logprobs, entropy, mb):
        return -(logprobs * mb["loss_mask"]).sum() / mask.sum(), {}

    for _ in range(steps):
        w.train_step(batch, nll, micro_batch_size=2)
    after = w.forward_logits(probe)

    mine = sum(p.numel() * p.element_size() for p in w.model.parameters())
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    w.save(out / "ckpt", source=model_dir)  # dtype and vocab padding: the worker records them
    if dist.get_rank() == 0:
        torch.save({"input_ids": probe, "before": before, "after": after}, out / "logits.pt")
        (out / "rank_bytes.json").write_text(json.dumps(per_rank))


if __name__ == "__main__":
    with rank_program():
        main()
