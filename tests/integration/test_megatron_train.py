"""Optimizer steps on a fixed batch lower the loss, identically at TP=1, TP=2 and PP=2."""
import pytest

from launch_helpers import SCRIPTS, read_json, torchrun

STEPS = 5


@pytest.fixture(scope="module")
def curves(tmp_path_factory, tiny_qwen2):
    out = {}
    # micro-batch 2 of 5 rows: gradient accumulation over 3 micro-batches, one with a filler row
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        path = tmp_path_factory.mktemp("curve") / f"tp{tp}pp{pp}.json"
        torchrun(SCRIPTS / "train_curve.py", tp * pp, path, tp, pp, tiny_qwen2, STEPS, 2)
        out[(tp, pp)] = read_json(path)
    return out


def test_loss_decreases(curves):
    losses = [s["loss"] for s in curves[(1, 1)][:STEPS]]
    assert len(losses) == STEPS
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    # the metric shares of all micro-batches add up to the whole batch
    assert all(abs(s["tokens"] - 1.0) < 1e-6 for s in curves[(1, 1)])


def test_entropy_bonus_keeps_gradients_finite(curves):
    # the extra step with an entropy term: a finite grad norm on every layout
    for layout, c in curves.items():
        assert len(c) == STEPS + 1 and c[-1]["grad_norm"] == c[-1]["grad_norm"], layout


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_layout_gives_same_curve(curves, layout):
    ref, got = curves[(1, 1)], curves[layout]
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (ref, got)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * max(1.0, a["grad_norm"])
