"""`megarl plan`: choose the task groups, their device shares and how far generation runs ahead
from measured task durations, by running the controller's own scheduler on a virtual clock.

The measurements come from a run's `timeline.json` (every run writes one; see
`Driver.write_timeline`): each task's median seconds per step, and how many devices its group
had. A candidate layout is priced by scaling each task to its new group's devices and
simulating a few steps with `machine.simulate`, the same ready/start/finish rules the driver
follows, so overlap, waits and the generate-ahead bound are those of a real run.

The model, and what it leaves out:
- a data-parallel task (generate, ref_logp, logp, actor-train) on d devices takes
  t_measured × d_measured / d; reward (the driver's CPU pool) and sync take what they took;
- tasks sharing a group run one after another on it (the scheduler's rule);
- memory is the dry run's estimate (`dryrun.plan_run`, with `--gpu-memory-gib` per device);
  a layout that does not fit is listed as such, never ranked;
- not modelled: contention between groups that share physical cores (CPU "devices" on one
  machine), communication that grows with the device count, and rollout TP (kept as
  configured).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from megarl.cluster.topology import group_name
from megarl.config import ConfigError, load_config
from megarl.observability.metrics import idle_ratio

from .machine import Pipeline, simulate, task_groups

logger = logging.getLogger(__name__)

SCALES = frozenset({"generate", "ref_logp", "logp", "actor-train"})
"""Tasks whose time divides over their group's devices (data parallel), with scaling
"linear"."""
SCALINGS = ("linear", "none")
"""How a task's time follows its group's device count: "linear" (accelerators: twice the
devices, half the time for the tasks in SCALES), "none" (devices that share a host's cores,
as trainer.device=cpu does: more processes make nothing faster, so the measured time
stands). `plan` picks "none" for CPU runs and "linear" otherwise unless told."""
WARMUP_STEPS = 2  # first steps left out of the medians (model loading, first compiles)
SIM_STEPS = 16


@dataclasses.dataclass(frozen=True)
class Measured:
    seconds: dict[str, float]  # task -> median seconds per step
    devices: dict[str, int]  # task -> devices of its group in the measured run
    steps: int
    source: str


def measure(trace: str | Path) -> Measured:
    """Per-task medians from a run's `timeline.json`; a clear error for anything else."""
    path = Path(trace)
    if path.is_dir():
        path = path / "timeline.json"
    try:
        data = json.loads(path.read_text())
        events = data["traceEvents"]
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (a run writes timeline.json into its output "
                          "directory every trainer.timeline_freq steps)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a megarl timeline ({type(e).__name__}: {e})") from None
    group_of, devices = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            group_of[e["pid"]] = name = e["args"]["name"]
            if "devices" in e["args"]:
                devices[name] = int(e["args"]["devices"])
    per = defaultdict(float)  # (task, step) -> seconds
    task_group = {}
    # this run's own work: not what a run before a restart did
    for e in (e for e in events if e.get("ph") == "X" and not e["args"].get("earlier")):
        if e["cat"].startswith("val-") or e["cat"] == "checkpoint":
            continue  # planned layouts are compared without validations and saves
        per[(e["cat"], int(e["args"]["step"]))] += float(e["dur"]) / 1e6
        task_group[e["cat"]] = group_of.get(e["pid"], "?")
    steps = sorted({s for _, s in per})
    if not steps:
        raise ConfigError(f"{path}: no training steps in the timeline")
    kept = [s for s in steps if s >= steps[0] + WARMUP_STEPS] or steps
    seconds = {t: statistics.median(per.get((t, s), 0.0) for s in kept) for t in task_group}
    missing = sorted(g for t, g in task_group.items() if t in SCALES and g not in devices)
    if missing:
        raise ConfigError(f"{path}: no device count for group(s) {', '.join(missing)} "
                          "(a timeline written before megarl recorded them; rerun to profile)")
    return Measured(seconds, {t: devices[g] for t, g in task_group.items() if g in devices},
                    len(kept), str(path))


@dataclasses.dataclass
class Candidate:
    groups: tuple[tuple[str, ...], ...]
    devices: tuple[int, ...]
    ahead: int
    step_s: float = float("nan")
    idle: dict[str, float] = dataclasses.field(default_factory=dict)
    memory_gib: float = 0.0  # the fullest device's estimate
    refused: str | None = None  # why it cannot run (placement or memory)
    rollout_tp: int | None = None  # the engines' TP, when not the config's

    def overrides(self) -> list[str]:
        total = sum(self.devices)
        tasks = ",".join(f"[{','.join(g)}]" for g in self.groups)
        ratios = ",".join(f"{d / total:g}" for d in self.devices)
        tp = [] if self.rollout_tp is None else [
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={self.rollout_tp}"]
        return [f"trainer.separated_node_tasks=[{tasks}]",
                f"trainer.separated_node_ratios=[{ratios}]",
                f"actor_rollout_ref.async_pipeline={self.ahead > 1}",
                f"trainer.generate_ahead_steps={self.ahead}", *tp]

    def label(self) -> str:
        tp = "" if self.rollout_tp is None else f"  (rollout TP {self.rollout_tp})"
        return "  ".join(f"[{'+'.join(g)}]x{d}" for g, d in zip(self.groups, self.devices)) + tp


def _partitions(units: Sequence[tuple[str, ...]]) -> Iterator[list[tuple[str, ...]]]:
    """Every way to put the units into groups (set partitions), units inside a group kept."""
    if not units:
        yield []
        return
    first, rest = units[0], units[1:]
    for part in _partitions(rest):
        yield [first, *part]
        for i in range(len(part)):
            yield [*part[:i], part[i] + first, *part[i + 1:]]


def _splits(total: int, k: int) -> Iterator[tuple[int, ...]]:
    """Positive device counts for k groups adding up to `total`."""
    if k == 1:
        yield (total,)
        return
    for first in range(1, total - k + 2):
        for rest in _splits(total - first, k - 1):
            yield (first, *rest)


def predict(m: Measured, groups: Sequence[Sequence[str]], devices: Sequence[int], ahead: int,
            steps: int = SIM_STEPS, scaling: str = "linear") -> tuple[float, dict[str, float]]:
    """Steady-state seconds per step and idle ratio per group of one layout (simulated)."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling {scaling!r}: one of {', '.join(SCALINGS)}")
    mapping = task_groups([list(g) for g in groups])
    dev = {group_name(g): d for g, d in zip(groups, devices)}

    def cost(action) -> float:
        t = m.seconds.get(action.task, 0.0)
        if scaling == "linear" and action.task in SCALES and action.task in m.devices:
            t *= m.devices[action.task] / dev[mapping[action.task]]
        return t

    p = Pipeline(ahead, steps, groups=mapping)
    tl = simulate(p, cost)
    # A steady window: past the start-up, and before the last steps, where no generation
    # is left to run ahead.
    first, last = steps // 2, steps - 1 - ahead
    if last < first:
        raise ValueError(f"steps={steps} too few for generate_ahead_steps={ahead}")
    lo, hi = p.step_window(first)[0], p.step_window(last)[1]
    idle = idle_ratio(tl, (lo, hi), list(dev))
    return (hi - lo) / (last - first + 1), {g: r for g, r in idle.items() if g in dev}


def _rollout_tps(config_tp: int, devices: int) -> list[int]:
    """The config's rollout TP first, then every other power of two that splits `devices`."""
    others, tp = [], 1
    while tp <= devices:
        if tp != config_tp and devices % tp == 0:
            others.append(tp)
        tp *= 2
    return [config_tp, *others]


def _fit(config, overrides, c: Candidate, cfg, gpu_memory_gib: float) -> Candidate:
    """`c` with its memory estimate, placed by the dry run (placement and memory do not depend
    on how far generation runs ahead). Where the config's rollout TP cannot run on the
    generate group (it does not split the group's devices, or an engine does not fit), the
    smallest other TP that can is taken; if none can, the config's TP's reason refuses it."""
    from .dryrun import plan_run

    gen = next(d for g, d in zip(c.groups, c.devices) if "generate" in g)
    config_tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    first_reason = None
    for tp in _rollout_tps(config_tp, gen):
        trial = dataclasses.replace(c, rollout_tp=None if tp == config_tp else tp)
        try:
            run = plan_run(load_config(config, [*overrides, *trial.overrides()]),
                           gpu_memory_gib=gpu_memory_gib)
        except ConfigError as e:
            first_reason = first_reason or str(e)
            continue
        trial.memory_gib = max(g.total for g in run.memory) / 2**30
        return trial
    return dataclasses.replace(c, refused=first_reason)


def default_scaling(device: str) -> str:
    """"none" for CPU devices (processes on one host's cores), "linear" for accelerators."""
    return "none" if device == "cpu" else "linear"


def plan(config: str | None, overrides: Sequence[str], m: Measured,
         gpu_memory_gib: float = 80.0, aheads: Iterable[int] | None = None,
         scaling: str | None = None) -> list[Candidate]:
    """Every layout of the config's devices, priced; fitting ones first, fastest first.
    `scaling`: see SCALINGS; None picks by trainer.device."""
    from .dryrun import needs_ref

    cfg = load_config(config, overrides)
    t = cfg.trainer
    scaling = scaling or default_scaling(t.device)
    if cfg.algorithm.adv_estimator == "gae":
        raise ConfigError("algorithm.adv_estimator=gae: megarl plan does not price a critic "
                          "yet (its values and critic-train tasks); plan the actor without it")
    # logp on a group of its own runs on a replica the weight sync feeds (LOGP(k) then
    # waits for SYNC(k-1), which the simulation knows)
    units = [("logp",), ("actor-train",), ("generate",)]
    if needs_ref(cfg):
        units.append(("ref_logp",))
    missing = [x for u in units for x in u if x in SCALES and x not in m.seconds]
    if missing:
        raise ConfigError(f"{m.source}: no measured time for task(s) {', '.join(missing)}")
    total = t.nnodes * t.n_gpus_per_node
    # Across nodes a group owns whole nodes (the ratios' rule), so shares go by node.
    unit = t.n_gpus_per_node if t.nnodes > 1 else 1
    aheads = sorted(set(aheads or (1, 2, t.generate_ahead_steps)))
    out = []
    for groups in _partitions(units):
        if not needs_ref(cfg):  # ref_logp still needs a group to be scheduled on
            groups = [g + ("ref_logp",) if "actor-train" in g else g for g in groups]
        for shares in _splits(total // unit, len(groups)):
            devices = tuple(x * unit for x in shares)
            fit = _fit(config, overrides, Candidate(tuple(tuple(g) for g in groups), devices,
                                                    aheads[0]), cfg, gpu_memory_gib)
            for ahead in aheads:
                c = dataclasses.replace(fit, ahead=ahead)
                if c.refused is None:
                    c.step_s, c.idle = predict(m, c.groups, c.devices, ahead,
                                               scaling=scaling)
                out.append(c)
    ok = sorted((c for c in out if c.refused is None), key=lambda c: (c.step_s, c.ahead))
    if not ok:
        reasons = sorted({c.refused for c in out})
        raise ConfigError(f"megarl plan: no layout of {total} device(s) can run this config: "
                          + "; ".join(reasons[:3]))
    return ok + [c for c in out if c.refused is not None]


def format_table(cands: Sequence[Candidate], m: Measured, limit: int = 15) -> str:
    ok = [c for c in cands if c.refused is None]
    lines = [f"measured ({m.source}, median of {m.steps} step(s)): "
             + ", ".join(f"{t} {s:.3f}s" + (f"/{m.devices[t]}dev" if t in m.devices else "")
                         for t, s in sorted(m.seconds.items())),
             "",
             f"{'#':>3}  {'step s':>8}  {'ahead':>5}  {'mem GiB':>7}  layout  (idle per group)"]
    for i, c in enumerate(ok[:limit], 1):
        idle = ", ".join(f"{g} {100 * r:.0f}%" for g, r in sorted(c.idle.items()))
        lines.append(f"{i:>3}  {c.step_s:>8.3f}  {c.ahead:>5}  {c.memory_gib:>7.2f}  "
                     f"{c.label()}  ({idle})")
    refused = list({c.label(): c for c in cands if c.refused is not None}.values())
    if refused:
        lines.append(f"\n{len(refused)} layout(s) cannot run, e.g. {refused[0].label()}: "
                     f"{refused[0].refused}")
    lines += ["", "best, as overrides:", " ".join(f"'{o}'" for o in ok[0].overrides())]
    return "\n".join(lines) + "\n"
