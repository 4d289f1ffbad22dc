"""Observability: metric names and per-step collection (metrics.py), the sinks `trainer.logger`
names (loggers.py: console, TensorBoard; tracking.py: W&B, MLflow), what a validation reports
(val_report.py: verl's per-source metrics, sample generations), Chrome-trace export of the
pipeline timeline (timeline.py)."""
