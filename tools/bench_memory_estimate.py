"""How far the dry run's trainer memory estimate (`megarl.controller.memory`, what
`megarl train --dry-run` prints and checks) is from what a train step really holds: one real
Megatron train step per layout, on CPU, in a fresh process, against the estimate of the same
config.

    python tools/bench_memory_estimate.py [--hidden 512] [--layers 4] [--vocab 16384]
                                          [--tokens 1024] [--cases dense,tp2,packed,recompute]

Each case is a torchrun job of its own (gloo, one process per rank, `OMP_NUM_THREADS=1`).
Every rank notes its resident memory before the worker exists, builds it (weights, Megatron's
DDP grad buffer, the optimizer), trains one step to warm up (after which the optimizer's state
exists), resets its peak resident memory (Linux `clear_refs`) and trains one more step. Two
figures per rank, the largest rank's reported:

- state: resident memory at the start of the measured step above the memory before the
  worker, against the estimate's params + grads + optimizer items;
- step: that step's peak resident memory above its start (activations, the log-prob path's
  fp32 vocab tensors, temporaries), against the estimate's activations item.

glibc is told to map every allocation over 128 KiB on its own (`MALLOC_MMAP_THRESHOLD_`), so
freed tensors leave the resident set at once and the peak is the peak of live tensors (plus
the interpreter's and the libraries' own small allocations). On a GPU the same items are
device memory; on the CPU the resident set also holds the code, Python objects and gloo's
buffers, which the estimate does not count (they are not on the device). Not compared: the
weight-sync snapshot (no sender here) and the rollout side.

The model is a random Qwen2-shaped one (GQA, SwiGLU, untied embeddings) of the given width,
depth and vocabulary, fp32 (the CPU's dtype), written to a temporary folder.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megarl.utils.procmem import reset_peak, status_kib

ROOT = Path(__file__).resolve().parent.parent
A, M = "actor_rollout_ref", "actor_rollout_ref.actor.megatron"

# name -> (what it is, ranks, config overrides beyond the shape's)
CASES = {
    "dense": ("dense, 1 rank, padded micro-batches", 1, []),
    "tp2": ("dense, TP2 (2 gloo ranks), padded", 2, [f"{M}.tensor_model_parallel_size=2"]),
    "packed": ("dense, 1 rank, packed (use_dynamic_bsz)", 1,
               [f"{A}.actor.use_dynamic_bsz=true"]),
    "recompute": ("dense, 1 rank, full recompute (uniform, 1 layer)", 1,
                  [f"{A}.model.enable_gradient_checkpointing=true"]),
    "pp2": ("dense, PP2 (2 gloo ranks), padded, 2 micro-batches", 2,
            [f"{M}.pipeline_model_parallel_size=2"]),
    "chunked": ("dense, 1 rank, padded, log-probs in 256-token chunks", 1,
                [f"{A}.actor.entropy_from_logits_with_chunking=true",
                 f"{A}.actor.entropy_from_logits_chunk_size=256"]),
}


def _config(model: str, case: str, width: int, rows: int, ranks: int):
    """The run config of a case: what the dry run would be given."""
    from megarl.config import load_config

    over = [f"{A}.model.path={model}", "data.max_prompt_length=1",
            f"data.max_response_length={width - 1}",
            f"{A}.actor.ppo_micro_batch_size_per_gpu={rows}",
            f"{A}.actor.ppo_max_token_len_per_gpu={rows * width}",
            f"{A}.rollout.log_prob_micro_batch_size_per_gpu={rows}",
            f"{A}.model.enable_gradient_checkpointing=false", f"{M}.params_dtype=float32",
            f"trainer.n_gpus_per_node={max(2, ranks)}", "trainer.device=cpu"]
    return load_config(None, over + CASES[case][2])


def _rank(model: str, case: str, width: int, rows: int, out: str) -> None:
    """One rank of a case: build, a warm-up step, the measured step."""
    import torch
    import torch.distributed as dist

    from megarl.backends.megatron.parallel import rank_program
    from megarl.backends.megatron.worker import MegatronWorker
    from megarl.cluster.spec import megatron_spec
    from megarl.controller.micro_batches import micro_batching

    def loss_fn(logprobs, entropy, mb):
        mask = mb["loss_mask"].float()
        # entropy is always computed in training (cluster/actors.py); 0 × keeps its graph
        return -(logprobs * mask).sum() / mask.sum() + 0.0 * (entropy * mask).sum(), {}

    cfg = _config(model, case, width, rows, int(os.environ["WORLD_SIZE"]))
    with rank_program():
        base0 = status_kib("RssAnon")
        torch.manual_seed(0)
        w = MegatronWorker.from_spec(megatron_spec(cfg, "actor").model)
        micro = micro_batching(cfg, "actor")
        n = 2 * rows  # two micro-batches: PP has one in flight while the other starts
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, w.args.vocab_size, (n, width), generator=gen)
        mask = torch.ones_like(ids)
        if case == "packed":  # rows of unequal lengths, each micro-batch's budget filled
            lengths = [width // 2, width + width // 2] * (n // 2)
            ids = torch.randint(0, w.args.vocab_size, (n, max(lengths)), generator=gen)
            mask = (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
        loss_mask = mask.clone()
        loss_mask[:, 0] = 0
        batch = {"input_ids": ids * mask, "attention_mask": mask, "loss_mask": loss_mask}
        w.train_step(batch, loss_fn, micro, with_entropy=True)
        dist.barrier()
        # the state above anonymous memory only: the safetensors the weights were read from
        # stay mapped (file pages), which no device holds
        state = status_kib("RssAnon") - base0
        start = status_kib("VmRSS")
        reset_peak()  # the peak (VmHWM) restarts from now
        t = time.perf_counter()
        step = w.train_step(batch, loss_fn, micro, with_entropy=True)
        seconds = time.perf_counter() - t
        Path(f"{out}.{dist.get_rank()}").write_text(json.dumps({
            "state_mib": state / 1024, "step_mib": (status_kib("VmHWM") - start) / 1024,
            "seconds": seconds, "loss": step["loss"]}))


def _measure(model: str, case: str, width: int, rows: int) -> dict:
    ranks = CASES[case][1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank")
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                   MALLOC_MMAP_THRESHOLD_=str(128 << 10))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", __file__, "--rank-of", case, "--model", model,
               "--width", str(width), "--rows", str(rows), "--out", out]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{case} failed:\n{p.stderr[-3000:]}")
        got = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]
    return {k: max(g[k] for g in got) for k in ("state_mib", "step_mib", "seconds")}


def _estimate(model: str, case: str, width: int, rows: int) -> dict:
    """The dry run's trainer items for the case, split as the measurement is."""
    from megarl.backends.megatron.hf.model_config import read_model_args
    from megarl.controller import memory

    ranks = CASES[case][1]
    items = memory.trainer_memory(_config(model, case, width, rows, ranks),
                                  read_model_args(model), ranks)
    step = sum(i.nbytes for i in items if i.label.startswith("trainer activations"))
    state = sum(i.nbytes for i in items) - step
    return {"state_mib": state / 2**20, "step_mib": step / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=1024, help="token slots per micro-batch")
    ap.add_argument("--rows", type=int, default=2, help="rows per padded micro-batch")
    ap.add_argument("--cases", default="dense,tp2,packed,recompute")
    ap.add_argument("--rank-of", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_of:
        _rank(a.model, a.rank_of, a.width, a.rows, a.out)
        return
    from megarl.utils.tiny_model import make_tiny_model

    width = a.tokens // a.rows
    cases = a.cases.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "m", "qwen2", hidden_size=a.hidden,
                                    num_layers=a.layers, num_heads=8, num_kv_heads=2,
                                    intermediate_size=a.hidden * 11 // 2,
                                    tie_word_embeddings=False, model_vocab_size=a.vocab,
                                    max_position_embeddings=max(1024, 2 * width)))
        for case in cases:
            rows.append((case, _measure(model, case, width, a.rows),
                         _estimate(model, case, width, a.rows)))
    print(f"train step, Qwen2-shaped: hidden {a.hidden}, {a.layers} layers, ffn "
          f"{a.hidden * 11 // 2}, heads 8/2 kv, vocab {a.vocab}, fp32, {a.tokens} token slots "
          "per micro-batch, CPU (largest rank; MiB):")
    print(f"  {'case':<50} {'state est':>9} {'meas':>7} {'step est':>9} {'meas':>7} "
          f"{'step ratio':>10} {'total ratio':>11}")
    for case, m, e in rows:
        total = (m["state_mib"] + m["step_mib"]) / (e["state_mib"] + e["step_mib"])
        print(f"  {CASES[case][0]:<50} {e['state_mib']:9.0f} {m['state_mib']:7.0f} "
              f"{e['step_mib']:9.0f} {m['step_mib']:7.0f} "
              f"{m['step_mib'] / e['step_mib']:10.2f} {total:11.2f}")
    print("  ratio = measured / estimated (1.00: exact; the aim is within 0.80-1.20)")


if __name__ == "__main__":
    main()
