"""Helpers of the data tests: rows in the verl convention and writers of data files."""
from __future__ import annotations

import json
from pathlib import Path


def row(prompt="What is 1 + 2?", gt="3", **kw) -> dict:
    if isinstance(prompt, str) and not kw.pop("text", False):
        prompt = [{"role": "user", "content": prompt}]
    r = {"data_source": "megarl/quickstart", "prompt": prompt,
         "reward_model": {"style": "rule", "ground_truth": gt}, "extra_info": {"k": 1}}
    r.update(kw)
    return r


def write_jsonl(path: Path, rows) -> Path:
    # A row given as a str is written verbatim (for malformed lines).
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def write_parquet(path: Path, rows) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
