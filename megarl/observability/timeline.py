"""A pipeline timeline as files: a Chrome trace (open in chrome://tracing or ui.perfetto.dev)
and a PNG picture (also shown in TensorBoard).

Trace: one process row per group, one complete event ("X") per interval, named
`<task>(<step>)`, an instant event ("i") per incident (a restart, an engine replaced); a run
that restarts or resumes keeps the trace written before it, on the wall clock, its redone
work marked `lost`. Picture: `render_png`. `megarl plan` reads the trace's own work.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping


def chrome_trace(intervals: Iterable, devices: Mapping[str, int] | None = None, *,
                 incidents: Iterable = (), t0: float | None = None,
                 started_unix: float | None = None, earlier: dict | None = None,
                 first_step: int = 0) -> dict:
    """{"traceEvents": [...]}; intervals have .group, .task, .step, .start, .end (seconds).
    `devices`: group -> its device count, recorded with the group's name (`megarl plan`
    scales measured times by it). `incidents` (.step, .task, .what, .at: seconds after
    `t0`) are instant events. `earlier`: the trace a run before a restart (or a resume)
    wrote, kept ahead of this one on the wall clock (`started_unix`, the time of `t0`); its
    work on steps from `first_step` on, done again after the restart, is marked lost."""
    intervals = sorted(intervals, key=lambda i: i.start)
    if t0 is None:
        t0 = intervals[0].start if intervals else 0.0
    pids: dict[str, int] = {}
    events = []
    if earlier and started_unix is not None and "started_unix" in earlier.get("otherData", {}):
        shift = (earlier["otherData"]["started_unix"] - started_unix) * 1e6
        names = {e["pid"]: e["args"]["name"] for e in earlier["traceEvents"]
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
        for e in earlier["traceEvents"]:
            if e.get("ph") not in ("X", "i"):
                continue
            e = {**e, "ts": e["ts"] + shift, "args": {**e.get("args", {}), "earlier": True}}
            e["pid"] = pids.setdefault(names.get(e["pid"], "?"), len(pids))
            if e["ph"] == "X" and int(e["args"].get("step", -1)) >= first_step:
                e["args"]["lost"] = True  # trained again after the restart
            events.append(e)
    for iv in intervals:
        pid = pids.setdefault(iv.group, len(pids))
        events.append({"name": f"{iv.task}({iv.step})", "cat": iv.task, "ph": "X",
                       "pid": pid, "tid": 0, "ts": (iv.start - t0) * 1e6,
                       "dur": (iv.end - iv.start) * 1e6, "args": {"step": iv.step}})
    for inc in incidents:  # global instant events: a restart, an engine replaced, ...
        events.append({"name": f"{inc.task}({inc.step}): {inc.what}"[:300], "cat": "incident",
                       "ph": "i", "s": "g", "pid": 0, "tid": 0, "ts": inc.at * 1e6,
                       "args": {"step": inc.step, "task": inc.task, "what": inc.what}})
    devices = devices or {}
    meta = [{"name": "process_name", "ph": "M", "pid": pid,
             "args": {"name": group, **({"devices": devices[group]} if group in devices
                                         else {})}}
            for group, pid in pids.items()]
    out = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
    if started_unix is not None:
        out["otherData"] = {"started_unix": started_unix}
    return out


def write_chrome_trace(intervals: Iterable, path: str | Path,
                       devices: Mapping[str, int] | None = None, **kw) -> Path:
    """Written atomically: a reader (or a crash) never sees half a trace. `kw`: as
    `chrome_trace`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(chrome_trace(intervals, devices, **kw)))
    tmp.replace(path)
    return path


# One colour per task (the states' order), so a task keeps its colour in every picture.
TASK_COLOURS = {"generate": (66, 133, 244), "reward": (251, 188, 5), "ref_logp": (52, 168, 83),
                "values": (0, 150, 136), "logp": (171, 71, 188), "actor-train": (234, 67, 53),
                "sync": (96, 125, 139), "checkpoint": (33, 33, 33), "val-generate": (121, 85, 72),
                "val-score": (255, 112, 67)}
_OTHER = (158, 158, 158)


def _tick(span: float, target: int = 8) -> float:
    """A round tick spacing (1, 2 or 5 × 10^k seconds) giving about `target` ticks."""
    import math

    raw = max(span, 1e-9) / target
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def render_png(intervals: Iterable, path: str | Path, *, groups: Iterable[str] = (),
               title: str = "", width: int = 1400) -> Path:
    """A picture of `intervals`: one row per group, one bar per interval coloured by task and
    labelled by its step as logged (step 0's work is "1"), the gaps (waits) left grey; each
    row's idle ratio over the picture's span on its right; a legend of the tasks below.
    Written atomically (temp file, rename)."""
    from PIL import Image, ImageDraw, ImageFont

    from .metrics import idle_ratio

    ivs = sorted(intervals, key=lambda i: i.start)
    names = list(dict.fromkeys([*groups, *(i.group for i in ivs)]))
    t0 = min((i.start for i in ivs), default=0.0)
    t1 = max((i.end for i in ivs), default=1.0)
    span = max(t1 - t0, 1e-6)
    idle = idle_ratio(ivs, (t0, t1), names)
    tasks = list(dict.fromkeys(i.task for i in ivs))
    font = ImageFont.load_default()
    # the left column fits the longest group name (the default font is about 6 px a character)
    left = max(190, 16 + 6 * max((len(g) for g in names), default=0))
    right, top, row, gap = 100, 40, 30, 8
    height = top + len(names) * (row + gap) + 50
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    x_of = lambda t: left + (t - t0) / span * (width - left - right)  # noqa: E731
    d.text((8, 8), title or f"timeline: {len(ivs)} intervals over {span:.1f} s", fill="black",
           font=font)
    tick = _tick(span)
    n = 0
    while n * tick <= span + 1e-9:  # the time axis, seconds since the picture's start
        x = x_of(t0 + n * tick)
        d.line([(x, top - 6), (x, height - 50)], fill=(225, 225, 225))
        d.text((x + 2, top - 16), f"{n * tick:g}s", fill=(90, 90, 90), font=font)
        n += 1
    for r, g in enumerate(names):
        y = top + r * (row + gap)
        d.rectangle([left, y, width - right, y + row], fill=(238, 238, 238))  # idle: grey
        d.text((8, y + row / 2 - 6), g, fill="black", font=font)
        d.text((width - right + 8, y + row / 2 - 6), f"idle {100 * idle.get(g, 0.0):.0f}%",
               fill="black", font=font)
        for iv in (i for i in ivs if i.group == g):
            a, b = x_of(iv.start), max(x_of(iv.end), x_of(iv.start) + 1)
            colour = TASK_COLOURS.get(iv.task, _OTHER)
            d.rectangle([a, y + 2, b, y + row - 2], fill=colour,
                        outline=tuple(c // 2 for c in colour))
            label = str(iv.step + 1)  # steps as the loggers number them (from 1)
            if b - a > 7 * len(label) + 4:
                d.text((a + 3, y + row / 2 - 6), label, fill="white", font=font)
    x, y = left, height - 30
    for t in tasks:  # legend
        d.rectangle([x, y, x + 14, y + 14], fill=TASK_COLOURS.get(t, _OTHER))
        d.text((x + 18, y + 1), t, fill="black", font=font)
        x += 30 + 7 * len(t)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    img.save(tmp, format="PNG")
    tmp.replace(path)
    return path
