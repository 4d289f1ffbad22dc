"""Megatron trainer (TP=2; PP=2 × VPP=2, two model chunks per stage, on a 4-layer model) → two
engine servers over gloo, through stock SGLang's
weight contract: bit-exact weights for buckets smaller than a tensor, equal to the largest,
larger than the model, and with dual buffer while the trainer moves on; then refits (the
newest version to one engine alone, out of band) from the snapshot and from live weights. One engine stages and
swaps (the embedded default), the other loads live as stock SGLang does and holds two TP ranks
in the update group (rank offsets count TP ranks)."""
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from launch_helpers import ROOT, SCRIPTS, read_json, torchrun


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deep_qwen2(tmp_path_factory):
    """4 layers, so that PP=2 × VPP=2 gives every chunk one (stage 0 sends layers 0 and 2)."""
    from megarl.utils.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("deep") / "qwen2", "qwen2", num_layers=4,
                           num_heads=4, num_kv_heads=2, rope_theta=5000.0)


@pytest.fixture(scope="module")
def engines(deep_qwen2):
    procs, urls = [], []
    for extra in ([], ["--sglang-contract", "--tp-size", "2"]):
        port = _port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "megarl.rollout.server", "--model-path", str(deep_qwen2),
             "--port", str(port), "--load-format", "dummy", "--log-level", "warning",
             "--weight-version", "0", *extra],
            cwd=ROOT, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                           "PATH": "/usr/bin:/bin"}))
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.time() + 120
    for url, p in zip(urls, procs):
        while True:
            assert p.poll() is None, "engine server exited"
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "engine server did not come up"
                time.sleep(0.3)
    yield [f"{urls[0]},1,0", f"{urls[1]},2,1"]
    for p in procs:
        p.terminate()
        p.wait(30)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2-vpp2"])
def test_engines_equal_trainer_export_bit_for_bit(tmp_path, deep_qwen2, engines, tp, pp):
    # PP without chunks is synced to stock SGLang in tests/stock/test_stock_weight_sync_pp.py
    out = tmp_path / "ws.json"
    torchrun(SCRIPTS / "ws_sync.py", tp * pp, out, tp, pp, deep_qwen2, f"g-{tp}-{pp}",
             *engines, "--refit", env={"WS_VPP": "2"} if pp > 1 else None)
    res = read_json(out)
    refits = {k: res.pop(k) for k in ("refit-snapshot", "refit-trained", "refit-live")}
    assert list(res) == ["smaller", "equal", "larger", "dual"]
    for i, (case, r) in enumerate(res.items()):
        assert r["equal"] == [True, True], (case, r)
        assert r["versions"] == [str(i + 1)] * 2, (case, r)
        assert r["stale"] == []
    per_stage_total = res["larger"]["total"] / pp
    assert res["larger"]["buckets"] == 1  # the whole stage in one bucket
    assert res["smaller"]["buckets"] > per_stage_total / res["smaller"]["biggest"]  # splits
    assert res["equal"]["bucket_bytes"] == res["equal"]["biggest"]
    # A replacement (here the stock-like engine told it is at v0, as a fresh server is) gets
    # the newest version out of band, alone, over a group of its own: from the dual buffer's
    # snapshot (v4, though the trainer changed its weights since), then, without the dual
    # buffer, from live weights that are still the published v5; none while they are not.
    assert refits["refit-snapshot"]["state"] == [True, "4"], refits
    assert refits["refit-trained"] is None
    assert refits["refit-live"]["state"] == [True, "5"], refits
    assert refits["refit-snapshot"]["version"] == 4 and refits["refit-live"]["version"] == 5
