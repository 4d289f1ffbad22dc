"""The GPU session's report (tools/gpu_session.sh): OUT/report.json and OUT/report.md.

    python tools/gpu_session_report.py OUT_DIR

Reads what the session left in OUT_DIR: `steps.tsv` (each step's exit status and seconds),
`env.json`, bench_train's figures of runs A-E (`A.json` ... `E.json`), the top kernels of D
(`profile_D/top_kernels.txt`), the engine benchmark's output (`engine.txt`),
`weight_sync.json` and the quickstart's per-step figures (`quickstart_gpu.json`, summarised
as tools/gpu_report.py does). A figure that is missing is reported as not measured.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from gpu_report import _quickstart, _read_json, _write

RUNS = {"A": "vocab 2308, as before", "B": "real vocab", "C": "real vocab",
        "D": "real vocab, kernel keys", "E": "kernel keys, batch 16"}
COLUMNS = (("step s", "step_s", "{:.3f}"), ("optimizer s", "optimizer_s", "{:.3f}"),
           ("tokens/s", "tokens_per_s", "{:.0f}"), ("slots", "slots", "{}"),
           ("GFLOP/token", "flops_per_token", None), ("vocab", "vocab", "{}"),
           ("TFLOP/s real", "tflops_real", "{:.1f}"), ("MFU real %", "mfu_real", "{:.1f}"),
           ("MFU slots %", "mfu_slots", "{:.1f}"))


def _steps(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = [line.split("\t") for line in path.read_text().splitlines()[1:] if line.strip()]
    return [{"step": r[0], "rc": int(r[1]), "seconds": int(r[2])} for r in rows if len(r) == 3]


def _lines(path: Path, n: int) -> list[str]:
    """The first n lines (n > 0) or the last -n of a file."""
    if not path.is_file():
        return ["not run"]
    lines = path.read_text().strip().splitlines()
    return lines[:n] if n > 0 else lines[n:]


def build(out: Path) -> dict:
    return {"env": _read_json(out / "env.json") or {}, "steps": _steps(out / "steps.tsv"),
            "bench_train": {k: _read_json(out / f"{k}.json") for k in RUNS},
            "top_kernels_D": _lines(out / "profile_D" / "top_kernels.txt", 40),
            "engine": _lines(out / "engine.txt", -20),
            "weight_sync": _read_json(out / "weight_sync.json"),
            "quickstart": _quickstart(_read_json(out / "quickstart_gpu.json"))}


def _cell(run: dict | None, key: str, fmt: str | None) -> str:
    v = (run or {}).get(key)
    if v is None:
        return "—"
    return f"{v / 1e9:.2f}" if fmt is None else fmt.format(v)


def markdown(r: dict) -> str:
    env = r["env"]
    lines = [f"# GPU session: {env.get('gpu', '?')}, torch {env.get('torch', '?')}, CUDA "
             f"{env.get('cuda', '?')}", "", "| step | exit | s |", "|---|---|---|"]
    lines += [f"| {s['step']} | {s['rc']}{' (timed out)' if s['rc'] == 124 else ''} | "
              f"{s['seconds']} |" for s in r["steps"]]
    lines += ["", "| run | " + " | ".join(c for c, _, _ in COLUMNS) + " |",
              "|---" * (len(COLUMNS) + 1) + "|"]
    for k, what in RUNS.items():
        run = r["bench_train"][k] or {}
        # bench_train's figures by layout (padded, packed): a row each that ran
        for layout in [n for n in ("padded", "packed") if n in run] or [None]:
            lines.append(f"| {k}: {what}{f' ({layout})' if layout else ''} | " + " | ".join(
                _cell(run.get(layout), key, fmt) for _, key, fmt in COLUMNS) + " |")
    q = r["quickstart"]
    lines += ["", "quickstart on one GPU: " + (json.dumps(q) if q["measured"] else "not measured"),
              "", "weight sync into CUDA engines: "
              + (json.dumps({k: r["weight_sync"].get(k) for k in ("exact", "meta")})
                 if r["weight_sync"] else "not measured"),
              "", "engine against generate:", "", "```", *r["engine"], "```",
              "", "top kernels of D:", "", "```", *r["top_kernels_D"], "```", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python tools/gpu_session_report.py OUT_DIR (an existing directory)",
              file=sys.stderr)
        return 2
    out = Path(argv[0])
    report = build(out)
    _write(out / "report.json", json.dumps(report, indent=1))
    _write(out / "report.md", markdown(report))
    failed = [s["step"] for s in report["steps"] if s["rc"] != 0]
    print(f"report: {out / 'report.md'} ({len(report['steps'])} steps"
          + (f"; failed: {', '.join(failed)})" if failed else ", all exit 0)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
