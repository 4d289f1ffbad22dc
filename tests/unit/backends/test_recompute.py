"""`actor_rollout_ref.model.enable_gradient_checkpointing` reaches Megatron: every layer's
forward runs again in backward (full recompute, one layer at a time), and the step is the same
step as without it, bit for bit (dropout is off; the CPU generator is saved and restored
around each recomputed layer). A rank program in a subprocess, so no process group leaks into
this one."""
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


out = {}
with rank_program():
    for on in (False, True):
        cfg = load_config(None, [f"actor_rollout_ref.model.path={sys.argv[1]}",
                                 f"actor_rollout_ref.model.enable_gradient_checkpointing={on}",
                                 "actor_rollout_ref.actor.optim.lr=1e-3"])
        spec = megatron_spec(cfg, "actor").model
        torch.manual_seed(0)
        w = MegatronWorker.from_spec(spec)
        calls = [0]
        for layer in w.model.decoder.layers:
            layer.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        ids = torch.randint(0, w.args.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[:, 0] = 0
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
        steps = [w.train_step(batch, loss_fn, micro_batch_size=2) for _ in range(2)]
        logp = w.compute_logp(batch, micro_batch_size=2)["logprobs"]  # no grad: no recompute
        out[str(on)] = {"recompute": w.config.recompute_granularity, "spec": spec.recompute,
                        "layer_forwards": calls[0], "grad_norms": [s["grad_norm"] for s in steps],
                        "weights": float(sum(p.double().sum() for p in w.model.parameters())),
                        "logp": float(logp.double().sum())}
        del w
print(json.dumps(out))
"""


def test_gradient_checkpointing_recomputes_each_layer_and_changes_nothing(tiny_qwen2, tmp_path):
    proc = subprocess.run([sys.executable, "-c", _PROGRAM, str(tiny_qwen2)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MASTER_PORT": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    off, on = runs["False"], runs["True"]
    assert (off["recompute"], off["spec"], on["recompute"], on["spec"]) == \
        (None, False, "full", True)
    # 2 layers x 2 micro-batches x 2 steps forwards; recompute runs each again in backward
    # (and once each in the log-prob pass after them, which keeps nothing for backward)
    assert off["layer_forwards"] == 8 + 4 and on["layer_forwards"] == 16 + 4
    assert on["grad_norms"] == off["grad_norms"] and on["weights"] == off["weights"]
    assert on["logp"] == off["logp"]
