"""Experiment trackers named by `trainer.logger`: `wandb` (Weights & Biases) and `mlflow`.

Each is a sink like those in loggers.py (`log`, `log_generations`, `close`) over the tracker's
own library, imported only when the sink is made. Both name the run as verl does: project =
`trainer.project_name`, run = `trainer.experiment_name`, with the resolved config attached.

- W&B: `wandb.init` reads its usual environment (`WANDB_MODE=offline|online|disabled`,
  `WANDB_API_KEY`, `WANDB_ENTITY`, ...). Its files go under `WANDB_DIR`, else the run's
  directory (`<run dir>/wandb/`). Metric names are kept as they are. Every row carries
  `training/global_step` (verl's name for the step), which is the x-axis of every metric:
  megarl logs a validation, a checkpoint's time or a late timing after the next step's
  metrics, and W&B drops rows logged with `step=` below one it has already seen.
- MLflow: the tracking URI is `MLFLOW_TRACKING_URI`, else a SQLite store in the run's
  directory (`sqlite:///<run dir>/mlflow.db`, artifacts in `<run dir>/mlartifacts/`; MLflow 3
  refuses a plain `file:` store). `MLFLOW_RUN_ID` continues a run made elsewhere (as verl).
  Metric names are made valid for MLflow by `mlflow_metric_name` (verl's rule, then a rule for
  paths); config keys become params named by their path (`trainer/project_name`).

Neither gets a secret of the config (`SECRET_KEYS`: the rollout servers' `api_key`).
"""
from __future__ import annotations

import json
import numbers
import os
import re
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

STEP_KEY = "training/global_step"
"""The W&B x-axis: the step each row belongs to (verl logs it under this name too)."""

GENERATION_COLUMNS = ("step", "data_source", "prompt", "response", "score")

SECRET_KEYS = frozenset({"api_key"})
"""Config leaves never sent to a tracker (`actor_rollout_ref.rollout.api_key`): shown as
`<redacted>` when set."""


def public_config(tree: Any) -> Any:
    """`tree` (the resolved config as plain containers) with every SECRET_KEYS leaf redacted."""
    if isinstance(tree, Mapping):
        return {k: "<redacted>" if k in SECRET_KEYS and v is not None else public_config(v)
                for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [public_config(v) for v in tree]
    return tree


def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of `metrics` (numpy scalars too), as floats; flags and text left out."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))}


class WandbLogger:
    """One W&B run: scalars as they come, each validation's generations as a `wandb.Table`
    under `val/generations` (verl's key)."""

    def __init__(self, run_dir: str | Path, *, project: str, name: str,
                 config: Mapping | None = None):
        import wandb

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, config=public_config(config or {}),
                              dir=os.environ.get("WANDB_DIR") or str(run_dir))
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        row = _numeric(metrics)
        if row:
            self.run.log({**row, STEP_KEY: step})

    def log_generations(self, step: int, rows: Sequence[Mapping]) -> None:
        table = self.wandb.Table(columns=list(GENERATION_COLUMNS),
                                 data=[[step, *(r[c] for c in GENERATION_COLUMNS[1:])]
                                       for r in rows])
        self.run.log({"val/generations": table, STEP_KEY: step})

    def close(self) -> None:
        self.run.finish()


# MLflow accepts names of these characters (mlflow/utils/validation.py, off Windows) that stay
# the same under posixpath.normpath (no empty, "." or ".." segment, no leading "/").
_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")


def mlflow_metric_name(name: str) -> str:
    """`name` as a valid MLflow metric name, deterministically: `@` -> `_at_` (verl's rule:
    `val-core/gsm8k/acc/mean@1` -> `val-core/gsm8k/acc/mean_at_1`), any other character
    MLflow refuses -> `_`, empty segments dropped (`a//b/` -> `a/b`) and `.`/`..` segments
    -> `_`/`__`. Valid names are left as they are."""
    name = _MLFLOW_BAD.sub("_", name.replace("@", "_at_"))
    parts = [p for p in name.split("/") if p]
    return "/".join("_" * len(p) if p in (".", "..") else p for p in parts) or "_"


def _flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """Config leaves as {"a/b/c": "value"} (lists as JSON), MLflow params."""
    if isinstance(tree, Mapping):
        out: dict[str, str] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
        return out
    value = json.dumps(tree) if isinstance(tree, (list, tuple)) else str(tree)
    return {prefix[:-1]: value}


def mlflow_tracking_uri(run_dir: str | Path) -> str:
    """`MLFLOW_TRACKING_URI`, else the run's own SQLite store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


class MlflowLogger:
    """One MLflow run in experiment `project`: scalars per step, the config as params, each
    validation's generations as the JSON artifact `val_generations/step_<k>.json`."""

    def __init__(self, run_dir: str | Path, *, project: str, name: str,
                 config: Mapping | None = None):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        own_store = not os.environ.get("MLFLOW_TRACKING_URI")
        self.client = MlflowClient(tracking_uri=mlflow_tracking_uri(run_dir))
        run_id = os.environ.get("MLFLOW_RUN_ID")
        if run_id:
            self.run_id = self.client.get_run(run_id).info.run_id
        else:
            exp = self.client.get_experiment_by_name(project)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
                project, artifact_location=(run_dir / "mlartifacts").resolve().as_uri()
                if own_store else None)
            self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        params = [Param(mlflow_metric_name(k), v)
                  for k, v in _flatten(public_config(config or {})).items()]
        if params:
            self.client.log_batch(self.run_id, params=params)  # the client sends in chunks

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_metric_name(k), v, now, step)
                 for k, v in _numeric(metrics).items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_generations(self, step: int, rows: Sequence[Mapping]) -> None:
        self.client.log_text(self.run_id, json.dumps([{"step": step, **r} for r in rows],
                                                     indent=1),
                             f"val_generations/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
