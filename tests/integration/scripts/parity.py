"""Rank program: Megatron logits / log-probs / entropy vs the transformers model.

argv: out.json tp pp model_dir [model_dir ...]; rank 0 writes {model_dir: {metric: max_diff}}.
PARITY_PARAMS_DTYPE (default float32) sets the Megatron side's params_dtype; transformers
stays in float32 on the CPU, the reference. PARITY_EP (default 1): expert-parallel ranks for
the mixture-of-experts models (the world is then larger than TP×PP: data-parallel ranks
that each run the same rows, their tokens crossing to the experts' ranks).
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from megarl.backends.megatron.parallel import rank_program


def main():
    out, tp, pp, dirs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    from transformers import AutoModelForCausalLM

    from megarl.backends.megatron.model import MoESettings
    from megarl.backends.megatron.worker import MegatronWorker

    results = {}
    ep = int(os.environ.get("PARITY_EP", 1))
    for d in dirs:
        w = MegatronWorker(d, tp, pp, trainable=False,
                           params_dtype=os.environ.get("PARITY_PARAMS_DTYPE", "float32"),
                           moe=MoESettings(ep=ep, etp=int(os.environ["PARITY_ETP"]) if os.environ.get("PARITY_ETP") else None))
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, w.args.vocab_size, (3, 17), generator=g)
        with torch.no_grad():
            ref = hf(ids).logits
        logits = w.forward_logits(ids).float().cpu()
        r = {"logits": (logits - ref).abs().max().item()}
        for temp in (1.0, 0.7):
            # micro-batch 2 of 3 rows: also exercises the filler row of the last micro-batch
            got = w.compute_logp({"input_ids": ids}, temperature=temp, micro_batch_size=2,
                                 with_entropy=True)
            logp_all = torch.log_softmax(ref / temp, dim=-1)[:, :-1]
            want = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
            ent = -(logp_all.exp() * logp_all).sum(-1)
            got = {k: v.float().cpu() for k, v in got.items()}
            r[f"logprobs@{temp}"] = (got["logprobs"][:, 1:] - want).abs().max().item()
            r[f"entropy@{temp}"] = (got["entropy"][:, 1:] - ent).abs().max().item()
            r[f"pos0@{temp}"] = got["logprobs"][:, 0].abs().max().item()
        results[d] = r
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    with rank_program():
        main()
