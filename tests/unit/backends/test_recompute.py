"""`actor_rollout_ref.model.enable_gradient_checkpointing` reaches Megatron: every layer's
forward runs again in backward (full recompute, one layer at a time), and the step is the same
step as without it, bit for bit (dropout is off; the CPU generator is saved and restored
around each recomputed layer). verl's `override_transformer_config.recompute_*` keys choose
the others: selective (the core attention again), full by block (the first N layers of the
stage again). A rank program in a subprocess, so no process group leaks into this one."""
import json
import os
import subprocess
import sys

_PROGRAM = """
import json, sys, torch
from megarl.backends.megatron.parallel import rank_program
from megarl.backends.megatron.worker import MegatronWorker
from megarl.cluster.spec import megatron_spec
from megarl.config import load_config


def loss_fn(logprobs, entropy, mb):
    mask = mb["loss_mask"].float()
    return -(logprobs * mask).sum() / mask.sum(), {}


O = "actor_rollout_ref.actor.megatron.override_transformer_config."
CASES = {"off": [], "on": ["actor_rollout_ref.model.enable_gradient_checkpointing=True"],
         "selective": [O + "recompute_granularity=selective"],
         "block": [O + "recompute_granularity=full", O + "recompute_method=block",
                   O + "recompute_num_layers=1"]}
out = {}
with rank_program():
    for case, extra in CASES.items():
        cfg = load_config(None, [f"actor_rollout_ref.model.path={sys.argv[1]}",
                                 "actor_rollout_ref.actor.optim.lr=1e-3", *extra])
        spec = megatron_spec(cfg, "actor").model
        torch.manual_seed(0)
        w = MegatronWorker.from_spec(spec)
        calls, attn = [0], [0]
        for layer in w.model.decoder.layers:
            layer.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
            layer.self_attention.core_attention.register_forward_hook(
                lambda *a: attn.__setitem__(0, attn[0] + 1))
        ids = torch.randint(0, w.args.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[:, 0] = 0
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
        steps = [w.train_step(batch, loss_fn, micro_batch_size=2) for _ in range(2)]
        logp = w.compute_logp(batch, micro_batch_size=2)["logprobs"]  # no grad: no recompute
        out[case] = {"recompute": w.config.recompute_granularity, "spec": spec.recompute,
                        "layer_forwards": calls[0], "attention_forwards": attn[0],
                        "grad_norms": [s["grad_norm"] for s in steps],
                        "weights": float(sum(p.double().sum() for p in w.model.parameters())),
                        "logp": float(logp.double().sum())}
        del w
print(json.dumps(out))
"""


def test_recompute_runs_again_what_it_drops_and_changes_nothing(tiny_qwen2, tmp_path):
    proc = subprocess.run([sys.executable, "-c", _PROGRAM, str(tiny_qwen2)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MASTER_PORT": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    off = runs["off"]
    assert (off["recompute"], off["spec"]) == (None, None)
    assert runs["on"]["spec"] == {"recompute_granularity": "full", "recompute_method": "uniform",
                                  "recompute_num_layers": 1}
    assert [runs[c]["recompute"] for c in ("on", "selective", "block")] == \
        ["full", "selective", "full"]
    # 2 layers x 2 micro-batches x 2 steps forwards, and once each in the log-prob pass after
    # them (+4, which keeps nothing for backward); recompute runs again in backward: every
    # layer (on), every core attention (selective), the first layer of the stage (block)
    assert (off["layer_forwards"], off["attention_forwards"]) == (8 + 4, 8 + 4)
    assert (runs["on"]["layer_forwards"], runs["on"]["attention_forwards"]) == (16 + 4, 16 + 4)
    assert (runs["selective"]["layer_forwards"], runs["selective"]["attention_forwards"]) == \
        (8 + 4, 16 + 4)
    assert (runs["block"]["layer_forwards"], runs["block"]["attention_forwards"]) == \
        (12 + 4, 12 + 4)
    for case in ("on", "selective", "block"):
        for k in ("grad_norms", "weights", "logp"):
            assert runs[case][k] == off[k], (case, k)
