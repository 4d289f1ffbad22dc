"""This process's memory as Linux reports it, for the CPU memory benchmarks (tools/bench_*):
a field of /proc/self/status and a reset of its peak."""
from __future__ import annotations

from pathlib import Path


def status_kib(field: str) -> int:
    """`field` of /proc/self/status in KiB (VmRSS, VmHWM, RssAnon, ...)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Restart the peak resident set (VmHWM) from the current one (Linux `clear_refs` 5)."""
    Path("/proc/self/clear_refs").write_text("5")
