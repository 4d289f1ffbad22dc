"""tools/gpu_check.sh and its report, on a machine without CUDA (CI): the script refuses
before installing anything, and the report states what was skipped and what is unmeasured."""
import json
import os
import subprocess
import sys

import pytest
import torch

from launch_helpers import ROOT


def test_gpu_check_refuses_without_cuda_before_any_work(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run for real")
    env = dict(os.environ, PYTHON=sys.executable)
    p = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--out",
                        str(tmp_path / "out")], env=env, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no CUDA device here" in p.stderr
    assert not (tmp_path / "out").exists()  # nothing written, nothing installed
    p = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--wheels",
                        str(tmp_path / "nowhere")], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "--wheels" in p.stderr and "not a directory" in p.stderr


def test_the_report_of_a_run_where_every_gpu_test_skipped(tmp_path):
    """The report from a real `pytest -m gpu` JUnit file: on CPU every test skips, each with
    its reason; figures no test produced are 'not measured'."""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q",
                    f"--junitxml={out / 'pytest.xml'}", str(ROOT / "tests")], env=env,
                   capture_output=True, text=True, timeout=300, cwd=ROOT)
    (out / "env.json").write_text(json.dumps({"gpu": "none", "count": 0}))
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_report.py"), str(out)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    report = json.loads((out / "report.json").read_text())
    names = {t["test"].split("::")[-1] for t in report["tests"]}
    assert {"test_bf16_train_steps_track_fp32_cpu_steps",
            "test_cuda_engine_greedy_equals_transformers_generate",
            "test_quickstart_on_one_gpu_under_torchrun"} <= names
    assert all(t["outcome"] == "skipped" and "needs CUDA" in t["why"] for t in report["tests"])
    assert report["quickstart"] == {"measured": False}
    md = (out / "report.md").read_text()
    assert "| all | not measured |" in md and "| test_quickstart_on_one_gpu_under_torchrun | " \
        "skipped |" in md
    assert not list(out.glob("*.tmp"))


def _bench_train(tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_train.py"), *args,
                        "--steps", "1", "--warmup", "0", "--threads", "1", "--peak-tflops", "1",
                        "--json", str(out)], env=env, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "GFLOP each at vocabulary 1000" in p.stdout, p.stdout
    return json.loads(out.read_text())


def test_bench_train_counts_real_tokens_and_executed_slots(tmp_path):
    """A shape from a config.json alone (random init), padded and packed side by side: the
    padded step executes whole rows and a filler row, the packed one only real tokens; each
    count has its own FLOPs per token (attention at the row width, or at each sequence's own
    length), equal to 6 × the model's matmul parameters (transformers' Linear layers) plus
    attention."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = _bench_train(tmp_path, "--config-json", str(tmp_path / "config.json"), "--batch", "3",
                       "--seq", "32", "--micro-batch", "2", "--token-budget", "64")
    padded, packed = res["padded"], res["packed"]

    g = torch.Generator().manual_seed(0)  # the lengths bench_train draws (--seed 0): ids first
    torch.randint(0, 999, (3, 32), generator=g)
    lens = torch.randint(16, 33, (3,), generator=g).tolist()
    model = AutoModelForCausalLM.from_config(Qwen2Config(**cfg))
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))

    def fpt(s):  # 6 per matmul parameter + 12·L·s·heads·head_dim
        return 6 * matmul + 12 * 2 * s * 4 * 16

    tokens = sum(lens)
    assert padded["tokens"] == packed["tokens"] == tokens
    assert padded["slots"] == 2 * 2 * 32  # two micro-batches of two rows of 32, one a filler
    assert packed["slots"] == tokens      # one packed row, no padding at TP=1
    assert padded["flops_per_slot"] == pytest.approx(fpt(32))
    for r in (padded, packed):
        assert r["vocab"] == 1000
        # each token's attention at its own sequence's length
        assert r["flops_per_token"] == pytest.approx(fpt(sum(n * n for n in lens) / tokens))
        # MFU on slots over MFU on real tokens: the ratio of the FLOPs each counts
        assert r["mfu_slots"] / r["mfu_real"] == pytest.approx(
            r["slots"] * r["flops_per_slot"] / (tokens * r["flops_per_token"]))
        assert 0 < r["optimizer_s"] < r["step_s"]
    assert packed["flops_per_slot"] == packed["flops_per_token"] == padded["flops_per_token"]
    assert packed["micro_batches"] == 2 and padded["micro_batches"] == 2
    assert res["vocab"] == 1000 and "baseline" not in res  # no weights for transformers

    # the GPU session's report reads these figures: a row per layout, a failed step named
    out = tmp_path / "session"
    out.mkdir()
    (out / "C.json").write_text(json.dumps(res))
    (out / "steps.tsv").write_text("step\trc\tseconds\nC\t0\t9\nD\t124\t75\n")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_session_report.py"), str(out)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "failed: D" in p.stdout, p.stdout + p.stderr
    md = (out / "report.md").read_text()
    assert "| D | 124 (timed out) | 75 |" in md
    assert f"| C: real vocab (packed) | {packed['step_s']:.3f} |" in md
    assert "| C: real vocab (padded) |" in md and "| E: kernel keys, batch 16 | — |" in md


def test_gpu_session_refuses_without_cuda_and_lists_its_steps(tmp_path):
    """--dry lists every step within a 9-minute slot on any machine; a real run refuses
    without CUDA (exit 2) before writing anything."""
    script = str(ROOT / "tools" / "gpu_session.sh")
    env = dict(os.environ, PYTHON=sys.executable, KERNEL_OVERRIDES="a.b=1 c=true")
    p = subprocess.run(["bash", script, "--dry"], env=env, capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 0, p.stderr
    names = [line.split()[0] for line in p.stdout.splitlines() if line[:1].strip()]
    assert names[:-2] == ["install", "env", "A", "B", "C", "D", "E", "engine", "weight_sync",
                          "quickstart"]
    total = int(p.stdout.split("total timeouts: ")[1].split()[0])
    limits = [int(line.split()[1]) for line in p.stdout.splitlines()
              if line[:1].strip() and line.split()[0] in names[:-2]]
    assert sum(limits) == total <= 540
    assert "KERNEL_OVERRIDES: a.b=1 c=true" in p.stdout
    if torch.cuda.is_available():
        return
    p = subprocess.run(["bash", script, "--out", str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no CUDA device here" in p.stderr, p.stdout + p.stderr
    assert not (tmp_path / "out").exists()
    p = subprocess.run(["bash", script, "--wheels", str(tmp_path / "nowhere")], env=env,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "--wheels" in p.stderr and "not a directory" in p.stderr
