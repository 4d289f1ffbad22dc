"""The GPU check's report: one JSON file and a short Markdown table (tools/gpu_check.sh).

    python tools/gpu_report.py OUT_DIR

Reads what the check left in OUT_DIR: `pytest.xml` (the `pytest -m gpu` run's JUnit file),
`quickstart_gpu.json` and `quickstart_moe.json` (the one-GPU quickstarts' per-step figures,
dense and mixture-of-experts with routing replay, written by their tests),
`moe_parity_gpu.json` (the MoE model on CUDA against transformers),
`bench_train.txt` (tools/bench_train.py's output) and `env.json` (the machine), and writes
`report.json` and `report.md` beside them (each to a temporary file, then renamed). A figure
that is missing is reported as not measured, never left out.
"""
from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _tests(xml: Path) -> list[dict]:
    if not xml.is_file():
        return []
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                why = (el.get("message") or el.text or "").strip().splitlines()[0][:200] \
                    if (el.get("message") or el.text) else ""
                break
        out.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                    "seconds": float(case.get("time") or 0.0), "why": why})
    return out


def _read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _quickstart(figures: dict | None) -> dict:
    if not figures:
        return {"measured": False}
    reward = figures.get("reward/mean", [])
    step_s = figures.get("timing/step", [])
    out = {"measured": True, "steps": len(reward), "reward_first": reward[:1],
           "reward_last": reward[-1:]}
    if step_s:
        tail = step_s[len(step_s) // 2:]  # the first steps warm caches and kernels up
        out["steps_per_s"] = len(tail) / sum(tail) if sum(tail) else None
    mem = {k: max(v) for k, v in figures.items() if k.startswith("memory/")}
    if mem:
        out["peak_memory"] = mem
    mismatch = figures.get("rollout/logp_mismatch_mean", [])
    if mismatch:  # step 1 is on-policy: the engine's log-probs against the trainer's
        out["logp_mismatch_step1"] = mismatch[0]
    return out


def build(out_dir: Path) -> dict:
    bench = out_dir / "bench_train.txt"
    return {"env": _read_json(out_dir / "env.json") or {},
            "tests": _tests(out_dir / "pytest.xml"),
            "quickstart": _quickstart(_read_json(out_dir / "quickstart_gpu.json")),
            "quickstart_moe": _quickstart(_read_json(out_dir / "quickstart_moe.json")),
            "moe_parity": _read_json(out_dir / "moe_parity_gpu.json"),
            "bench_train": bench.read_text().strip().splitlines() if bench.is_file() else None}


def markdown(report: dict) -> str:
    env = report["env"]
    lines = [f"# GPU check: {env.get('gpu', '?')} ({env.get('count', '?')} GPU), torch "
             f"{env.get('torch', '?')}, CUDA {env.get('cuda', '?')}", "",
             "| test | outcome | s | note |", "|---|---|---|---|"]
    for t in report["tests"] or [{"test": "(no pytest run found)", "outcome": "-",
                                  "seconds": 0.0, "why": ""}]:
        lines.append(f"| {t['test'].split('::')[-1]} | {t['outcome']} | {t['seconds']:.1f} "
                     f"| {t['why']} |")
    for key, title in (("quickstart", "quickstart on one GPU"),
                       ("quickstart_moe", "MoE quickstart with routing replay on one GPU")):
        q = report.get(key) or {"measured": False}
        lines += ["", f"| {title} | value |", "|---|---|"]
        if not q["measured"]:
            lines.append("| all | not measured |")
            continue
        lines.append(f"| steps | {q['steps']} |")
        lines.append(f"| reward first → last | {q['reward_first']} → {q['reward_last']} |")
        lines.append(f"| steps/s (second half) | {q.get('steps_per_s') or 'not measured'} |")
        if "logp_mismatch_step1" in q:
            lines.append(f"| log-prob mismatch, step 1 | {q['logp_mismatch_step1']:.3g} |")
        for k, v in (q.get("peak_memory") or {"peak memory": "not measured"}).items():
            lines.append(f"| {k} | {v} |")
    lines += ["", "MoE against transformers (largest differences): "
              + (json.dumps(report.get("moe_parity")) if report.get("moe_parity")
                 else "not measured")]
    lines += ["", "bench_train.py:", "", "```",
              *(report["bench_train"] or ["not run"]), "```", ""]
    return "\n".join(lines)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python tools/gpu_report.py OUT_DIR (an existing directory)",
              file=sys.stderr)
        return 2
    out = Path(argv[0])
    report = build(out)
    _write(out / "report.json", json.dumps(report, indent=1))
    _write(out / "report.md", markdown(report))
    failed = [t for t in report["tests"] if t["outcome"] in ("failed", "error")]
    print(f"report: {out / 'report.md'} ({len(report['tests'])} tests, {len(failed)} failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
