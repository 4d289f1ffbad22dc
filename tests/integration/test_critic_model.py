"""The Megatron critic: a zero-started scalar head on the actor's transformer, values in
verl's token alignment (checked inside the rank program), the clipped value loss falling, the
same at TP=2 (replicated head) as at PP=2 (head on the last stage only, values broadcast), and a
checkpoint that reloads bit-exact. TP=1 x PP=1 is the path of every end-to-end critic test."""
import pytest

import torch

from launch_helpers import SCRIPTS, read_json, run_tool, torchrun


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_qwen2):
    out = {}
    for tp, pp, cp in [(2, 1, 1), (1, 2, 1), (1, 1, 2)]:
        d = tmp_path_factory.mktemp("critic")
        torchrun(SCRIPTS / "critic_curve.py", tp * pp * cp, d / "out.json", tp, pp,
                 tiny_qwen2, d / "ckpt", cp)
        out[(tp, pp) if cp == 1 else ("cp", cp)] = {**read_json(d / "out.json"),
                                                    "ckpt": d / "ckpt", "dir": d}
    return out


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_value_loss_falls(runs, layout):
    losses = [s["critic/vf_loss"] for s in runs[layout]["curve"]]
    # from all-zero values: 0.5 * mean((0 - R)^2) over the response tokens, R = 1 or -0.5
    # response tokens t = 3 .. length - 1, lengths [12, 9, 7, 12, 4]: rows 0, 2, 4 (R = 1)
    # have 9 + 4 + 1, rows 1, 3 (R = -0.5) have 6 + 9
    n_pos, n_neg = 14, 15
    want = 0.5 * (n_pos * 1.0 + n_neg * 0.25) / (n_pos + n_neg)
    assert abs(losses[0] - want) < 1e-5, losses
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(s["critic/vf_clipfrac"] == 0.0 for s in runs[layout]["curve"])  # clip 10


def test_parallel_layouts_give_same_values(runs):
    """TP=2, PP=2 and CP=2 (each sequence over two ranks, values gathered over them)."""
    ref = runs[(2, 1)]
    for got in (runs[(1, 2)], runs[("cp", 2)]):
        for a, b in zip(ref["curve"], got["curve"]):
            assert abs(a["critic/vf_loss"] - b["critic/vf_loss"]) <= 1e-4, (ref, got)
        for ra, rb in zip(ref["values"], got["values"]):
            assert max(abs(x - y) for x, y in zip(ra, rb)) <= 1e-3
    from megarl.backends.megatron.checkpoint import read_meta

    assert read_meta(runs[("cp", 2)]["ckpt"])["cp"] == 2


def test_critic_checkpoint_converts_to_hf_token_classification(runs):
    """The TP=2 critic's checkpoint -> HF at TP=1 -> transformers' ForTokenClassification
    (verl's critic format) predicts the values the Megatron critic did, shifted to the token
    each one is the value before."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    run = runs[(2, 1)]
    out = run["dir"] / "hf"
    run_tool("convert_megatron_to_hf.py", "--ckpt", run["ckpt"], "--out", out)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.architectures == ["Qwen2ForTokenClassification"] and cfg.num_labels == 1
    model = AutoModelForTokenClassification.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(torch.tensor(run["input_ids"])).logits[..., 0]
    want = torch.tensor(run["values"])
    assert bool(want.abs().max() > 0.1)  # a trained head, not the zero it started as
    torch.testing.assert_close(logits[:, :-1], want[:, 1:], atol=1e-4, rtol=1e-4)
    # and back: the HF critic -> Megatron (a critic again) -> HF, unchanged
    from megarl.convert.checkpoints import compare_hf_dirs

    run_tool("convert_hf_to_megatron.py", "--hf-dir", out, "--out", run["dir"] / "back")
    run_tool("convert_megatron_to_hf.py", "--ckpt", run["dir"] / "back", "--out",
             run["dir"] / "hf2")
    diffs = compare_hf_dirs(out, run["dir"] / "hf2")
    assert "score.weight" in diffs and max(diffs.values()) == 0.0, diffs
