"""Packed token-budget micro-batches give the padded path's numbers (issue: sequence packing).

One ragged batch (rows of 1 token to the full width), a policy and a critic, padded and
packed side by side in one torchrun job per layout (tests/integration/scripts/packing_check.py):
log-probs, entropies, values, losses and grad norms over ten optimizer steps agree to 1e-5
(fp32), at DP=2 (ranks with 9 and 2 rows: the second runs a micro-batch of filler to keep the
micro-batch counts equal), TP=2 (the packed side with sequence parallelism) and PP=2. At DP=2
the padded policy runs SDPA's math kernel (`attention_backend: unfused`, the plain path) and
the packed one FlexAttention's document mask (`flex`); elsewhere both sides run `auto` (on
the CPU: SDPA's own kernel choice, packed sequences one call per length)."""
import pytest

from launch_helpers import SCRIPTS, read_json, torchrun


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["dp2", "tp2", "pp2"])
def test_packed_equals_padded(tmp_path, tiny_qwen2, tp, pp):
    out = tmp_path / "diffs.json"
    torchrun(SCRIPTS / "packing_check.py", 2, out, tp, pp, tiny_qwen2,
             env={"PACKING_ATTENTION": "unfused:flex"} if tp * pp == 1 else None)
    got = read_json(out)
    assert got["dp"] == 2 // (tp * pp)
    counts = got["micro_batches"]
    assert counts[0] >= 3 and len(set(counts)) == 1, got  # as many on every rank
    if got["dp"] == 2:
        assert got["fillers"] == [0, counts[0] - 2], got  # rank 1: a row each, then filler
    expected = {"logprobs", "entropy", "loss", "ent", "grad_norm", "values", "critic_loss",
                "critic_vsum", "critic_grad_norm"}
    assert set(got["diffs"]) == expected
    worst = {k: v for k, v in got["diffs"].items() if not v <= 1e-5}
    assert not worst, got["diffs"]
