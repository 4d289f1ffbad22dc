"""The tiny model a multi-turn run makes for itself: the tool markers, and Megatron's scaled
init of the residual projections, from which the random model copies its input token more
often (the CPU task is learned from those copies)."""
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.utils.tiny_model import TOOL_TOKENS, make_tiny_model


def _copy_rate(path) -> float:
    """Mean probability that the random model's next token repeats "Look up K"'s K."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    probs = []
    with torch.no_grad():
        for k in "0123456789":
            ids = torch.tensor([tok(f"Look up {k}", add_special_tokens=False)["input_ids"]])
            probs.append(model(ids).logits[0, -1].softmax(-1)[ids[0, -1]].item())
    return sum(probs) / len(probs)


def test_scaled_residual_init_scales_only_the_residual_projections(tmp_path):
    plain = make_tiny_model(tmp_path / "plain", tool_tokens=True)
    scaled = make_tiny_model(tmp_path / "scaled", tool_tokens=True, scaled_residual_init=True)
    a, b = load_file(plain / "model.safetensors"), load_file(scaled / "model.safetensors")
    assert a.keys() == b.keys()
    layers = 2  # make_tiny_model's default
    for name in a:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.testing.assert_close(b[name], a[name] * (2 * layers) ** -0.5)
        else:
            assert torch.equal(a[name], b[name]), name
    tok = AutoTokenizer.from_pretrained(scaled)
    assert all(len(tok.encode(t, add_special_tokens=False)) == 1 for t in TOOL_TOKENS)
    # the reason for it: the random model repeats its input token more than twice as often
    assert _copy_rate(scaled) > 2 * _copy_rate(plain)
