"""Metric sinks named by `trainer.logger`: `console` and `tensorboard`.

Each sink has `log(step, metrics)` and `close()`; `make_loggers` builds the configured ones
behind one object. The console sink writes through `logging` (never `print`), one line per
step with a text progress bar and no carriage returns, so CI logs stay readable.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from megarl.utils.errors import ConfigError

KNOWN = ("console", "tensorboard")

SUMMARY_KEYS = ("reward/mean", "val/reward_mean", "response/length_mean", "actor/pg_loss",
                "actor/kl_loss", "actor/entropy", "rollout/staleness_max",
                "perf/throughput_tokens_per_s", "weight_sync/time_s", "timing/step")
"""What the console line shows, in this order, when present (everything goes to TensorBoard)."""


def _fmt(value: float) -> str:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    return f"{value:.4g}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """`[########............]  40%` — plain ASCII, fixed width."""
    frac = 0.0 if total <= 0 else min(1.0, max(0.0, done / total))
    filled = int(round(frac * width))
    return f"[{'#' * filled}{'.' * (width - filled)}] {frac * 100:3.0f}%"


class ConsoleLogger:
    """One line per step: progress bar, step/total, elapsed and ETA, then the summary metrics.

    `step` is the number of steps completed (1-based, like verl's global step; `start_step`:
    completed before this process started, for the ETA after a resume); lines look like
    `step 3/10 [######..............]  30% elapsed 0m12s eta 0m28s | reward/mean=0.25 ...`.
    """

    def __init__(self, total_steps: int | None = None, *, start_step: int = 0,
                 keys: Sequence[str] = SUMMARY_KEYS, log: logging.Logger | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.start_step, self.keys, self.clock = (total_steps, start_step,
                                                              tuple(keys), clock)
        self.log_ = log or logging.getLogger("megarl.progress")
        self.t0 = clock()

    def format(self, step: int, metrics: Mapping[str, float]) -> str:
        elapsed = self.clock() - self.t0
        head = f"step {step}"
        if self.total:
            head += f"/{self.total} {progress_bar(step, self.total)}"
        head += f" elapsed {_duration(elapsed)}"
        done_here = step - self.start_step  # steps this process ran (resume-aware ETA)
        if self.total and done_here > 0 and step < self.total:
            head += f" eta {_duration(elapsed / done_here * (self.total - step))}"
        shown = [f"{k}={_fmt(metrics[k])}" for k in self.keys if k in metrics]
        return head + (" | " + " ".join(shown) if shown else "")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.log_.info(self.format(step, metrics))

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Every numeric metric as a scalar under its own name, in `log_dir` (event files)."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter  # pulls in tensorboard; only if asked
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def log_image(self, step: int, name: str, png: str | Path) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(png) as img:
            pixels = np.asarray(img.convert("RGB"))
        self.writer.add_image(name, pixels, global_step=step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Loggers:
    """The configured sinks behind one `log`/`close`."""

    def __init__(self, sinks: Sequence):
        self.sinks = list(sinks)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def log_image(self, step: int, name: str, png: str | Path) -> None:
        """A picture (a PNG file) to the sinks that show pictures (TensorBoard)."""
        for sink in self.sinks:
            if hasattr(sink, "log_image"):
                sink.log_image(step, name, png)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def make_loggers(names: Sequence[str] | str, log_dir: str | Path, *,
                 total_steps: int | None = None, start_step: int = 0) -> Loggers:
    """Sinks for `trainer.logger` (e.g. ["console", "tensorboard"]).

    `log_dir` is the run's output root (`<default_local_dir>/<project>/<experiment>`);
    TensorBoard writes to `<log_dir>/tensorboard`. An unknown name raises `ConfigError`.
    """
    if isinstance(names, str):
        names = [names]
    sinks = []
    for name in names:
        if name == "console":
            sinks.append(ConsoleLogger(total_steps, start_step=start_step))
        elif name == "tensorboard":
            sinks.append(TensorBoardLogger(Path(log_dir) / "tensorboard"))
        else:
            raise ConfigError(f"trainer.logger: unknown logger {name!r} "
                              f"(known: {', '.join(KNOWN)})")
    return Loggers(sinks)
