"""Side-by-side cost of megarl's core attention paths (attention.py), one layer's forward +
backward, on this machine's device (CUDA if present, else the CPU).

1. GQA: K/V repeated to the query heads' count (`repeat_interleave`, what megarl did) against
   SDPA's `enable_gqa` (what it does): time, and the bytes autograd keeps for backward (what
   a layer's activations cost; on CUDA also the peak allocated).
2. Packed micro-batch (THD) through `SDPAttention` itself, `--layers` layers: one SDPA call
   per distinct length, planned per layer (a new PackedSeqParams each layer: a host read of
   cu_seqlens each layer, as megarl did) or once per micro-batch (`plan_of`), and
   FlexAttention's document mask (`flex`; compiled on CUDA, eager on the CPU).

    python tools/bench_attention.py [--heads 12 --kv-heads 2 --head-dim 128] [--seq 2048]
        [--pack 4096] [--layers 4] [--dtype bfloat16] [--json out.json]

Defaults are Qwen2.5-1.5B's attention (12 query heads, 2 KV heads, head_dim 128); a packed
row's lengths are multiples of 64 up to 1024 (RL responses), with repeats.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

logger = logging.getLogger("bench_attention")


def saved_bytes(fn) -> tuple[object, int]:
    """`fn()`'s result and the bytes of the distinct tensors autograd saved for backward."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def timed(fn, dev, repeat: int) -> float:
    """Median seconds of `fn()` (forward + backward) over `repeat` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def bench_gqa(a, dev, dtype) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, a.heads, a.seq, a.head_dim, device=dev, dtype=dtype, generator=g,
                    requires_grad=True)
    k, v = (torch.randn(1, a.kv_heads, a.seq, a.head_dim, device=dev, dtype=dtype, generator=g,
                        requires_grad=True) for _ in range(2))
    rep = a.heads // a.kv_heads

    def repeat():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                              v.repeat_interleave(rep, 1), is_causal=True)

    def native():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    out = {}
    for name, fn in (("repeat_interleave", repeat), ("enable_gqa", native)):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
        o, kept = saved_bytes(fn)
        peak = (torch.cuda.max_memory_allocated() - base) if dev.type == "cuda" else None
        o.sum().backward()
        out[name] = {"fwd_bwd_ms": 1e3 * timed(lambda: fn().sum().backward(), dev, a.repeat),
                     "saved_for_backward_mb": kept / 2**20,
                     "forward_peak_mb": None if peak is None else peak / 2**20}
    ref = repeat()
    out["max_abs_diff"] = (native() - ref).abs().max().item()
    return out


def attention(a, dtype, backend: str):
    """megarl's core attention module for this shape (a one-rank world must exist)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.backends.megatron.attention import SDPAttention

    config = TransformerConfig(num_layers=1, hidden_size=a.heads * a.head_dim,
                               num_attention_heads=a.heads, num_query_groups=a.kv_heads,
                               kv_channels=a.head_dim, params_dtype=dtype,
                               bf16=dtype == torch.bfloat16, attention_dropout=0.0)
    return SDPAttention(config, 1, AttnMaskType.causal, "self", backend=backend)


def bench_packed(a, dev, dtype) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams

    g = torch.Generator().manual_seed(1)
    lengths = []
    while sum(lengths) < a.pack:
        lengths.append(int(torch.randint(1, 17, (1,), generator=g)) * 64)
    lengths[-1] -= sum(lengths) - a.pack
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32).to(dev)
    T = a.pack
    gd = torch.Generator(device=dev).manual_seed(2)
    q = torch.randn(T, a.heads, a.head_dim, device=dev, dtype=dtype, generator=gd,
                    requires_grad=True)
    k, v = (torch.randn(T, a.kv_heads, a.head_dim, device=dev, dtype=dtype, generator=gd,
                        requires_grad=True) for _ in range(2))
    per_length, flex = attention(a, dtype, "unfused" if dev.type == "cpu" else "flash"), \
        attention(a, dtype, "flex")

    def params():
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)

    def run(attn, plan_per_layer: bool):
        p = params()
        return lambda: sum(attn(q, k, v, None, packed_seq_params=params() if plan_per_layer
                                else p).float().sum() for _ in range(a.layers))

    out = {"lengths": lengths, "distinct_lengths": len(set(lengths)), "layers": a.layers,
           "per_length_kernel": per_length.backend}
    with torch.no_grad():
        ref = per_length(q, k, v, None, packed_seq_params=params())
        out["flex_max_abs_diff"] = (flex(q, k, v, None, packed_seq_params=params())
                                    - ref).abs().max().item()
    for name, fn in (("per_length_plan_per_layer", run(per_length, True)),
                     ("per_length_plan_per_micro_batch", run(per_length, False)),
                     ("flex", run(flex, False))):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        out[name] = {"fwd_bwd_ms": 1e3 * timed(lambda: fn().backward(), dev, a.repeat)}
        if dev.type == "cuda":
            out[name]["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=None, help="GQA bench length (CPU 1024, CUDA 4096)")
    ap.add_argument("--pack", type=int, default=None,
                    help="packed row tokens (CPU 2048, CUDA 16384)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA)")
    ap.add_argument("--skip", default="", help="comma list: gqa,packed")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a.seq = a.seq or (4096 if dev.type == "cuda" else 1024)
    a.pack = a.pack or (16384 if dev.type == "cuda" else 2048)
    dtype = getattr(torch, a.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": str(dtype), "threads": torch.get_num_threads(),
           "shape": {"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
                     "seq": a.seq, "pack": a.pack}}
    skip = set(a.skip.split(","))
    if "gqa" not in skip:
        res["gqa"] = bench_gqa(a, dev, dtype)
    if "packed" not in skip:
        from megarl.backends.megatron.parallel import init_distributed, rank_program

        with rank_program():
            init_distributed(1, 1)
            res["packed"] = bench_packed(a, dev, dtype)
    logger.info("%s", json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
