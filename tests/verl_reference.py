"""Run verl 0.9.1's own code on inputs a test made, in a child process, and return its outputs.

verl's release wheel (with the few small packages its import needs) is installed by
``tools/setup_verl_ref.sh`` into ``.venv/verl-ref``, beside megarl's environment, not in it.
It is imported only in a child process: importing ``verl`` configures the root logger and sets
environment variables, which must not leak into the test worker.

    outputs = verl_run('''
        from verl.trainer.ppo import core_algos as C
        for name, kw in inputs["cases"].items():
            outputs[name] = C.compute_grpo_outcome_advantage(**kw)
    ''', {"cases": cases})

The code runs with ``inputs`` (the dict given, through ``torch.save``/``torch.load``) and an
empty ``outputs`` dict, which comes back the same way; anything ``torch.save`` takes goes in
either direction. Batch the cases of a module into one call: each call starts Python and
imports verl (about 5 s).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VERL_REF = ROOT / ".venv" / "verl-ref"

_CHILD = """
import sys, torch
sys.path.append(sys.argv[1])
inputs = torch.load(sys.argv[2], weights_only=False)
outputs = {}
exec(compile(open(sys.argv[3]).read(), "verl_reference_code", "exec"),
     {"inputs": inputs, "outputs": outputs, "torch": torch})
torch.save(outputs, sys.argv[4])
"""


def verl_run(code: str, inputs: dict, timeout: float = 300) -> dict:
    """Run `code` against verl 0.9.1 in a child process; return its `outputs` dict."""
    if not (VERL_REF / "verl" / "trainer" / "ppo" / "core_algos.py").is_file():
        pytest.fail(f"verl 0.9.1's reference code is not installed at {VERL_REF}: run "
                    f"`bash tools/setup_verl_ref.sh` (tools/setup_env.sh runs it)")
    with tempfile.TemporaryDirectory(prefix="verl-ref-") as d:
        d = Path(d)
        torch.save(inputs, d / "in.pt")
        (d / "verl_code.py").write_text(textwrap.dedent(code))
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(VERL_REF), str(d / "in.pt"), str(d / "verl_code.py"),
             str(d / "out.pt")],
            capture_output=True, text=True, timeout=timeout, cwd=d)
        if proc.returncode != 0:
            raise AssertionError(f"verl 0.9.1 reference run failed (exit {proc.returncode}):\n"
                                 f"{proc.stderr[-4000:]}")
        return torch.load(d / "out.pt", weights_only=False)
