"""Metric sinks named by `trainer.logger`: `console`, `tensorboard`, `wandb` and `mlflow`.

Each sink has `log(step, metrics)`, `log_generations(step, rows)` (a validation's sample
responses, `trainer.log_val_generations`) and `close()`; `make_loggers` builds the configured
ones behind one object, which also appends the generations to `val_generations.jsonl` in the
run's directory. The console sink writes through `logging` (never `print`), one line per step
with a text progress bar and no carriage returns, so CI logs stay readable. W&B and MLflow
live in tracking.py.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from megarl.utils.errors import ConfigError

KNOWN = ("console", "tensorboard", "wandb", "mlflow")

REQUIRES = {
    # sink: (modules it imports, how to install them)
    "tensorboard": (("tensorboard",), "pip install tensorboard"),
    "wandb": (("wandb",), "pip install wandb (megarl's `wandb` extra: pip install -e "
                          "'.[wandb]')"),
    # mlflow-skinny is MLflow's client; its SQLite store (the default here) needs these two
    "mlflow": (("mlflow", "sqlalchemy", "alembic"),
               "pip install mlflow-skinny sqlalchemy alembic (megarl's `mlflow` extra: pip "
               "install -e '.[mlflow]')"),
}
"""What each sink's library is, for the check when the config loads (`check_installed`)."""

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

    def log_generations(self, step: int, rows: Sequence[Mapping], width: int = 160) -> None:
        """A line per row, prompt and response cut to `width` characters."""
        def cut(text: str) -> str:
            text = repr(text)
            return text if len(text) <= width else text[:width - 3] + "..."
        for i, r in enumerate(rows):
            self.log_.info("validation generation %d/%d at step %d (%s): score=%s prompt=%s "
                           "response=%s", i + 1, len(rows), step, r["data_source"],
                           _fmt(r["score"]), cut(r["prompt"]), cut(r["response"]))

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

    def log_generations(self, step: int, rows: Sequence[Mapping]) -> None:
        """A markdown text summary `val/generations`: a section per row."""
        text = "\n\n".join(
            f"### {i + 1}. {r['data_source']}, score {_fmt(r['score'])}\n\n"
            f"**prompt**\n\n    {_indent(r['prompt'])}\n\n"
            f"**response**\n\n    {_indent(r['response'])}" for i, r in enumerate(rows))
        self.writer.add_text("val/generations", text, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _indent(text: str) -> str:
    """As a markdown code block's body (indented four spaces): shown verbatim."""
    return text.replace("\n", "\n    ")


class Loggers:
    """The configured sinks behind one `log`/`close`; `log_generations` also appends to
    `<log_dir>/val_generations.jsonl` (a JSON object per row, with its step)."""

    def __init__(self, sinks: Sequence, log_dir: str | Path | None = None):
        self.sinks = list(sinks)
        self.log_dir = Path(log_dir) if log_dir is not None else None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def log_image(self, step: int, name: str, png: str | Path) -> None:
        """A picture (a PNG file) to the sinks that show pictures (TensorBoard)."""
        for sink in self.sinks:
            if hasattr(sink, "log_image"):
                sink.log_image(step, name, png)

    def log_generations(self, step: int, rows: Sequence[Mapping]) -> None:
        """A validation's sample responses ({data_source, prompt, response, score} each) to
        every sink and the JSONL file."""
        if not rows:
            return
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_dir / "val_generations.jsonl", "a") as f:
                for r in rows:
                    f.write(json.dumps({"step": step, **r}) + "\n")
        for sink in self.sinks:
            sink.log_generations(step, rows)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _sink(name: str, log_dir: Path, total_steps, start_step, project, experiment, config):
    if name == "console":
        return ConsoleLogger(total_steps, start_step=start_step)
    if name == "tensorboard":
        return TensorBoardLogger(log_dir / "tensorboard")
    from megarl.observability import tracking

    cls = {"wandb": tracking.WandbLogger, "mlflow": tracking.MlflowLogger}[name]
    return cls(log_dir, project=project, name=experiment, config=config)


def _sql_store(uri: str) -> bool:
    """Whether MLflow keeps `uri`'s runs through SQLAlchemy (the default here is SQLite)."""
    if not uri:
        return True
    scheme = uri.split(":", 1)[0].split("+", 1)[0] if ":" in uri else "file"  # a bare path
    return scheme in ("sqlite", "postgresql", "mysql", "mssql")


def check_installed(names: Sequence[str] | str) -> None:
    """Raise `ConfigError` naming `trainer.logger` and the pip command when a sink's library
    is missing; unknown names are left to `make_loggers`/the config check."""
    for name in [names] if isinstance(names, str) else names:
        modules, pip = REQUIRES.get(name, ((), ""))
        if name == "mlflow" and not _sql_store(os.environ.get("MLFLOW_TRACKING_URI", "")):
            modules = ("mlflow",)  # a tracking server or a file store: no SQLAlchemy
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(f"trainer.logger: `{name}` needs the Python package"
                              f"{'s' if len(missing) > 1 else ''} {', '.join(missing)}, not "
                              f"installed here: {pip}")


def make_loggers(names: Sequence[str] | str, log_dir: str | Path, *,
                 total_steps: int | None = None, start_step: int = 0,
                 project: str = "megarl", experiment: str = "default",
                 config: Mapping | None = None) -> Loggers:
    """Sinks for `trainer.logger` (e.g. ["console", "tensorboard", "wandb"]).

    `log_dir` is the run's output root (`<default_local_dir>/<project>/<experiment>`);
    TensorBoard writes to `<log_dir>/tensorboard`, W&B and MLflow as tracking.py says, under
    `project`/`experiment` with `config` (the resolved config, a plain dict). An unknown name,
    or one whose library is missing, raises `ConfigError`.
    """
    names = [names] if isinstance(names, str) else list(names)
    for name in names:
        if name not in KNOWN:
            raise ConfigError(f"trainer.logger: unknown logger {name!r} "
                              f"(known: {', '.join(KNOWN)})")
    check_installed(names)
    return Loggers([_sink(n, Path(log_dir), total_steps, start_step, project, experiment, config)
                    for n in names], log_dir)
