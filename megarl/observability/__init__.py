"""Observability: metric names and per-step collection (metrics.py), console and TensorBoard
sinks (loggers.py), Chrome-trace export of the pipeline timeline (timeline.py)."""
