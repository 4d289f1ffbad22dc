"""Qwen3 on the stock server (qwen3.py of the pinned release, on this CPU in fp32): a tiny
Qwen3 with per-head q/k RMSNorm and a head_dim apart from hidden / heads generates what
transformers generates, and a Megatron trainer at TP=2 syncs its weights into it bit for bit,
q_norm and k_norm included (verify mode, against stock's own checksums of its parameters)."""
import pytest
import torch
import transformers

from launch_helpers import SCRIPTS, read_json, torchrun
from stock_helpers import PROMPT, generate, hf_greedy, launched, run


@pytest.fixture(scope="module")
def qwen3_server(stock_python, tiny_qwen3, tmp_path_factory):
    with launched(tiny_qwen3, stock_python, tmp_path_factory, "stock-qwen3") as server:
        yield server


def test_stock_qwen3_generates_what_transformers_does(qwen3_server, tiny_qwen3):
    out = run(generate(qwen3_server.url))
    assert out.output_ids == hf_greedy(tiny_qwen3, PROMPT)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_qwen3),
                                                              dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out.output_ids])).logits[0, len(PROMPT) - 1:-1]
    want = logits.log_softmax(-1).gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.output_logprobs), want, atol=1e-4, rtol=0)


def test_a_tp2_megatron_qwen3_syncs_into_stock_bit_exact(tmp_path, tiny_qwen3, qwen3_server):
    out = tmp_path / "ws.json"
    torchrun(SCRIPTS / "ws_sync.py", 2, out, 2, 1, tiny_qwen3, "qwen3",
             f"{qwen3_server.url},1,1", timeout=600)
    res = read_json(out)
    assert list(res) == ["smaller", "equal", "larger", "dual"]
    for case, r in res.items():
        assert r["equal"] == [True], (case, r)
        # per layer qkv_proj, o_proj, q_norm, k_norm, two norms, gate_up_proj, down_proj, and
        # the final norm (the embedding's rows are padded by stock: not comparable)
        assert r["compared"][0] >= 2 * 8 + 1, (case, r)
        names = r["names"][0]
        assert {f"model.layers.{i}.self_attn.{x}_norm.weight"
                for i in (0, 1) for x in "qk"} <= set(names), (case, names)
