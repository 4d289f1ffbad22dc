"""A Megatron trainer with two pipeline stages feeding two stock SGLang servers over gloo
(finding 5): each stage's sender hosts its own update group, and the stages join one after
another, since stock serves init_weights_update_group calls one at a time, each blocking its
scheduler until that group is complete (two engines taking the joins in opposite orders would
wait on each other). Every version's buckets, small and large, streamed and dual-buffered,
land bit for bit (verify mode on, against stock's own checksums of its fused parameters).

Runs after test_stock_protocol.py (file order) and leaves the session's server holding the
trainer's perturbed weights."""
import pytest

from launch_helpers import SCRIPTS, read_json, torchrun
from stock_helpers import launched


@pytest.fixture(scope="module")
def second_server(stock_python, qwen_dir, tmp_path_factory):
    with launched(qwen_dir, stock_python, tmp_path_factory, "stock2") as server:
        yield server


def test_pp2_trainer_joins_and_syncs_two_stock_engines(tmp_path, qwen_dir, stock_server,
                                                       second_server):
    out = tmp_path / "ws.json"
    torchrun(SCRIPTS / "ws_sync.py", 2, out, 1, 2, qwen_dir, "pp2",
             f"{stock_server.url},1,1", f"{second_server.url},1,1", "--refit", timeout=600)
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
