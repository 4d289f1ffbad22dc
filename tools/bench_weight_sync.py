"""Weight-sync benchmark: bucketed sync vs one raw broadcast, engine pause, trainer blocking.

    python tools/bench_weight_sync.py [--hidden 1024 --layers 4 --vocab 32000]
        [--produce-mb 64 --consume-mb 16] [--repeat 5] [--json out.json]

As in production, each engine runs in its own process (`python -m megarl.rollout.server
--load-format dummy`, started here and torn down at the end, also on error), reached through
`EngineLink` over stock SGLang's HTTP contract; the producer (`WeightProducer`, rank 0) is this
process; one gloo update group per engine over loopback. Two engines:

- *contract*: `--sglang-contract`, which loads every update call into the live weights at once
  as stock SGLang does, so generation is paused for the version (`pause_for_update=True`);
- *staged*: the default embedded engine, which stages a version and swaps it in at
  `end_weight_update` (`pause_for_update=False`).

Variants, on the same weights (changed before every run, so each run delivers new bytes):

- raw: the whole model as ONE flattened bucket (bucket size = the model), packed before the
  clock starts: one `/update_weights_from_distributed` call, one broadcast, one answer (which
  includes the engine's receive allocation and its load). Measured on both engines; each
  bucketed variant is compared with the raw run on its own engine;
- stream: `--consume-mb` buckets packed from the trainer's tensors as they go (no dual buffer),
  into the contract engine, paused throughout;
- dual: snapshot (all the trainer waits for), then the background delivery, into the contract
  engine and into the staged engine;
- wire (reference, "vs wire"): the same flat bytes broadcast to a bare peer process that
  receives into one preallocated buffer, with no HTTP call, allocation or load: what loopback
  gloo itself delivers on this machine.

Transfer time is `WeightProducer.send` (first update call to last answer); the engine's pause
is pause -> continue (open_version .. close_version, the coordinator's `SyncStats.pause_s`);
the trainer's blocking time is the whole delivery without dual buffer, the snapshot with it.
After every run the engine's `/weights_checker` checksums are compared with
`tensor_checksum` of the sent tensors; any mismatch makes the exit status 1.
Best of --repeat for each figure, the variants interleaved so machine load hits all alike.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench_weight_sync")


# -- engine processes ------------------------------------------------------------------------
class EngineProcess:
    """`python -m megarl.rollout.server` on a free port; its log goes to a file."""

    def __init__(self, model_dir: Path, log_dir: Path, contract: bool, device: str = "cpu"):
        from megarl.utils.launch import free_port

        self.name = "contract" if contract else "staged"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"engine-{self.name}.log"
        cmd = [sys.executable, "-m", "megarl.rollout.server", "--model-path", str(model_dir),
               "--port", str(self.port), "--load-format", "dummy", "--weight-version", "0",
               "--skip-tokenizer-init", "--log-level", "warning", "--device", device]
        if contract:
            cmd.append("--sglang-contract")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited with {self.proc.returncode}; "
                                   f"see {self.log_path}:\n{self.log_path.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine {self.name} did not come up in {timeout_s:g} s"
                                       ) from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


class WirePeer:
    """The wire's own speed, for reference: a process that joins a gloo group of two and
    receives each broadcast into one preallocated, touched buffer (no HTTP, no allocation, no
    load), acknowledging each with a one-element broadcast back."""

    def __init__(self, nbytes: int, log_dir: Path):
        from megarl.utils.launch import free_port
        from megarl.rollout.weights import new_update_group

        self.nbytes, port = nbytes, free_port()
        self._log = open(log_dir / "wire-peer.log", "w")
        self.proc = subprocess.Popen([sys.executable, __file__, "--wire-peer", str(port),
                                      "--wire-bytes", str(nbytes)], cwd=ROOT,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.group = None
        try:
            self.group = new_update_group("127.0.0.1", port, 0, 2, "bench-wire", "gloo", 120)
        except BaseException:
            self.stop()
            raise
        self._flag = torch.zeros(1, dtype=torch.int64)

    def send(self, flat: torch.Tensor) -> float:
        self._flag.fill_(1)
        self.group.broadcast(self._flag, 0)  # the peer posts its receive after this
        t0 = time.perf_counter()
        self.group.broadcast(flat, 0)
        self.group.broadcast(self._flag, 1)  # received
        return time.perf_counter() - t0

    def stop(self) -> None:
        try:
            if self.group is not None and self.proc.poll() is None:
                self.group.broadcast(torch.zeros(1, dtype=torch.int64), 0)  # stop
                self.proc.wait(30)
        except Exception:  # noqa: BLE001 - tearing down; the process is killed below
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        if self.group is not None:
            self.group.close()
            self.group = None
        self._log.close()


def wire_peer(port: int, nbytes: int) -> int:
    from megarl.rollout.weights import new_update_group

    g = new_update_group("127.0.0.1", port, 1, 2, "bench-wire", "gloo", 120)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    flag = torch.zeros(1, dtype=torch.int64)
    while True:
        g.broadcast(flag, 0)
        if not int(flag.item()):
            break
        g.broadcast(buf, 0)
        g.broadcast(flag, 1)
    g.close()
    return 0


# -- one run of one variant ------------------------------------------------------------------
@dataclass
class Run:
    transfer_s: float
    blocking_s: float
    pause_s: float | None  # None: the engine was not paused
    exact: bool | None  # None: nothing to check


@dataclass
class Variant:
    name: str
    engine: str
    baseline: str | None  # the raw variant it is compared with
    runs: list[Run] = field(default_factory=list)
    exact: bool | None = True  # every run, the warm-up included (None: nothing to check)


class Bench:
    def __init__(self, args, named: list[tuple[str, torch.Tensor]], producers: dict,
                 peer: WirePeer):
        self.args, self.named, self.producers, self.peer = args, named, producers, peer
        self.total = sum(t.numel() * t.element_size() for _, t in named)
        self.version = 0
        self.mismatches: list[str] = []
        self._raw_buf = torch.empty(self.total, dtype=torch.uint8)
        self._raw_buf.fill_(0)  # touched: no page faults when it is read under the clock
        self._gen = torch.Generator().manual_seed(0)
        self._hash_pool = concurrent.futures.ThreadPoolExecutor(1)

    def _next_weights(self) -> int:
        """A new version: a few elements of every tensor changed, so every tensor's checksum
        changes and an update that did not land is caught."""
        self.version += 1
        for _, t in self.named:
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (4,), generator=self._gen)
            flat[idx] = torch.randn(4, generator=self._gen).to(flat.dtype)
        return self.version

    def _check(self, engine: str, what: str) -> bool:
        from megarl.rollout.weights import tensor_checksum

        want = self._hash_pool.submit(lambda: {n: tensor_checksum(t) for n, t in self.named})
        got_all = self.producers[engine].engine_checksums()
        want = want.result()
        ok = True
        for got in got_all:
            bad = [n for n in want if got.get(n) != want[n]]
            if bad:
                ok = False
                msg = (f"{what} v{self.version} on {engine}: {len(bad)} tensor(s) differ, "
                       f"first {bad[0]}")
                logger.error("MISMATCH %s", msg)
                self.mismatches.append(msg)
        return ok

    def _stats(self):
        from megarl.weight_sync.producer import SyncStats

        return SyncStats(self.version)

    def wire(self, engine: str) -> Run:
        t = self.peer.send(self._raw_buf)
        return Run(t, t, None, None)

    def raw(self, engine: str) -> Run:
        """One flattened bucket holding the whole model, packed before the clock starts."""
        from megarl.weight_sync.buckets import BucketPacker

        prod, v = self.producers[engine], self._next_weights()
        packer = BucketPacker(v, self.total + 1)
        buckets = [b for n, t in self.named for b in packer.add(n, t)] + list(packer.finish())
        if len(buckets) != 1:
            raise RuntimeError(f"raw baseline needs one bucket, got {len(buckets)} (mixed "
                               "dtypes?)")
        buckets[0].snapshot(lambda i, n: self._raw_buf)
        prod.open_version()
        try:
            t0 = time.perf_counter()
            prod.send(buckets, v, True, self._stats())
            transfer = time.perf_counter() - t0
        finally:
            prod.close_version(dict(prod.stale))
        return Run(transfer, transfer, None, self._check(engine, "raw"))

    def _deliver(self, prod, buckets, v) -> tuple[float, float]:
        """open_version .. close_version as the coordinator runs it: (transfer_s, pause_s)."""
        t0 = time.perf_counter()
        prod.open_version()
        try:
            t1 = time.perf_counter()
            prod.send(buckets, v, True, self._stats())
            t2 = time.perf_counter()
        finally:
            prod.close_version(dict(prod.stale))
        return t2 - t1, time.perf_counter() - t0

    def stream(self, engine: str) -> Run:
        prod, v = self.producers[engine], self._next_weights()
        t0 = time.perf_counter()
        transfer, span = self._deliver(prod, prod.stream(iter(self.named), v), v)
        blocking = time.perf_counter() - t0
        paused = span if prod.links[0].pause_for_update else None
        return Run(transfer, blocking, paused, self._check(engine, "stream"))

    def dual(self, engine: str) -> Run:
        prod, v = self.producers[engine], self._next_weights()
        snap = prod.snapshot(iter(self.named), v)
        out = {}
        prod.start(lambda: out.update(zip(("transfer", "span"),
                                          self._deliver(prod, snap.buckets, v))))
        prod.wait(self.args.timeout)
        paused = out["span"] if prod.links[0].pause_for_update else None
        return Run(out["transfer"], snap.blocking_s, paused, self._check(engine, "dual"))

    def close(self):
        self._hash_pool.shutdown()


VARIANTS = [  # (name, engine, method, baseline): the order of one interleaved round
    ("wire", "peer", "wire", None),
    ("raw", "contract", "raw", None),
    ("stream", "contract", "stream", "raw/contract"),
    ("dual", "contract", "dual", "raw/contract"),
    ("raw", "staged", "raw", None),
    ("dual", "staged", "dual", "raw/staged"),
]


def measure(args, named, urls: dict[str, str], log_dir: Path
            ) -> tuple[list[Variant], list[str]]:
    from megarl.utils.launch import free_port
    from megarl.weight_sync.producer import WeightProducer
    from megarl.weight_sync.protocol import SyncConfig
    from megarl.weight_sync.transports import EngineLink

    cfg = SyncConfig(produce_bucket_mb=args.produce_mb, consume_bucket_mb=args.consume_mb,
                     timeout_s=args.timeout)
    producers, peer = {}, None
    try:
        peer = WirePeer(sum(t.numel() * t.element_size() for _, t in named), log_dir)
        for engine, url in urls.items():
            link = EngineLink(url, pause_for_update=(engine == "contract"))
            prod = producers[engine] = WeightProducer([link], cfg, group_name=f"bench-{engine}")
            prod.connect("127.0.0.1", free_port())
        bench = Bench(args, named, producers, peer)
        variants = [Variant(f"{n}/{e}", e, base) for n, e, _, base in VARIANTS]
        try:
            for rnd in range(args.repeat + 1):  # round 0 warms up connections and allocators
                for var, (_, engine, method, _) in zip(variants, VARIANTS):
                    r = getattr(bench, method)(engine)
                    logger.info("round %d %-15s transfer %6.1f ms  blocking %6.1f ms  %s",
                                rnd, var.name, r.transfer_s * 1e3, r.blocking_s * 1e3,
                                {True: "exact", False: "MISMATCH", None: ""}[r.exact])
                    if r.exact is None:
                        var.exact = None
                    elif var.exact is not None:
                        var.exact = var.exact and r.exact  # the warm-up included
                    if rnd:
                        var.runs.append(r)
        finally:
            bench.close()
        return variants, bench.mismatches
    finally:
        for prod in producers.values():
            prod.close()
        if peer is not None:
            peer.stop()


def summarize(args, variants: list[Variant], total: int, meta: dict) -> dict:
    by = {v.name: v for v in variants}
    wire_t = min(r.transfer_s for r in by["wire/peer"].runs)
    rows = {}
    for v in variants:
        runs = v.runs
        best_t = min(r.transfer_s for r in runs)
        pauses = [r.pause_s for r in runs if r.pause_s is not None]
        row = {"engine": v.engine, "transfer_ms": best_t * 1e3, "gbps": total / best_t / 1e9,
               "blocking_ms": min(r.blocking_s for r in runs) * 1e3,
               "pause_ms": min(pauses) * 1e3 if pauses else None,
               "exact": v.exact, "runs": len(runs)}
        if v.name != "wire/peer":
            row["vs_wire"] = wire_t / best_t
        if v.baseline:
            row["vs_raw"] = row["gbps"] / (total / min(r.transfer_s for r in by[v.baseline].runs)
                                           / 1e9)
        if pauses:
            # Per run, then the best: pause and transfer of the same sync.
            row["pause_over_transfer"] = min(r.pause_s / r.transfer_s for r in runs)
        rows[v.name] = row
    return {**meta, "variants": rows,
            "blocking_dual_over_stream": (rows["dual/contract"]["blocking_ms"]
                                          / rows["stream/contract"]["blocking_ms"])}


def print_table(res: dict) -> None:
    def f(x, fmt):
        return "—" if x is None else format(x, fmt)

    print(f"model {res['model_mb']:.1f} MiB ({res['tensors']} fp32 tensors, hidden "
          f"{res['hidden']}, {res['layers']} layers, vocab {res['vocab']}); buckets "
          f"produce {res['produce_mb']:g} / consume {res['consume_mb']:g} MiB "
          f"({res['buckets']} buckets); best of {res['repeat']}; {res['machine']}")
    print(f"{'variant':16s} {'GB/s':>6s} {'vs raw':>7s} {'vs wire':>7s} {'transfer':>9s} "
          f"{'trainer':>10s} {'engine':>10s} {'paused/':>9s}  bit-exact")
    print(f"{'':16s} {'':>6s} {'':>7s} {'':>7s} {'ms':>9s} {'blocked ms':>10s} "
          f"{'paused ms':>10s} {'transfer':>9s}")
    for name, r in res["variants"].items():
        print(f"{name:16s} {r['gbps']:6.2f} {f(r.get('vs_raw'), '7.2f'):>7s} "
              f"{f(r.get('vs_wire'), '7.2f'):>7s} {r['transfer_ms']:9.1f} "
              f"{r['blocking_ms']:10.1f} {f(r['pause_ms'], '10.1f'):>10s} "
              f"{f(r.get('pause_over_transfer'), '9.2f'):>9s}  "
              f"{ {True: 'PASS', False: 'FAIL', None: '—'}[r['exact']]}")
    print(f"trainer blocking, dual / stream (contract engine): "
          f"{res['blocking_dual_over_stream']:.3f} (aim <= 0.1)")
    print("bucketed / raw (aim >= 0.9): " + ", ".join(
        f"{n} {r['vs_raw']:.2f}" for n, r in res["variants"].items() if "vs_raw" in r))
    print(f"bit-exact: {'PASS' if res['exact'] else 'FAIL'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000,
                    help="asked of the tokenizer trainer; the tiny corpus caps it (~2.3k)")
    ap.add_argument("--produce-mb", type=float, default=64)
    ap.add_argument("--consume-mb", type=float, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=120, help="per bucket, seconds")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cpu",
                    help="the engines' device (cuda: the buckets still cross the gloo group "
                         "through host memory, as on one GPU; only the engines' receive and "
                         "load run there)")
    ap.add_argument("--wire-peer", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--wire-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    if args.wire_peer is not None:
        return wire_peer(args.wire_peer, args.wire_bytes)

    from megarl.utils.tiny_model import make_tiny_model
    from megarl.weight_sync.buckets import plan_buckets
    from megarl.weight_sync.protocol import MiB, TensorSpec

    tmp = Path(tempfile.mkdtemp(prefix="bench_weight_sync-"))
    engines: list[EngineProcess] = []
    try:
        logger.info("making the model in %s", tmp)
        heads = max(1, args.hidden // 128)
        model_dir = make_tiny_model(tmp / "m", "qwen2", vocab_size=args.vocab,
                                    hidden_size=args.hidden, num_layers=args.layers,
                                    num_heads=heads, num_kv_heads=max(1, heads // 2),
                                    intermediate_size=args.hidden * 3)
        engines = [EngineProcess(model_dir, tmp, contract=True, device=args.device),
                   EngineProcess(model_dir, tmp, contract=False, device=args.device)]
        # Cloned: a trainer's weights live in ordinary memory, not in a mapped file.
        named = [(n, t.clone()) for n, t in sorted(
            load_file(str(model_dir / "model.safetensors")).items())]
        total = sum(t.numel() * t.element_size() for _, t in named)
        for e in engines:
            e.wait_ready()
        logger.info("engines up: %s", ", ".join(f"{e.name} {e.url}" for e in engines))
        variants, mismatches = measure(args, named, {e.name: e.url for e in engines}, tmp)
    finally:
        for e in engines:
            e.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    meta = {"model_mb": total / MiB, "tensors": len(named), "hidden": args.hidden,
            "layers": args.layers,
            "vocab": int(dict(named)["model.embed_tokens.weight"].shape[0]),
            "produce_mb": args.produce_mb, "consume_mb": args.consume_mb,
            "buckets": len(plan_buckets([TensorSpec.of(n, t) for n, t in named],
                                        int(args.consume_mb * MiB))),
            "repeat": args.repeat,
            "machine": f"{os.cpu_count()} cores, engines on {args.device}, gloo loopback",
            "exact": not mismatches, "mismatches": mismatches}
    res = summarize(args, variants, total, meta)
    print_table(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0 if not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
