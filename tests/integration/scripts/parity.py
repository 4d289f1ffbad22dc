"""Rank program: Megatron logits / log-probs / entropy vs the transformers model.

argv: out.json tp pp model_dir [model_dir ...]; rank 0 writes {model_dir: {metric: max_diff}}.
PARITY_PARAMS_DTYPE (default float32) sets the Megatron side's params_dtype; transformers
stays in float32 on the CPU, the reference. PARITY_CP (default 1): context-parallel ranks
(world TP×PP×CP), the packed (THD) path beside the padded one. PARITY_REPLAY=1: the MoE
models with routing replay (R3), and a forced routing replayed (`forced_*`: log-probs against
transformers' under the same routing, padded and packed). PARITY_EP (default 1): expert-parallel ranks for
the mixture-of-experts models (the world is then larger than TP×PP: data-parallel ranks
that each run the same rows, their tokens crossing to the experts' ranks).
PARITY_ATTENTION (default auto): the workers' attention_backend (flex: packed rows through
FlexAttention's document mask).
PARITY_EP_MODELS (os.pathsep-separated MoE model dirs, TP=2 jobs): after the others, each
at TP1 × EP2 (`ep2:` keys; the two ranks data-parallel, their tokens crossing to the
experts' ranks; `ep2:routing_off`: real tokens whose experts differ from transformers' in
some layer) and at TP2 × EP2 (ETP1, the experts over the TP ranks) with SP (`tp2ep2:`;
`tp2ep2:export_off`: HF tensors the export lacks, adds or changes against model.safetensors).
PARITY_VPP_MODELS (os.pathsep-separated model dirs): run at PP×VPP with PARITY_VPP (default 2)
model chunks per stage after the others, padded and packed, and with one-row micro-batches
(3 of them, which the interleaved schedule pads to a multiple of PP).
PARITY_CHUNK (tokens): the log-probs through the token-chunked path
(`entropy_from_logits_with_chunking`) in chunks of that many tokens.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from megarl.backends.megatron.parallel import rank_program


def compare(w, hf, packed: bool, cp: int = 1, one_row: bool = False) -> dict:
    """Largest differences of `w`'s logits, log-probs and entropies from `hf`'s."""
    from megarl.backends.megatron.packing import TokenBudget

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, w.args.vocab_size, (3, 17), generator=g)
    with torch.no_grad():
        ref = hf(ids).logits
    logits = w.forward_logits(ids).float().cpu()
    r = {"logits": (logits - ref).abs().max().item()}
    # micro-batch 2 of 3 rows: also exercises the filler row of the last micro-batch;
    # packed: two micro-batches of 17 + 17 and 17 tokens
    # (under CP the budget counts per CP rank: 34 // CP keeps the same micro-batches)
    micros = [("", 2)] + ([("packed_", TokenBudget(34 // cp))] if packed else []) \
        + ([("mb1_", 1)] if one_row else [])
    for temp in (1.0, 0.7):
        logp_all = torch.log_softmax(ref / temp, dim=-1)[:, :-1]
        want = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        for name, micro in micros:
            got = w.compute_logp({"input_ids": ids}, temperature=temp, micro_batch_size=micro,
                                 with_entropy=True)
            got = {k: v.float().cpu() for k, v in got.items()}
            r[f"{name}logprobs@{temp}"] = (got["logprobs"][:, 1:] - want).abs().max().item()
            r[f"{name}entropy@{temp}"] = (got["entropy"][:, 1:] - ent).abs().max().item()
            r[f"{name}pos0@{temp}"] = got["logprobs"][:, 0].abs().max().item()
    return r


def forced_routing(w, hf, cp: int) -> dict:
    """R3: a random routing (k distinct experts per token and layer, not the model's) in the
    batch's `routed_experts`; the worker's log-probs against transformers' under it."""
    from moe_replay import hf_logprobs

    from megarl.backends.megatron.packing import TokenBudget

    a = w.args
    g = torch.Generator().manual_seed(5)
    B, S, L, k, E = 3, 17, a.num_layers, a.moe_topk, a.num_experts
    ids = torch.randint(0, a.vocab_size, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 12:] = 0  # a shorter row: padding the replay must skip
    forced = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B * S * L)])
    forced = forced.reshape(B, S, L, k).to(torch.int16)
    want = hf_logprobs(hf, ids, forced)
    real = mask[:, 1:].bool()
    r = {"forced_vs_own": (want - hf_logprobs(hf, ids))[real].abs().max().item()}
    batch = {"input_ids": ids * mask, "attention_mask": mask, "routed_experts": forced}
    for name, micro in (("padded", 2), ("packed", TokenBudget(24 // cp))):
        got = w.compute_logp(batch, micro_batch_size=micro)["logprobs"][:, 1:]
        r[f"forced_{name}"] = (got - want)[real].abs().max().item()
    return r


def routing_off(w, hf, ids) -> int:
    """Tokens (all real here) whose chosen experts differ from transformers' in some MoE
    layer (dense layers have no router on either side)."""
    got, hs = {}, []
    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if isinstance(gate, torch.nn.Module):
            hs.append(gate.register_forward_hook(
                lambda _m, _i, out, i=i: got.__setitem__(i, out[2])))
    seen = []
    hs += [router.register_forward_hook(
        lambda _m, _i, out, layer=layer: seen.append((layer, out[1].detach().clone())))
        for layer, router in w.routers]
    with torch.no_grad():
        hf(ids)
    B, S = ids.shape
    w.compute_logp({"input_ids": ids}, micro_batch_size=B)
    for h in hs:
        h.remove()
    assert seen and {layer for layer, _ in seen} == set(got), (sorted(got), seen)
    off = torch.zeros(B, S, dtype=torch.bool)
    for layer, routing_map in seen:
        chosen = routing_map.reshape(S, B, -1).transpose(0, 1)  # Megatron's [S, B] order
        want = torch.zeros_like(chosen).scatter_(2, got[layer].reshape(B, S, -1), True)
        off |= (chosen != want).any(-1)
    return int(off.sum())


def expert_parallel(d: str) -> dict:
    """`d` at TP1 × EP2 and at TP2 × EP2 (ETP1) with SP, on the job's two ranks."""
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from megarl.backends.megatron.model import MoESettings
    from megarl.backends.megatron.worker import MegatronWorker

    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    r = {}
    for key, tp, sp in (("ep2:", 1, False), ("tp2ep2:", 2, True)):
        ps.destroy_model_parallel()  # Megatron's groups again (the world stays)
        w = MegatronWorker(d, tp, 1, trainable=False, moe=MoESettings(ep=2, etp=1),
                           sequence_parallel=sp)
        r.update({key + k: v for k, v in compare(w, hf, sp).items()})
        if tp == 1:
            g = torch.Generator().manual_seed(1)
            r[key + "routing_off"] = routing_off(
                w, hf, torch.randint(0, w.args.vocab_size, (3, 17), generator=g))
        else:
            # the export the weight sync and the converter send (TP and EP gathered): every
            # HF tensor, bit-exact (names and fp32 values as loaded)
            from safetensors.torch import load_file

            src = load_file(os.path.join(d, "model.safetensors"))
            got = {k: v.cpu() for k, v in w.export_hf()}
            r[key + "export_off"] = sorted(set(src) ^ set(got)) + sorted(
                k for k in set(src) & set(got) if not torch.equal(src[k], got[k]))
    return r


def main():
    out, tp, pp, dirs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    from transformers import AutoModelForCausalLM

    from megarl.backends.megatron.model import MoESettings
    from megarl.backends.megatron.worker import MegatronWorker

    results = {}
    ep = int(os.environ.get("PARITY_EP", 1))
    # PARITY_SP=1: each model again with sequence parallelism (the same process groups), its
    # numbers under "sp:" keys, and the packed (THD) path beside the padded one; 17 tokens
    # are not a multiple of TP, nor are the packed rows, so both are padded for SP
    # (PARITY_SP=only: the SP run alone)
    sp_runs = {"1": [False, True], "only": [True]}.get(os.environ.get("PARITY_SP"), [False])
    cp = int(os.environ.get("PARITY_CP", 1))
    replay = os.environ.get("PARITY_REPLAY") == "1"
    for d in dirs:
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        r = {}
        for sp in sp_runs:
            w = MegatronWorker(d, tp, pp, trainable=False,
                               params_dtype=os.environ.get("PARITY_PARAMS_DTYPE", "float32"),
                               moe=MoESettings(ep=ep, etp=int(os.environ["PARITY_ETP"])
                                               if os.environ.get("PARITY_ETP") else None,
                                               routing_replay=replay),
                               sequence_parallel=sp, context_parallel=cp,
                               attention_backend=os.environ.get("PARITY_ATTENTION", "auto"),
                               logprob_chunk_size=int(os.environ.get("PARITY_CHUNK", 0)) or None)
            r.update({("sp:" if sp else "") + k: v
                      for k, v in compare(w, hf, sp or cp > 1, cp).items()})
            if replay and w.args.is_moe:
                r.update({("sp:" if sp else "") + k: v
                          for k, v in forced_routing(w, hf, cp).items()})
        results[d] = r
    for d in [d for d in os.environ.get("PARITY_EP_MODELS", "").split(os.pathsep) if d]:
        results.setdefault(d, {}).update(expert_parallel(d))
    vpp_dirs = [d for d in os.environ.get("PARITY_VPP_MODELS", "").split(os.pathsep) if d]
    if vpp_dirs:
        from megatron.core import parallel_state as ps

        # Megatron's groups again, with model chunks (torch.distributed's world stays)
        ps.destroy_model_parallel()
    for d in vpp_dirs:
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        w = MegatronWorker(d, tp, pp, trainable=False, vpp=int(os.environ.get("PARITY_VPP", 2)))
        results[d] = {"vpp:" + k: v for k, v in compare(w, hf, True, one_row=True).items()}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    with rank_program():
        main()
