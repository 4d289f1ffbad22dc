"""Rank program: a few optimizer steps on a fixed batch; rank 0 writes the loss curve.

argv: out.json tp pp model_dir steps micro_batch [params_dtype]

On a machine with CUDA the worker runs there (Megatron DDP and its optimizer); hide the GPUs
(CUDA_VISIBLE_DEVICES="") for the CPU path.
"""
import json
import sys

import torch
import torch.distributed as dist

from megarl.backends.megatron.parallel import rank_program


def nll_loss(total_tokens):
    def loss_fn(logprobs, entropy, mb):
        mask = mb["loss_mask"].float()
        loss = -(logprobs * mask).sum() / total_tokens
        return loss, {"tokens": mask.sum() / total_tokens}
    return loss_fn


def main():
    out, tp, pp, model_dir, steps, mbs = sys.argv[1], *map(int, sys.argv[2:4]), sys.argv[4], \
        int(sys.argv[5]), int(sys.argv[6])
    dtype = sys.argv[7] if len(sys.argv) > 7 else "float32"
    from megarl.backends.megatron.worker import MegatronWorker
    from megarl.cluster.spec import megatron_spec
    from megarl.config import load_config

    # Built from the run config, as the trainer does (overrides in the CLI's syntax).
    cfg = load_config(None, [
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
        f"actor_rollout_ref.actor.megatron.params_dtype={dtype}",
        "actor_rollout_ref.actor.optim.lr=3e-3", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
        f"trainer.n_gpus_per_node={tp * pp}"])
    w = MegatronWorker.from_spec(megatron_spec(cfg, "actor").model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, w.args.vocab_size, (5, 16), generator=g)
    lengths = torch.tensor([16, 12, 9, 16, 5])
    attn = (torch.arange(16)[None] < lengths[:, None]).long()
    loss_mask = attn.clone()
    loss_mask[:, 0] = 0  # position 0 predicts nothing
    batch = {"input_ids": ids * attn, "attention_mask": attn, "loss_mask": loss_mask}
    fn = nll_loss(loss_mask.sum().item())
    curve = [w.train_step(batch, fn, micro_batch_size=mbs) for _ in range(steps)]
    assert [round(s["lr"], 9) for s in curve[:3]] == [1.5e-3, 3e-3, 3e-3], curve
    # An entropy bonus differentiates through the padded (masked) vocabulary columns.
    def with_entropy(logprobs, entropy, mb):
        loss, m = fn(logprobs, entropy, mb)
        mask = mb["loss_mask"].float()
        return loss - 0.01 * (entropy * mask).sum() / loss_mask.sum().item(), m
    ent_step = w.train_step(batch, with_entropy, micro_batch_size=mbs, with_entropy=True)
    assert torch.isfinite(torch.tensor(ent_step["grad_norm"])), ent_step
    curve.append(ent_step)
    # Maxima named in max_metrics reduce with max over micro-batches; the rest are summed.
    def with_max(logprobs, entropy, mb):
        loss, m = fn(logprobs, entropy, mb)
        top = mb["input_ids"].max().float()
        return loss, {**m, "top": top, "top_summed": top}
    mx = w.train_step(batch, with_max, micro_batch_size=mbs, max_metrics=("top",))
    masked = ids * attn
    assert mx["top"] == float(masked.max()), (mx, masked.max())
    per_micro = sum(float(masked[a:a + mbs].max()) for a in range(0, 5, mbs))
    assert abs(mx["top_summed"] - per_micro) < 1e-3 and mx["top_summed"] > mx["top"], mx
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(curve, f)


if __name__ == "__main__":
    with rank_program():
        main()
