"""Rank program: sync a TP/PP Megatron trainer's weights to engine servers; check bit-exactness.

argv: out.json tp pp model_dir group_name url,tp,live [...] [--refit]. Rank 0 writes
{case: {"equal": [bool per engine], "versions": [...], "buckets": n, ...}}; equality is
checked with the engines' stock `/weights_checker` checksums (megarl.weight_sync.verify: HF
names, or stock SGLang's fused ones).
Cases: bucket smaller than one tensor, equal to the largest tensor, larger than the model
(no dual buffer), then dual buffer with the trainer changing its weights right after the
snapshot (the engines must get the snapshot, not the later weights); with --refit, then
the refits of `refit_cases` to the second engine. WS_VPP (default 1): model chunks per
pipeline stage (a virtual pipeline: each stage sends its chunks' layers, non-adjacent runs).
"""
import json
import logging
import os
import sys

import torch
import torch.distributed as dist

from megarl.backends.megatron.parallel import rank_program


def perturb(worker, seed):
    g = torch.Generator().manual_seed(seed + 100 * dist.get_rank())
    with torch.no_grad():
        for p in worker.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)


def _engine_state(sync, slot, want):
    """(engine `slot` holds exactly `want`'s tensors, its version), from rank 0."""
    from megarl.weight_sync.verify import check_engine

    link = sync.producer.link_of(slot)
    got = sync.producer._io.submit(link.checksums()).result()
    info = sync.producer._io.submit(link.client.model_info()).result()
    compared, _, bad = check_engine(got, want, None, info.get("engine") == "megarl-embedded")
    return compared > 0 and not bad, info["weight_version"]


def refit_cases(sync, worker, cfg, engines, results, snap):
    """The stock-like engine (slot 1) as a replacement that reports v0 (a fresh server):
    refit from the dual buffer's snapshot (v4; the trainer has moved on since), none without
    the dual buffer once the trainer has changed its weights, then refit of live weights
    published as v5."""
    from megarl.weight_sync.protocol import SyncConfig  # noqa: F401 - cfg is one
    from megarl.weight_sync.transports import EngineLink
    from megarl.weight_sync.verify import SentDigest

    def as_fresh():
        if dist.get_rank() == 0:
            link = sync.producer.link_of(1)
            sync.producer._io.submit(link.client.update_weight_version("0")).result()
        dist.barrier()
        url, tp, live = engines[1]
        sync.replace_engine(1, EngineLink(url, int(tp), pause_for_update=live == "1"))

    def export():
        want = SentDigest()
        for n, t in worker.full_hf_state().items():
            want.add(n, t)
        return want

    as_fresh()
    stats = sync.refit(1, False)  # dual buffer: the snapshot, whatever the live weights are
    if dist.get_rank() == 0:
        results["refit-snapshot"] = {"state": _engine_state(sync, 1, snap),
                                     "version": stats.version, "bytes": stats.bytes}
    cfg.dual_buffer = False
    results["refit-trained"] = sync.refit(1, False)  # None: the next sync brings it
    perturb(worker, 7)
    want = export()
    sync.sync(5)
    as_fresh()
    stats = sync.refit(1, True)
    if dist.get_rank() == 0:
        results["refit-live"] = {"state": _engine_state(sync, 1, want),
                                 "version": stats.version, "bytes": stats.bytes}
    dist.barrier()


def main():
    logging.basicConfig(level=logging.WARNING)
    out, tp, pp, model_dir, group = sys.argv[1:6]
    # url,tp,pause entries: engine URL, its TP size, whether it loads live (stock-like)
    engines = [e.split(",") for e in sys.argv[6:] if e != "--refit"]
    from megarl.backends.megatron.worker import MegatronWorker
    from megarl.weight_sync.verify import SentDigest, check_engine
    from megarl.weight_sync.protocol import MiB, SyncConfig
    from megarl.weight_sync.trainer import TrainerWeightSync
    from megarl.weight_sync.transports import EngineLink

    worker = MegatronWorker(model_dir, int(tp), int(pp), trainable=False,
                            vpp=int(os.environ.get("WS_VPP", 1)))
    # Every rank computes the same sizes from the full export.
    full = worker.full_hf_state()
    nbytes = {n: t.numel() * t.element_size() for n, t in full.items()}
    biggest, total = max(nbytes.values()), sum(nbytes.values())
    cfg = SyncConfig(timeout_s=60, verify=True)
    links = [EngineLink(u, int(t), pause_for_update=live == "1") for u, t, live in engines]
    sync = TrainerWeightSync(worker, links, cfg, address="127.0.0.1", group_name=group)
    sync.connect()
    results = {}
    cases = [("smaller", biggest // 3, False), ("equal", biggest, False),
             ("larger", 2 * total, False), ("dual", biggest // 2, True)]
    for i, (case, bucket, dual) in enumerate(cases):
        perturb(worker, i)
        cfg.produce_bucket_mb = 2 * bucket / MiB
        cfg.consume_bucket_mb = bucket / MiB
        cfg.dual_buffer = dual
        want = SentDigest()
        for n, t in worker.full_hf_state().items():
            want.add(n, t)
        stats = sync.sync(i + 1)
        if dual:
            results["_snapshot_digest"] = want
            perturb(worker, 99)  # the trainer moves on while the transfer runs
            stats = sync.wait() or stats
        if dist.get_rank() == 0:
            got = sync.producer.engine_checksums()
            infos = [sync.producer._io.submit(l.client.model_info()).result()
                     for l in sync.producer.links]
            # every tensor as sent, or as stock SGLang fuses (and pads) it: verify.py
            checks = [check_engine(g, want, None, x.get("engine") == "megarl-embedded")
                      for g, x in zip(got, infos)]
            results[case] = {"equal": [c[0] > 0 and not c[2] for c in checks],
                             "compared": [c[0] for c in checks],
                             "versions": [x["weight_version"] for x in infos],
                             # the names each engine reports that the trainer sent
                             "names": [sorted(set(g) & set(want.checksums)) for g in got],
                             "buckets": stats.buckets, "bucket_bytes": bucket,
                             "biggest": biggest, "total": total, "stale": stats.stale}
        dist.barrier()
    snap = results.pop("_snapshot_digest")
    if "--refit" in sys.argv:
        refit_cases(sync, worker, cfg, engines, results, snap)
    sync.close()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    with rank_program():
        main()
