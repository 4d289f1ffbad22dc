"""Console line format, TensorBoard event files read back, logger selection, Chrome trace."""
import json
import logging

import pytest

from megarl.config.errors import ConfigError
from megarl.controller.machine import Pipeline, simulate
from megarl.observability.loggers import (ConsoleLogger, TensorBoardLogger, make_loggers,
                                          progress_bar)
from megarl.observability.timeline import write_chrome_trace


def test_progress_bar():
    assert progress_bar(0, 10) == "[....................]   0%"
    assert progress_bar(3, 10) == "[######..............]  30%"
    assert progress_bar(10, 10) == "[####################] 100%"


def test_console_line_format(caplog):
    t = [0.0]
    log = ConsoleLogger(10, clock=lambda: t[0])
    caplog.set_level(logging.INFO, logger="megarl.progress")
    t[0] = 12.0
    log.log(3, {"reward/mean": 0.25, "timing/step": 4.0, "actor/kl_loss": 1e-4,
                "not/shown": 1.0})
    t[0] = 130.0
    log.log(10, {"reward/mean": 0.5})
    first, last = caplog.messages
    assert first == ("step 3/10 [######..............]  30% elapsed 0m12s eta 0m28s | "
                     "reward/mean=0.25 actor/kl_loss=0.0001 timing/step=4")
    assert last == "step 10/10 [####################] 100% elapsed 2m10s | reward/mean=0.5"
    assert "\r" not in first + last


def test_tensorboard_event_file_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    with make_loggers(["console", "tensorboard"], tmp_path, total_steps=3) as loggers:
        for step in (1, 2, 3):
            loggers.log(step, {"reward/mean": step / 10, "timing/generate": 2.0 * step,
                               "perf/idle_ratio/generate": 0.5})
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert files
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"reward/mean", "timing/generate", "perf/idle_ratio/generate"} <= set(
        acc.Tags()["scalars"])
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([0.1, 0.2, 0.3])


def test_tensorboard_skips_non_scalars(tmp_path):
    tb = TensorBoardLogger(tmp_path)
    tb.log(1, {"a": 1, "flag": True, "name": "x"})
    tb.close()


def test_unknown_logger_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.logger.*'swanlab'.*console, tensorboard, "
                                          r"wandb, mlflow"):
        make_loggers(["console", "swanlab"], tmp_path)
    assert len(make_loggers("console", tmp_path).sinks) == 1


def test_chrome_trace(tmp_path):
    p = Pipeline(2, 2, clock=lambda: 0.0)
    tl = simulate(p, {"generate": 1.0, "actor-train": 0.5})
    trace = json.loads(write_chrome_trace(tl, tmp_path / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(tl)
    assert {e["name"] for e in events} >= {"generate(0)", "actor-train(1)"}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"colocated", "reward"}
    assert max(e["ts"] + e["dur"] for e in events) == pytest.approx(3.0e6)


def test_a_restarted_run_keeps_the_timeline_before_it_on_the_wall_clock(tmp_path):
    """The trace written before a restart stays ahead of the new one, shifted by the wall
    time between their starts; its work on steps trained again is marked lost; incidents
    (the restart) are instant events; `megarl plan` measures only the new run's work."""
    from megarl.controller.machine import Incident, Interval
    from megarl.controller.planner import measure

    first = [Interval("train", "actor-train", k, 10.0 + k, 10.5 + k) for k in range(4)]
    before = json.loads(write_chrome_trace(first, tmp_path / "t.json", {"train": 1}, t0=10.0,
                                           started_unix=1000.0).read_text())
    # the restart began 100 s later (wall clock), resuming after step 2: steps 2.. again
    again = [Interval("train", "actor-train", k, 50.0 + k - 2, 50.5 + k - 2)
             for k in range(2, 6)]
    trace = json.loads(write_chrome_trace(
        again, tmp_path / "timeline.json", {"train": 1}, t0=50.0, started_unix=1100.0,
        earlier=before, first_step=2,
        incidents=[Incident(2, "restart", "restart 1 after: WorkerLost: x", 0.0)]).read_text())
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    old = {e["args"]["step"]: e for e in x if e["args"].get("earlier")}
    assert sorted(old) == [0, 1, 2, 3]
    assert old[0]["ts"] == pytest.approx(-100e6) and old[3]["ts"] == pytest.approx(-97e6)
    assert [k for k, e in sorted(old.items()) if e["args"].get("lost")] == [2, 3]
    new = [e for e in x if not e["args"].get("earlier")]
    assert [e["args"]["step"] for e in new] == [2, 3, 4, 5] and new[0]["ts"] == 0.0
    (inc,) = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert inc["args"] == {"step": 2, "task": "restart", "what": "restart 1 after: WorkerLost: x"}
    assert len({e["pid"] for e in x}) == 1  # one group, one row, before and after
    # a second restart keeps both earlier runs, on the same clock
    third = json.loads(write_chrome_trace([], tmp_path / "t3.json", {"train": 1}, t0=0.0,
                                          started_unix=1200.0, earlier=trace,
                                          first_step=6).read_text())
    ts = sorted(e["ts"] for e in third["traceEvents"] if e["ph"] == "X")
    assert ts[0] == pytest.approx(-200e6) and ts[-1] == pytest.approx(-97e6)
    m = measure(tmp_path / "timeline.json")
    assert m.steps == 2 and m.seconds["actor-train"] == pytest.approx(0.5)  # 4, 2 warm-up


def test_timeline_picture_shows_each_interval_and_the_waits(tmp_path):
    """Bars sit where their intervals are, in their task's colour; the gaps stay grey; the
    picture reaches TensorBoard as an image."""
    from PIL import Image

    from megarl.controller.machine import Interval
    from megarl.observability.timeline import TASK_COLOURS, render_png

    tl = [Interval("trainer", "actor-train", 0, 0.0, 4.0),
          Interval("rollout", "generate", 0, 0.0, 2.0),
          Interval("rollout", "generate", 1, 6.0, 10.0)]
    png = render_png(tl, tmp_path / "t.png", groups=["trainer", "rollout"], width=1210)
    assert not list(tmp_path.glob(".*tmp"))  # renamed into place
    img = Image.open(png).convert("RGB")
    left, right, top, row, gap = 190, 100, 40, 30, 8  # render_png's layout
    x = lambda t: int(left + t / 10.0 * (1210 - left - right))  # noqa: E731
    y = lambda r: top + r * (row + gap) + 5  # noqa: E731  (above the step label)
    assert img.getpixel((x(2.0), y(0))) == TASK_COLOURS["actor-train"]
    assert img.getpixel((x(6.0), y(0))) == (238, 238, 238)  # the trainer waits
    assert img.getpixel((x(1.0), y(1))) == TASK_COLOURS["generate"]
    assert img.getpixel((x(4.0), y(1))) == (238, 238, 238)  # between two generations
    assert img.getpixel((x(8.0), y(1))) == TASK_COLOURS["generate"]
    tb = TensorBoardLogger(tmp_path / "tb")
    tb.log_image(3, "timeline", png)
    tb.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    (shown,) = acc.Images("timeline")
    assert shown.step == 3 and (shown.width, shown.height) == img.size
