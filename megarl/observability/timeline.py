"""Chrome-trace export of a pipeline timeline (open in chrome://tracing or ui.perfetto.dev).

One process row per group, one complete event ("X") per interval, named `<task>(<step>)`.
Optional: nothing else reads these files.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable


def chrome_trace(intervals: Iterable) -> dict:
    """{"traceEvents": [...]}; intervals have .group, .task, .step, .start, .end (seconds)."""
    intervals = sorted(intervals, key=lambda i: i.start)
    t0 = intervals[0].start if intervals else 0.0
    pids: dict[str, int] = {}
    events = []
    for iv in intervals:
        pid = pids.setdefault(iv.group, len(pids))
        events.append({"name": f"{iv.task}({iv.step})", "cat": iv.task, "ph": "X",
                       "pid": pid, "tid": 0, "ts": (iv.start - t0) * 1e6,
                       "dur": (iv.end - iv.start) * 1e6, "args": {"step": iv.step}})
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": group}}
            for group, pid in pids.items()]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


def write_chrome_trace(intervals: Iterable, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(intervals)))
    return path
