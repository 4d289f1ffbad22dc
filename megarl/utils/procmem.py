"""This process's memory as Linux reports it, for the CPU memory benchmarks (tools/bench_*):
a field of /proc/self/status, a reset of its peak, and the peak of one call."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable


def status_kib(field: str) -> int:
    """`field` of /proc/self/status in KiB (VmRSS, VmHWM, RssAnon, ...)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Restart the peak resident set (VmHWM) from the current one (Linux `clear_refs` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_of(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(peak resident MiB above the resident set at the call's start, seconds, fn's result)."""
    reset_peak()
    base = status_kib("VmRSS")
    t = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t
    return (status_kib("VmHWM") - base) / 1024, seconds, result
