"""A Megatron trainer with two pipeline stages feeding two stock SGLang servers over gloo
(finding 5): each stage's sender hosts its own update group, and the stages join one after
another, since stock serves init_weights_update_group calls one at a time, each blocking its
scheduler until that group is complete (two engines taking the joins in opposite orders would
wait on each other). Every version's buckets, small and large, streamed and dual-buffered,
land bit for bit (verify mode on, against stock's own checksums of its fused parameters).

The second server is launched as a run launches its servers, with the run's token
(megarl.rollout.auth): stock SGLang's own `--api-key`, given in a `--config` file, so that
its command line does not hold it. Stock refuses a caller without it; the trainer, with it,
syncs as with the first (which has none).

Runs after test_stock_protocol.py (file order) and leaves the session's server holding the
trainer's perturbed weights."""
import asyncio
import glob

import aiohttp
import pytest

from launch_helpers import SCRIPTS, read_json, torchrun
from stock_helpers import launched

from megarl.rollout.auth import API_KEY_ENV

KEY = "stock-token-" + "x" * 32


@pytest.fixture(scope="module")
def second_server(stock_python, qwen_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(API_KEY_ENV, KEY)  # as in a run's worker: launch_server passes it on
        server = launched(qwen_dir, stock_python, tmp_path_factory, "stock2")
    with server:
        yield server


def _unauthorized(url):
    """What stock answers a caller without the token: the statuses of a weight update, a
    pause, a group join and a weights read, and of /health (open, for probes)."""
    async def go():
        async with aiohttp.ClientSession() as s:
            out = []
            for path, body in [("/update_weight_version", {"new_version": "evil"}),
                               ("/pause_generation", {}),
                               ("/init_weights_update_group",
                                {"master_address": "203.0.113.9", "master_port": 9,
                                 "rank_offset": 1, "world_size": 2, "group_name": "g"}),
                               ("/get_weights_by_name", {"name": "model.norm.weight"})]:
                async with s.post(url + path, json=body) as r:
                    out.append(r.status)
            async with s.get(url + "/health") as r:
                out.append(r.status)
            async with s.get(url + "/model_info",
                             headers={"Authorization": f"Bearer {KEY}"}) as r:
                out.append((await r.json())["weight_version"])
            return out
    return asyncio.run(go())


def test_pp2_trainer_joins_and_syncs_two_stock_engines(tmp_path, qwen_dir, stock_server,
                                                       second_server):
    cmdline = open(f"/proc/{second_server.proc.pid}/cmdline", "rb").read().decode()
    assert KEY not in cmdline and "--config" in cmdline
    assert not glob.glob(str(second_server.log_path) + ".*.config.yaml")  # removed once up
    assert _unauthorized(second_server.url) == [401, 401, 401, 401, 200, "0"]
    out = tmp_path / "ws.json"
    torchrun(SCRIPTS / "ws_sync.py", 2, out, 1, 2, qwen_dir, "pp2",
             f"{stock_server.url},1,1", f"{second_server.url},1,1", "--refit", timeout=600,
             env={API_KEY_ENV: KEY})
    res = read_json(out)
    # the second server as a replacement (told it is at v0): the newest version out of
    # band, over a group of its own, stage by stage: from the snapshot (v4), none once the
    # trainer has trained without the dual buffer, from live weights (v5)
    refits = {k: res.pop(k) for k in ("refit-snapshot", "refit-trained", "refit-live")}
    assert refits["refit-snapshot"]["state"] == [True, "4"], refits
    assert refits["refit-trained"] is None
    assert refits["refit-live"]["state"] == [True, "5"], refits
    assert list(res) == ["smaller", "equal", "larger", "dual"]
    for i, (case, r) in enumerate(res.items()):
        assert r["equal"] == [True, True], (case, r)
        assert min(r["compared"]) >= 10, (case, r)  # fused qkv/gate_up, norms, o/down proj
        assert r["versions"][0] == r["versions"][1], (case, r)
