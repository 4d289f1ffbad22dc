"""Peak memory of the log-prob + entropy pass over the logits, forward and backward: the plain
path (`vocab_parallel_logprobs`, several fp32 [tokens, vocab] tensors kept for backward)
against the token-chunked one (`actor.entropy_from_logits_with_chunking`).

    python tools/bench_logprobs.py [--tokens 1024] [--vocab 151936] [--chunk 2048]
                                   [--dtypes float32,bfloat16] [--device cpu|cuda]

Each (dtype, path) runs in a fresh process: it makes the logits (a leaf that wants a
gradient, as the output layer's output does) and the targets, then measures the peak memory
above that point of one forward (log-probs and entropy), a loss over both and the backward,
which writes the logits' gradient (one logits-sized tensor in the logits' dtype, on both
paths). CPU: the process's peak resident memory (Linux `clear_refs`, VmHWM); CUDA:
`torch.cuda.max_memory_allocated`. The default 1,024 tokens keep the plain path within a
shared CPU machine's memory; the ratio barely depends on the token count, and on a GPU
`--tokens 4096` is the 4k-token micro-batch of the issue.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from megarl.utils.procmem import reset_peak, status_kib

ROOT = Path(__file__).resolve().parent.parent


def _side(tokens: int, vocab: int, chunk: int, dtype: str, path: str, device: str) -> dict:
    import torch

    from megarl.backends.megatron.logprobs import token_logprobs

    torch.manual_seed(0)
    dev = torch.device(device)
    logits = torch.randn(1, tokens, vocab, device=dev).to(getattr(torch, dtype))
    logits.requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        reset_peak()  # VmHWM := VmRSS
        base = status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    lp, ent = token_logprobs(logits, targets, vocab, 1.0, True,
                             chunk if path == "chunked" else None)
    (lp.sum() + 0.01 * ent.sum()).backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = status_kib("VmHWM") * 1024 - base
    return {"peak_mib": peak / 2**20, "seconds": time.perf_counter() - t0,
            "logits_mib": logits.numel() * logits.element_size() / 2**20,
            "logp_sum": float(lp.detach().double().sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        dtype, path = a.side.split(":")
        print(json.dumps(_side(a.tokens, a.vocab, a.chunk, dtype, path, a.device)))
        return
    print(f"log-prob + entropy, forward + backward: {a.tokens} tokens x vocab {a.vocab}, "
          f"chunk {a.chunk}, {a.device}; peak memory above the logits")
    print(f"{'dtype':<10}{'logits MiB':>12}{'plain MiB':>12}{'chunked MiB':>13}{'ratio':>8}"
          f"{'plain s':>9}{'chunked s':>11}")
    for dtype in a.dtypes.split(","):
        res = {}
        for path in ("plain", "chunked"):
            cmd = [sys.executable, __file__, "--tokens", str(a.tokens), "--vocab", str(a.vocab),
                   "--chunk", str(a.chunk), "--device", a.device, "--side", f"{dtype}:{path}"]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            res[path] = json.loads(out.stdout.strip().splitlines()[-1])
        p, c = res["plain"], res["chunked"]
        # the same numbers: the two paths agree to fp32 summation order
        assert abs(p["logp_sum"] - c["logp_sum"]) <= 1e-6 * max(1.0, abs(p["logp_sum"])) * 10
        print(f"{dtype:<10}{p['logits_mib']:>12.0f}{p['peak_mib']:>12.0f}{c['peak_mib']:>13.0f}"
              f"{p['peak_mib'] / max(c['peak_mib'], 1e-9):>8.1f}{p['seconds']:>9.2f}"
              f"{c['seconds']:>11.2f}")


if __name__ == "__main__":
    main()
