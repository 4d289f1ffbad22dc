"""Rank program: a tiny Qwen3-MoE in the Megatron worker at EP=2 (× TP), against
transformers, with and without routing replay (R3).

argv: out.json model_dir tp. The world is 2 × tp ranks: EP=2 over the two data-parallel
ranks (each runs the same rows; tokens cross to the experts' EP ranks), each expert split
over the TP ranks (ETP = TP). Rank 0 writes:
- logits / logprobs / entropy: the largest difference from transformers (no replay);
- own_vs_hf: positions where Megatron's own routing differs from transformers' (the same
  weights route the same way);
- forced_*: with a random routing replayed (distinct experts per token, not the model's),
  the largest difference of Megatron's log-probs from transformers' under the same forced
  routing, padded and packed, and the positions where Megatron's routers did not take it;
- ignored_without_replay: the same batch on a worker without replay: its log-probs are its
  own routing's (difference from the unforced ones);
- train_finite / train_metrics: a train step with replay ran, with finite metrics and the
  expert-load ones (at TP > 1 on the sequence-parallel worker: megatron-core 0.16 trains an
  MoE under TP only with sequence parallelism);
- sp_*: at TP > 1, a worker with sequence parallelism (each router sees its TP rank's slice
  of the 17-token rows, padded to 18): its logits / logprobs / entropy against transformers,
  padded and packed, and the forced routing replayed, padded and packed.
"""
import json
import sys

import torch
import torch.distributed as dist

from megarl.backends.megatron.parallel import rank_program


def forced_weights(gate, logits, idx):
    """The weights transformers' router `gate` gives the experts `idx` [tokens, k] from its
    `logits` [tokens, E]: Qwen3-MoE's softmax over every expert, then the top-k renormalised
    (norm_topk_prob); GLM-4.5's (and DeepSeek-V3's) sigmoid scores, whose correction bias
    only selects experts: the chosen ones' unbiased scores, renormalised, times
    routed_scaling_factor."""
    if hasattr(gate, "e_score_correction_bias"):
        top = logits.sigmoid().gather(1, idx)
        if gate.norm_topk_prob:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return top * gate.routed_scaling_factor
    top = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, idx)
    if gate.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


def routers(hf):
    """(layer index, router) of every MoE layer of transformers' model; dense layers (GLM-4.5's
    first_k_dense_replace) have none and route nothing."""
    return [(i, layer.mlp.gate) for i, layer in enumerate(hf.model.layers)
            if getattr(layer.mlp, "gate", None) is not None]


def hf_logprobs(hf, ids, forced=None):
    """transformers' log-probs of ids[:, 1:], each MoE layer's router forced to `forced`
    [B, S, L, k] when given (B-major token order, transformers' own; a dense layer's entries
    are ignored)."""
    import torch.nn.functional as F

    handles = []
    if forced is not None:
        for i, gate in routers(hf):
            def route(hidden, gate=gate, i=i):
                hidden = hidden.reshape(-1, gate.hidden_dim)
                # in the router's own precision (GLM-4.5's is fp32 whatever the model's)
                logits = F.linear(hidden.to(gate.weight.dtype), gate.weight)
                idx = forced[:, :, i].reshape(-1, forced.shape[-1]).long()
                return logits, forced_weights(gate, logits, idx), idx

            gate.forward = route
            handles.append(gate)
    with torch.no_grad():
        logits = hf(ids).logits
    for gate in handles:
        del gate.forward  # back to the class's
    lp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
    return lp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def hf_routing(hf, ids):
    """transformers' own top-k experts [B, S, L, k] (a dense layer's: zeros, as stock SGLang's
    zero-filled buffer reports it)."""
    got = {}

    def keep(i):
        def hook(_m, _inp, out):
            got[i] = out[2]
        return hook

    hs = [gate.register_forward_hook(keep(i)) for i, gate in routers(hf)]
    with torch.no_grad():
        hf(ids)
    for h in hs:
        h.remove()
    B, S = ids.shape
    ref = next(iter(got.values()))
    return torch.stack([got.get(i, torch.zeros_like(ref)).reshape(B, S, -1)
                        for i in range(len(hf.model.layers))], dim=2)


def megatron_routing(w):
    """Hooks recording each router's chosen experts per micro-batch (Megatron's [S, b]
    token order, flattened)."""
    seen = []

    def hook(layer):
        def f(_m, _inp, out):
            probs, routing_map = out
            seen.append((layer, routing_map.detach().clone()))
        return f

    hs = [router.register_forward_hook(hook(layer)) for layer, router in w.routers]
    return seen, hs


def main():
    out, model_dir, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from transformers import AutoModelForCausalLM

    from megarl.backends.megatron.model import MoESettings
    from megarl.backends.megatron.optim import OptimConfig
    from megarl.backends.megatron.packing import TokenBudget
    from megarl.backends.megatron.worker import MegatronWorker

    replay = MegatronWorker(model_dir, tp, 1, trainable=tp == 1, optim=OptimConfig(lr=1e-4),
                            moe=MoESettings(ep=2, routing_replay=True))
    a = replay.args
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    B, S, L, k, E = 3, 17, a.num_layers, a.moe_topk, a.num_experts
    ids = torch.randint(0, a.vocab_size, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 12:] = 0  # a shorter row: padding the replay must skip
    res = {}
    with torch.no_grad():
        ref = hf(ids).logits
    res["logits"] = (replay.forward_logits(ids) - ref).abs().max().item()
    logp_all = torch.log_softmax(ref, dim=-1)[:, :-1]

    # the model's own routing equals transformers' (nothing replayed: no routed_experts)
    seen, hs = megatron_routing(replay)
    got = replay.compute_logp({"input_ids": ids, "attention_mask": mask}, micro_batch_size=B,
                              with_entropy=True)
    want = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    valid = mask[:, 1:].bool()
    res["logprobs"] = (got["logprobs"][:, 1:] - want)[valid].abs().max().item()
    res["entropy"] = (got["entropy"][:, 1:] - ent)[valid].abs().max().item()
    own = hf_routing(hf, ids)
    mismatch = 0
    for layer, routing_map in seen:
        chosen = routing_map.reshape(S, B, E).transpose(0, 1)  # [B, S, E]
        want = torch.zeros(B, S, E, dtype=torch.bool).scatter_(2, own[:, :, layer], True)
        mismatch += int((chosen != want).any(-1)[mask.bool()].sum())
    res["own_vs_hf"] = mismatch
    seen.clear()

    # a forced routing, unlike the model's: k distinct random experts per token and layer
    forced = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B * S * L)])
    forced = forced.reshape(B, S, L, k).to(torch.int16)
    want_lp = hf_logprobs(hf, ids, forced)
    batch = {"input_ids": ids, "attention_mask": mask, "routed_experts": forced}
    real = mask[:, 1:].bool()
    for name, micro in (("padded", 2), ("packed", TokenBudget(24))):
        got = replay.compute_logp(batch, micro_batch_size=micro)["logprobs"][:, 1:]
        res[f"forced_{name}"] = (got - want_lp)[real].abs().max().item()
    # every real token took the replayed experts
    off = 0
    seen.clear()
    replay.compute_logp(batch, micro_batch_size=B)
    for layer, routing_map in seen:
        chosen = routing_map.reshape(S, B, E).transpose(0, 1)
        want = torch.zeros(B, S, E, dtype=torch.bool).scatter_(2, forced[:, :, layer].long(),
                                                               True)
        off += int((chosen != want).any(-1)[mask.bool()].sum())
    res["forced_not_taken"] = off
    for h in hs:
        h.remove()

    own_lp = hf_logprobs(hf, ids)

    def loss_fn(lp, ent, mb):
        m = mb["attention_mask"][:, 1:].float()
        return -(lp[:, 1:] * m).sum() / max(1.0, float(mask[:, 1:].sum())), {}

    trainer = replay
    if tp > 1:
        trainer = MegatronWorker(model_dir, tp, 1, optim=OptimConfig(lr=1e-4),
                                 moe=MoESettings(ep=2, routing_replay=True),
                                 sequence_parallel=True)
        assert trainer.config.sequence_parallel
        res["sp_logits"] = (trainer.forward_logits(ids) - ref).abs().max().item()
        plain_batch = {"input_ids": ids, "attention_mask": mask}
        want = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        for name, micro in (("padded", 2), ("packed", TokenBudget(24))):
            got = trainer.compute_logp(plain_batch, micro_batch_size=micro, with_entropy=True)
            res[f"sp_logprobs_{name}"] = (got["logprobs"][:, 1:] - want)[valid].abs().max().item()
            res[f"sp_entropy_{name}"] = (got["entropy"][:, 1:] - ent)[valid].abs().max().item()
            got = trainer.compute_logp(batch, micro_batch_size=micro)["logprobs"][:, 1:]
            res[f"sp_forced_{name}"] = (got - want_lp)[real].abs().max().item()
    stats = [trainer.train_step(batch, loss_fn, micro_batch_size=2) for _ in range(2)]
    res["train_finite"] = all(torch.isfinite(torch.tensor(v)) for s in stats
                              for v in s.values())
    res["train_metrics"] = sorted(k for k in stats[0] if k.startswith("moe/"))
    res["train_losses"] = [s["loss"] for s in stats] if "loss" in stats[0] else []
    # a worker without replay (same parallel layout) routes by itself whatever the batch
    # carries
    plain = MegatronWorker(model_dir, tp, 1, trainable=False, moe=MoESettings(ep=2))
    got = plain.compute_logp(batch, micro_batch_size=B)["logprobs"][:, 1:]
    res["ignored_without_replay"] = (got - own_lp)[real].abs().max().item()
    res["forced_vs_own"] = (want_lp - own_lp)[real].abs().max().item()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    with rank_program():
        main()
