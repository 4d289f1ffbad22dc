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
