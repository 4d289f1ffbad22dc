"""Rank program: the critic (value model) from the run config — values in token alignment,
a few clipped-value-loss steps on a fixed batch, a save/load round trip; rank 0 writes JSON.

argv: out.json tp pp model_dir ckpt_dir [cp]  (cp: context-parallel ranks, world TP×PP×CP)
"""
import json
import sys

import torch
import torch.distributed as dist

from megarl.backends.megatron.parallel import rank_program

STEPS = 6


def main():
    out, tp, pp, model_dir, ckpt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4], sys.argv[5]
    cp = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    from megarl.algo.value_loss import make_critic_loss_for_batch
    from megarl.backends.megatron.worker import MegatronWorker
    from megarl.cluster.spec import megatron_spec
    from megarl.config import load_config

    cfg = load_config(None, [
        f"actor_rollout_ref.model.path={model_dir}", "algorithm.adv_estimator=gae",
        f"critic.megatron.tensor_model_parallel_size={tp}",
        f"critic.megatron.pipeline_model_parallel_size={pp}",
        f"critic.megatron.context_parallel_size={cp}",
        "critic.optim.lr=3e-3", "critic.optim.weight_decay=0.0",
        f"trainer.n_gpus_per_node={tp * pp * cp}"])
    w = MegatronWorker.from_spec(megatron_spec(cfg, "critic").model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, w.args.vocab_size, (5, 12), generator=g)
    lengths = torch.tensor([12, 9, 7, 12, 4])
    attn = (torch.arange(12)[None] < lengths[:, None]).long()
    mask = attn.clone()
    mask[:, :3] = 0  # a 3-token prompt: the response starts at t = 3
    batch = {"input_ids": ids * attn, "attention_mask": attn, "response_mask": mask}
    first = w.compute_values(batch, micro_batch_size=2)["values"]
    assert first.shape == (5, 12) and torch.count_nonzero(first) == 0  # the head starts at 0
    returns = torch.where(torch.arange(5)[:, None] % 2 == 0, 1.0, -0.5).expand(5, 12) * mask
    curve = []
    for _ in range(STEPS):
        old = w.compute_values(batch, micro_batch_size=2)["values"]
        loss_fn = make_critic_loss_for_batch(10.0, "token-mean", mask)
        curve.append(w.train_values({**batch, "values": old, "returns": returns}, loss_fn,
                                    micro_batch_size=2))
    values = w.compute_values(batch, micro_batch_size=3)["values"]
    # Alignment: values[:, t] is the value of the prefix ids[:, :t]; changing tokens t..end
    # leaves values[:, :t + 1] as they were, and changes the value at t + 1.
    t = 5
    other = batch["input_ids"].clone()
    other[:, t:] = (other[:, t:] + 1) % w.args.vocab_size
    moved = w.compute_values({**batch, "input_ids": other}, micro_batch_size=3)["values"]
    assert torch.equal(values[:, :t + 1], moved[:, :t + 1]), (values, moved)
    assert not torch.allclose(values[:, t + 1], moved[:, t + 1])
    assert torch.all(values[:, 0] == 0)
    w.save(ckpt, step=0)
    after_save = values.clone()
    w.train_values({**batch, "values": values, "returns": returns},
                   make_critic_loss_for_batch(10.0, "token-mean", mask), micro_batch_size=2)
    w.load(ckpt)
    reloaded = w.compute_values(batch, micro_batch_size=3)["values"]
    assert torch.equal(reloaded, after_save)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"curve": curve, "values": values.tolist(),
                       "input_ids": batch["input_ids"].tolist()}, f)


if __name__ == "__main__":
    with rank_program():
        main()
