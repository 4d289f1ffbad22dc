"""Rank program: a few optimizer steps on a fixed batch; rank 0 writes the loss curve.

argv: out.json tp pp model_dir steps micro_batch
"""
import json
import sys

import torch
import torch.distributed as dist


def nll_loss(total_tokens):
    def loss_fn(logprobs, entropy, mb):
        mask = mb["loss_mask"].float()
        loss = -(logprobs * mask).sum() / total_tokens
        return loss, {"tokens": mask.sum() / total_tokens}
    return loss_fn


def main():
    out, tp, pp, model_dir, steps, mbs = sys.argv[1], *map(int, sys.argv[2:4]), sys.argv[4], \
        int(sys.argv[5]), int(sys.argv[6])
    from megarl.backends.megatron.optim import OptimConfig
    from megarl.backends.megatron.worker import MegatronWorker

    w = MegatronWorker(model_dir, tp, pp, optim=OptimConfig(lr=3e-3, clip_grad=1.0))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, w.args.vocab_size, (5, 16), generator=g)
    lengths = torch.tensor([16, 12, 9, 16, 5])
    attn = (torch.arange(16)[None] < lengths[:, None]).long()
    loss_mask = attn.clone()
    loss_mask[:, 0] = 0  # position 0 predicts nothing
    batch = {"input_ids": ids * attn, "attention_mask": attn, "loss_mask": loss_mask}
    fn = nll_loss(loss_mask.sum().item())
    curve = [w.train_step(batch, fn, micro_batch_size=mbs) for _ in range(steps)]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(curve, f)


if __name__ == "__main__":
    main()
