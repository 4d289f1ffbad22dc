"""Weight-sync benchmark: bucketed sync vs one raw broadcast, and trainer blocking time.

    python tools/bench_weight_sync.py [--hidden 1024 --layers 4 --vocab 32000]
        [--produce-mb 64 --consume-mb 16] [--repeat 3] [--json out.json]

One embedded engine (rank 1) on its own event-loop thread, the producer (rank 0) here, one
gloo update group between them (loopback TCP). On that group and the same bytes it times:
- raw: one `broadcast` of a flat tensor holding the whole model;
- bucketed (no dual buffer): pause, stream buckets into the live weights, continue;
- bucketed (dual buffer): snapshot (what the trainer waits for), then the background transfer
  into the engine's staging buffer and the swap at a safe point.
Prints effective GB/s and the ratios bucketed/raw (aim >= 0.9) and blocking dual/no-dual
(aim <= 0.1); best of --repeat for each.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time

import torch
from safetensors.torch import load_file

from megarl.rollout.engine import EmbeddedEngine
from megarl.utils.launch import free_port
from megarl.utils.tiny_model import make_tiny_model
from megarl.weight_sync.producer import WeightProducer
from megarl.weight_sync.protocol import SyncConfig
from megarl.weight_sync.transports import LocalLink


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--produce-mb", type=float, default=64)
    ap.add_argument("--consume-mb", type=float, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp()
    model_dir = make_tiny_model(f"{tmp}/m", "qwen2", vocab_size=args.vocab,
                                hidden_size=args.hidden, num_layers=args.layers, num_heads=8,
                                num_kv_heads=4, intermediate_size=args.hidden * 3)
    named = sorted(load_file(str(model_dir / "model.safetensors")).items())
    total = sum(t.numel() * t.element_size() for _, t in named)
    engine = EmbeddedEngine(model_dir, load_tokenizer=False, weight_version="v0")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cfg = SyncConfig(produce_bucket_mb=args.produce_mb, consume_bucket_mb=args.consume_mb,
                     timeout_s=600)
    prod = WeightProducer([LocalLink(engine, loop)], cfg, group_name="bench")
    prod.connect("127.0.0.1", free_port())
    engine_group = engine._groups["bench"]

    # Touched once, up front: page faults are not part of the transfer.
    src, dst = torch.ones(total, dtype=torch.uint8), torch.zeros(total, dtype=torch.uint8)

    def raw() -> float:
        t = threading.Thread(target=engine_group.broadcast, args=(dst, 0))
        t0 = time.perf_counter()
        t.start()
        prod.group.broadcast(src, 0)
        t.join()
        return time.perf_counter() - t0

    version = iter(range(1, 10_000))

    def paused() -> tuple[float, float]:
        t0 = time.perf_counter()
        prod.pause_engines()
        t1 = time.perf_counter()
        stats = prod.send(iter(named), f"v{next(version)}", direct=True)
        t2 = time.perf_counter()
        prod.resume_engines()
        return t2 - t1, time.perf_counter() - t0  # transfer, trainer blocked

    def dual() -> tuple[float, float]:
        t0 = time.perf_counter()
        snap = prod.snapshot(iter(named), f"v{next(version)}")
        t1 = time.perf_counter()
        prod.start(snap)
        stats = prod.wait()
        return stats.transfer_s, t1 - t0

    raw()  # warm up connections and allocator
    paused()
    dual()
    r = min(raw() for _ in range(args.repeat))
    p = [paused() for _ in range(args.repeat)]
    d = [dual() for _ in range(args.repeat)]
    res = {
        "model_mb": total / 2 ** 20, "produce_mb": args.produce_mb, "consume_mb": args.consume_mb,
        "raw_gbps": total / r / 1e9,
        "bucketed_gbps": total / min(x[0] for x in p) / 1e9,
        "dual_transfer_gbps": total / min(x[0] for x in d) / 1e9,
        "blocking_no_dual_s": min(x[1] for x in p),
        "blocking_dual_s": min(x[1] for x in d),
        "engine_peak_piece_mb": engine.weight_memory()["peak_piece_bytes"] / 2 ** 20,
        "engine_staging_mb": engine.weight_memory()["staging_bytes"] / 2 ** 20,
    }
    res["bucketed_vs_raw"] = res["bucketed_gbps"] / res["raw_gbps"]
    res["dual_transfer_vs_raw"] = res["dual_transfer_gbps"] / res["raw_gbps"]
    res["blocking_dual_vs_no_dual"] = res["blocking_dual_s"] / res["blocking_no_dual_s"]
    prod.close()
    asyncio.run_coroutine_threadsafe(engine.close(), loop).result(30)
    for k, v in res.items():
        print(f"{k:28s} {v:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
