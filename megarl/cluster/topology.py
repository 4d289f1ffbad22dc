"""Pure placement arithmetic: task groups + ratios -> contiguous device ranges.

This module owns the meaning of ``trainer.separated_node_tasks`` / ``separated_node_ratios``:
normalising a bare task name into a one-task group, checking that the groups cover the task
set, and turning ratios into whole devices (whole nodes when the cluster has several). It
knows nothing of Ray or of model parallelism; ``placement.py`` maps plans to Ray resources
and ``megarl.config.validate`` adds the TP×PP checks.

Device indices are global: node ``i``'s local device ``j`` is ``i * devices_per_node + j``.
Groups take consecutive ranges in the order they are listed.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Sequence, Union

# Every task a group can host.
TASKS = ("generate", "ref_logp", "logp", "actor-train", "reward", "critic")
# ``reward`` is CPU-only: left out of the groups, it runs on the driver. ``critic`` (the value
# model of adv_estimator=gae), left out, runs beside ``actor-train`` on that group's devices.
OPTIONAL_TASKS = ("reward", "critic")

_RATIO_TOL = 1e-6

TaskSpec = Union[str, Sequence[str]]


class TopologyError(ValueError):
    """A bad group layout. ``field`` is ``"tasks"`` or ``"ratios"``: which input is at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GroupPlan:
    name: str
    """Tasks joined by ``+``, e.g. ``logp+actor-train``."""
    tasks: tuple[str, ...]
    """Tasks that share this group's workers (and so serialize on them)."""
    devices: tuple[int, ...]
    """Global device indices, contiguous."""
    nodes: tuple[int, ...]
    """Node indices the devices live on."""

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def device_range(self) -> range:
        return range(self.devices[0], self.devices[-1] + 1)


def normalize_groups(tasks: Sequence[TaskSpec]) -> list[tuple[str, ...]]:
    """The one place a bare task name becomes a one-task group."""
    groups = []
    for item in tasks:
        group = (item,) if isinstance(item, str) else tuple(item)
        if not group:
            raise TopologyError("tasks", "a task group is empty")
        if not all(isinstance(t, str) for t in group):
            raise TopologyError("tasks", f"group {list(group)!r}: a task name must be a string")
        groups.append(group)
    return groups


def group_name(tasks: Sequence[str]) -> str:
    """A task group's name: its tasks joined by '+', in the order the config lists them (the
    name the logs, metrics, timeline and placement all use)."""
    return "+".join(tasks)


def check_coverage(groups: Sequence[tuple[str, ...]]) -> None:
    """Every task at most once, every non-optional task exactly once, no unknown names."""
    seen: dict[str, int] = {}
    for index, group in enumerate(groups):
        for task in group:
            if task not in TASKS:
                close = difflib.get_close_matches(task, TASKS, n=1)
                hint = f"; did you mean `{close[0]}`?" if close else ""
                raise TopologyError(
                    "tasks", f"unknown task {task!r} (known: {', '.join(TASKS)}){hint}")
            if task in seen:
                raise TopologyError(
                    "tasks", f"task {task!r} appears in group {seen[task]} and group {index}")
            seen[task] = index
    missing = [t for t in TASKS if t not in seen and t not in OPTIONAL_TASKS]
    if missing:
        raise TopologyError("tasks", f"tasks missing from every group: {', '.join(missing)}")


def _whole(x: float) -> int | None:
    """``x`` as an int if it is one up to float noise (0.1 * 30 is not exactly 3)."""
    n = round(x)
    return n if math.isclose(x, n, abs_tol=_RATIO_TOL) else None


def _device_counts(ratios: Sequence[float], nnodes: int, devices_per_node: int) -> list[int]:
    counts = []
    for index, ratio in enumerate(ratios):
        if nnodes > 1:
            # Groups own whole nodes: partial nodes would make groups share NICs and hosts.
            nodes = _whole(ratio * nnodes)
            if nodes is None:
                raise TopologyError("ratios", (
                    f"group {index}: ratio {ratio} × {nnodes} nodes = {ratio * nnodes:g} "
                    "is not a whole number of nodes"))
            count = nodes * devices_per_node
        else:
            count = _whole(ratio * devices_per_node)
            if count is None:
                raise TopologyError("ratios", (
                    f"group {index}: ratio {ratio} × {devices_per_node} devices = "
                    f"{ratio * devices_per_node:g} is not a whole number of devices"))
        if count == 0:
            raise TopologyError("ratios", f"group {index}: ratio {ratio} gives zero devices")
        counts.append(count)
    return counts


def plan_groups(
    tasks: Sequence[TaskSpec],
    ratios: Sequence[float],
    nnodes: int,
    devices_per_node: int,
) -> list[GroupPlan]:
    """Place each task group on a contiguous slice of the cluster.

    Raises ``TopologyError`` for a layout that cannot be placed exactly.
    """
    if nnodes < 1 or devices_per_node < 1:
        raise TopologyError("ratios", f"need nnodes ≥ 1 and devices per node ≥ 1, got "
                                      f"{nnodes} and {devices_per_node}")
    groups = normalize_groups(tasks)
    check_coverage(groups)
    ratios = [float(r) for r in ratios]
    if len(ratios) != len(groups):
        raise TopologyError("ratios", f"{len(ratios)} ratios for {len(groups)} task groups")
    for index, ratio in enumerate(ratios):
        if ratio <= 0:
            raise TopologyError("ratios", f"group {index}: ratio {ratio} must be > 0")
    if abs(sum(ratios) - 1.0) > _RATIO_TOL:
        raise TopologyError("ratios", f"ratios sum to {sum(ratios):g}, not 1")

    plans, start = [], 0
    for group, count in zip(groups, _device_counts(ratios, nnodes, devices_per_node)):
        devices = tuple(range(start, start + count))
        nodes = tuple(sorted({d // devices_per_node for d in devices}))
        plans.append(GroupPlan(group_name(group), group, devices, nodes))
        start += count
    return plans
