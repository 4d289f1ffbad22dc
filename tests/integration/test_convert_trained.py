"""A model trained with Megatron at TP=2, converted to HF, gives the trained model's logits.

The rank program trains a tiny Qwen2 a few steps at TP=2 (so its weights are no longer the HF
ones it started from), records Megatron's own logits before and after training on probe
sequences, and saves a megarl checkpoint with optimizer state. The checkpoint is then
converted with `megarl convert` — directly, through a reshard to TP=1, and through a reshard to
PP=2 — and each HF export, loaded by transformers, must reproduce the trained logits and not the
untrained ones. The dry-run figures are checked against the files actually written.

SGLang cannot run on these CPU machines, so "loadable by SGLang" is checked by what its model
loader reads: config.json with `architectures` and the dtype, weights as model.safetensors or a
safetensors index, the tokenizer files and generation_config.json copied from the source.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch_helpers import ROOT, SCRIPTS, run_tool, torchrun
from megarl.convert import plan
from megarl.convert.cli import megatron_to_hf_main, reshard_main

MEGARL = str(Path(sys.executable).parent / "megarl")


def megarl_convert(*args) -> str:
    """`megarl convert ...` as a user runs it (stderr is a pipe, not a TTY); returns stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    # Bytes, not text=True: universal newlines would turn a bar's "\r" redraws into "\n".
    proc = subprocess.run([MEGARL, "convert", *map(str, args)], env=env, capture_output=True,
                          timeout=600)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, err[-6000:]
    return err


def dry_run(main, capsys, *args) -> dict:
    capsys.readouterr()
    assert main([*map(str, args), "--dry-run", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_qwen2):
    out = tmp_path_factory.mktemp("trained")
    torchrun(SCRIPTS / "train_and_save.py", 2, out, 2, 1, tiny_qwen2, 3)
    logits = torch.load(out / "logits.pt")
    return {"dir": out, "ckpt": out / "ckpt", "logits": logits, "src": tiny_qwen2,
            "rank_bytes": json.loads((out / "rank_bytes.json").read_text())}


def hf_logits(model_dir, input_ids):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(input_ids).logits


def assert_trained_logits(model_dir, trained):
    lg = trained["logits"]
    got = hf_logits(model_dir, lg["input_ids"])
    assert (got - lg["after"]).abs().max().item() <= 1e-5
    # Training moved the weights, so matching "after" is not matching the starting model.
    assert (got - lg["before"]).abs().max().item() > 1e-2
    assert (hf_logits(trained["src"], lg["input_ids"]) - lg["before"]).abs().max() <= 1e-5


def safetensors_sizes(model_dir) -> tuple[int, int]:
    """(tensor bytes, file bytes) of an HF directory's weights."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    tensor_bytes = 0
    for f in files:
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                t = fh.get_tensor(k)
                tensor_bytes += t.numel() * t.element_size()
    return tensor_bytes, sum(f.stat().st_size for f in files)


def assert_serving_ready(model_dir, src):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert (cfg.get("torch_dtype") or cfg.get("dtype")) == "float32"
    assert (model_dir / "model.safetensors").is_file() or \
        (model_dir / "model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            assert (model_dir / name).read_bytes() == (src / name).read_bytes(), name
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(model_dir).encode("What is 1 + 2?")


def test_trained_tp2_checkpoint_exports_trained_logits(trained, tmp_path, capsys):
    ckpt, out = trained["ckpt"], tmp_path / "hf"
    # The per-rank figure a dry run predicts is what each TP=2 rank held while training.
    pre = plan.plan_hf2mcore(trained["src"], tmp_path / "unused", tp=2)
    assert trained["rank_bytes"] == [pre.stage_rank_bytes[0]] * 2
    assert pre.output_tensor_bytes == plan.mcore_tensor_bytes(ckpt)

    report = dry_run(megatron_to_hf_main, capsys, "--ckpt", ckpt, "--out", out)
    assert not out.exists() and not list(tmp_path.iterdir())
    assert report["hf_tensors"] == 26 and report["out_dtype"] == "float32"
    assert any("optimizer" in n for n in report["notes"])

    log = megarl_convert("mcore2hf", "--ckpt", ckpt, "--out", out)
    # Not a TTY and no --progress: log lines every 10%, no bar redraws.
    assert "mcore2hf export: 100% (26/26 tensors" in log and "\r" not in log
    tensor_bytes, file_bytes = safetensors_sizes(out)
    assert tensor_bytes == report["output_tensor_bytes"]
    assert 0 < file_bytes - tensor_bytes < 16 << 10  # the safetensors header
    assert report["parameters"] * 4 == tensor_bytes
    assert_serving_ready(out, trained["src"])
    assert_trained_logits(out, trained)


def test_reshard_to_tp1_drops_optimizer_and_exports_trained_logits(trained, tmp_path, capsys):
    ckpt, r1 = trained["ckpt"], tmp_path / "tp1"
    report = dry_run(reshard_main, capsys, "--ckpt", ckpt, "--out", r1, "--tp", 1)
    assert not r1.exists()
    log = megarl_convert("reshard", "--ckpt", ckpt, "--out", r1, "--tp", 1)
    assert "dropping the optimizer state" in log
    meta = json.loads((r1 / "megarl_meta.json").read_text())
    assert (meta["tp"], meta["pp"], meta["resharded_from_layout"]) == (1, 1, {"tp": 2, "pp": 1})
    assert meta["model_dir"] == str(trained["src"])
    assert not (r1 / "optim").exists()
    assert report["output_tensor_bytes"] == plan.mcore_tensor_bytes(r1)
    assert report["padded_vocab"] == 384  # 300 padded for TP=1 (512 at TP=2)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    out = tmp_path / "hf"
    log = megarl_convert("mcore2hf", "--ckpt", r1, "--out", out, "--progress")
    assert "mcore2hf export" in log and "\r" in log  # a tqdm bar, forced on a pipe
    assert_trained_logits(out, trained)


def test_reshard_to_pp2_with_the_tool_exports_trained_logits(trained, tmp_path, capsys):
    ckpt, r2 = trained["ckpt"], tmp_path / "pp2"
    report = dry_run(reshard_main, capsys, "--ckpt", ckpt, "--out", r2, "--pp", 2)
    # Tied embeddings: the last stage keeps its own copy of the output layer.
    first, last = report["stage_rank_bytes"]
    assert report["max_rank_bytes"] == max(first, last) and last > first / 2
    run_tool("convert_reshard.py", "--ckpt", ckpt, "--out", r2, "--pp", 2)
    meta = json.loads((r2 / "megarl_meta.json").read_text())
    assert (meta["tp"], meta["pp"], meta["world"]) == (1, 2, 2)
    assert report["output_tensor_bytes"] == plan.mcore_tensor_bytes(r2)
    out = tmp_path / "hf"
    megarl_convert("mcore2hf", "--ckpt", r2, "--out", out)
    assert_trained_logits(out, trained)
