"""Weight-sync benchmark: bucketed sync vs one raw broadcast, and trainer blocking time.

    python tools/bench_weight_sync.py [--hidden 1024 --layers 4 --vocab 32000]
        [--produce-mb 64 --consume-mb 16] [--repeat 5] [--json out.json]

As in production, the engine runs in its own process: an embedded engine behind its HTTP
server (rank 1), reached through `HTTPLink`; the producer (rank 0) is this process; one gloo
update group between them (loopback TCP). On that group and the same bytes it times:
- raw: one `broadcast` of a flat tensor holding the whole model into a preallocated tensor in
  the engine process (announced over HTTP and answered, like one bucket);
- bucketed (no dual buffer): pause, stream buckets into the live weights, continue;
- bucketed (dual buffer): snapshot (what the trainer waits for), then the background transfer
  into the engine's staging buffer and the swap at a safe point.
Prints effective GB/s and the ratios bucketed/raw (aim >= 0.9) and blocking dual/no-dual
(aim <= 0.1); best of --repeat for each, the variants interleaved so that load from other
work on a shared box hits them alike.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import load_file

from megarl.utils.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


def serve_engine(model_dir: str, port: int) -> None:
    """The engine process: the embedded server plus two bench-only routes."""
    from aiohttp import web

    from megarl.rollout.engine import EmbeddedEngine
    from megarl.rollout.server import RolloutServer

    logging.basicConfig(level=logging.WARNING)
    engine = EmbeddedEngine(model_dir, load_tokenizer=False, weight_version="v0")
    app = RolloutServer(engine).app
    bufs: dict[int, torch.Tensor] = {}

    async def raw(request):  # receive one flat broadcast of `nbytes` on the update group
        b = await request.json()
        n = int(b["nbytes"])
        if n not in bufs:
            bufs[n] = torch.zeros(n, dtype=torch.uint8)  # touched: no page faults when timed
        await asyncio.to_thread(engine._groups[b["group_name"]].broadcast, bufs[n], 0)
        return web.json_response({"success": True})

    async def memory(request):
        return web.json_response(engine.weight_memory())

    app.router.add_post("/bench/raw", raw)
    app.router.add_post("/bench/memory", memory)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def start_engine(model_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-engine", str(model_dir),
                             "--port", str(port)], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError("engine process exited")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return proc, url
        except OSError:
            if time.time() > deadline:
                raise RuntimeError("engine server did not come up") from None
            time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--produce-mb", type=float, default=64)
    ap.add_argument("--consume-mb", type=float, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve-engine", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_engine:
        return serve_engine(args.serve_engine, args.port)

    from megarl.utils.tiny_model import make_tiny_model

    tmp = tempfile.mkdtemp()
    model_dir = make_tiny_model(f"{tmp}/m", "qwen2", vocab_size=args.vocab,
                                hidden_size=args.hidden, num_layers=args.layers, num_heads=8,
                                num_kv_heads=4, intermediate_size=args.hidden * 3)
    # Cloned: a trainer's weights live in ordinary memory, not in a mapped file.
    named = [(n, t.clone()) for n, t in sorted(load_file(str(model_dir / "model.safetensors"))
                                               .items())]
    total = sum(t.numel() * t.element_size() for _, t in named)
    proc, url = start_engine(model_dir)
    try:
        res = run(args, named, total, url)
    finally:
        proc.terminate()
        proc.wait(30)
    for k, v in res.items():
        print(f"{k:28s} {v:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def run(args, named, total, url) -> dict:
    from megarl.weight_sync.producer import WeightProducer
    from megarl.weight_sync.protocol import SyncConfig
    from megarl.weight_sync.transports import HTTPLink

    cfg = SyncConfig(produce_bucket_mb=args.produce_mb, consume_bucket_mb=args.consume_mb,
                     timeout_s=600)
    link = HTTPLink(url)
    prod = WeightProducer([link], cfg, group_name="bench")
    prod.connect("127.0.0.1", free_port())
    src = torch.ones(total, dtype=torch.uint8)  # touched once, up front

    def raw() -> float:
        t0 = time.perf_counter()
        answer = prod._io.submit(link.client._call("POST", "/bench/raw",
                                                   {"group_name": "bench", "nbytes": total}))
        prod.group.broadcast(src, 0)
        answer.result()
        return time.perf_counter() - t0

    version = iter(range(1, 10_000))

    def paused() -> tuple[float, float]:
        t0 = time.perf_counter()
        prod.pause_engines()
        t1 = time.perf_counter()
        prod.send(iter(named), f"v{next(version)}", direct=True)
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

    raw()  # warm up connections and allocators
    paused()
    dual()
    # Interleaved, so drifting load on the shared box hits every variant alike.
    r, p, d = [], [], []
    for _ in range(args.repeat):
        r.append(raw())
        p.append(paused())
        d.append(dual())
    mem = prod._io.submit(link.client._call("POST", "/bench/memory", {})).result()
    prod.close()
    res = {
        "model_mb": total / 2 ** 20, "produce_mb": args.produce_mb, "consume_mb": args.consume_mb,
        "raw_gbps": total / min(r) / 1e9,
        "bucketed_gbps": total / min(x[0] for x in p) / 1e9,
        "dual_transfer_gbps": total / min(x[0] for x in d) / 1e9,
        "blocking_no_dual_s": min(x[1] for x in p),
        "blocking_dual_s": min(x[1] for x in d),
        "engine_peak_piece_mb": mem["peak_piece_bytes"] / 2 ** 20,
        "engine_staging_mb": mem["staging_bytes"] / 2 ** 20,
    }
    res["bucketed_vs_raw"] = res["bucketed_gbps"] / res["raw_gbps"]
    res["dual_transfer_vs_raw"] = res["dual_transfer_gbps"] / res["raw_gbps"]
    res["blocking_dual_vs_no_dual"] = res["blocking_dual_s"] / res["blocking_no_dual_s"]
    return res


if __name__ == "__main__":
    main()
