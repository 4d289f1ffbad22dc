"""`megarl plan`: measured durations from a timeline file, layouts priced by the scheduler's
own simulation, the dry run's memory check, the CLI and its errors. The timelines here are
written by the real trace writer from the real scheduler (a virtual clock), not by hand."""
import json
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.config import ConfigError
from megarl.controller import planner
from megarl.controller.machine import Pipeline, simulate, task_groups
from megarl.observability.timeline import write_chrome_trace

REPO = Path(__file__).resolve().parents[3]
QWEN2 = str(REPO / "configs" / "qwen2_7b_async.yaml")
TASKS = [["logp", "actor-train", "ref_logp"], ["generate"]]
# log-prob passes of 4 rows, not the config's 16: the log-prob path's fp32 vocab copies
# (controller/memory.py logit_copies) of 16 × 3072 tokens fill a device in the smaller layouts
# these tests explore
LOGP4 = ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]
SECONDS = {"generate": 4.0, "reward": 0.5, "ref_logp": 1.0, "logp": 1.0, "actor-train": 2.0,
           "sync": 0.2}


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the config's hf_config_path is relative to the working directory


def _trace(path: Path, groups=TASKS, devices=(8, 8), steps=10, seconds=SECONDS) -> Path:
    p = Pipeline(2, steps, groups=task_groups(groups))
    tl = simulate(p, seconds)
    return write_chrome_trace(tl, path / "timeline.json",
                              {"+".join(g): d for g, d in zip(groups, devices)})


def test_measure_reads_medians_and_device_counts(tmp_path):
    m = planner.measure(_trace(tmp_path).parent)  # a run directory names its timeline.json
    assert m.seconds == pytest.approx(SECONDS)
    assert m.devices == {"logp": 8, "actor-train": 8, "ref_logp": 8, "sync": 8,
                         "generate": 8}
    assert m.steps == 8  # the first two steps are warm-up


def test_a_colocated_step_is_the_sum_and_overlap_hides_the_shorter_side(tmp_path):
    m = planner.measure(_trace(tmp_path))
    colocated, idle = planner.predict(m, [("generate", "ref_logp", "logp", "actor-train")],
                                      [16], ahead=1)
    # one group: every task in turn, each on twice the devices it was measured on
    scaled = sum(SECONDS[t] / 2 for t in ("generate", "ref_logp", "logp", "actor-train"))
    assert colocated == pytest.approx(scaled + SECONDS["reward"] + SECONDS["sync"])
    assert idle == {"generate+ref_logp+logp+actor-train": pytest.approx(
        SECONDS["reward"] / colocated)}
    # separated, one step ahead: GENERATE(k+2) waits for SYNC(k), so the cycle is two steps
    # of generate -> reward -> trainer side -> sync, while GENERATE(k+1) runs beside it
    step, idle = planner.predict(m, [("logp", "actor-train", "ref_logp"), ("generate",)],
                                 [8, 8], ahead=2)
    trainer = SECONDS["ref_logp"] + SECONDS["logp"] + SECONDS["actor-train"] + SECONDS["sync"]
    assert step == pytest.approx((SECONDS["generate"] + SECONDS["reward"] + trainer) / 2)
    assert step < SECONDS["generate"] + SECONDS["reward"] + trainer  # overlap pays
    assert idle["generate"] == pytest.approx(1 - SECONDS["generate"] / step)
    assert idle["logp+actor-train+ref_logp"] == pytest.approx(1 - trainer / step)


def test_devices_sharing_a_host_scale_nothing(tmp_path):
    """scaling="none" (CPU devices: processes on one host's cores) keeps each task's measured
    time whatever its group's devices, so the layout that overlaps most wins; "linear" makes
    a task on twice the devices take half the time. `plan` picks by trainer.device."""
    m = planner.measure(_trace(tmp_path))
    every = [("generate", "ref_logp", "logp", "actor-train")]
    none, _ = planner.predict(m, every, [16], ahead=1, scaling="none")
    assert none == pytest.approx(sum(SECONDS.values()))
    linear, _ = planner.predict(m, every, [16], ahead=1)
    assert linear < none
    apart = [("logp",), ("ref_logp",), ("actor-train",), ("generate",)]
    assert planner.predict(m, apart, [4, 4, 4, 4], 2, scaling="none")[0] < none
    with pytest.raises(ValueError, match="scaling 'cubic'"):
        planner.predict(m, every, [16], 1, scaling="cubic")
    assert (planner.default_scaling("cpu"), planner.default_scaling("cuda")) == \
        ("none", "linear")


def test_plan_ranks_fitting_layouts_and_refuses_what_does_not_fit(tmp_path):
    m = planner.measure(_trace(tmp_path))
    cands = planner.plan(QWEN2, LOGP4, m, gpu_memory_gib=80.0)
    ok = [c for c in cands if c.refused is None]
    assert ok and [c.step_s for c in ok] == sorted(c.step_s for c in ok)
    assert {sum(c.devices) for c in cands} == {32}  # 4 nodes of 8
    assert all(d % 8 == 0 for c in cands for d in c.devices)  # whole nodes per group
    # every task once per layout; logp also on a group of its own (its replica)
    assert all(sorted(t for g in c.groups for t in g) == sorted(
        ["logp", "actor-train", "ref_logp", "generate"]) for c in cands)
    assert any(("logp",) in c.groups for c in ok)
    # the dry run's estimate: the engine (its KV cache) and a Megatron copy of the actor (the
    # trainer, or logp's replica) on one 80 GiB device do not fit
    refused = [c for c in cands if c.refused]
    assert refused and all("does not fit" in c.refused for c in refused)
    assert all(any("generate" in g and {"actor-train", "logp"} & set(g) for g in c.groups)
               for c in refused)
    # the first choice, pasted back, loads and is that layout
    from megarl.config import load_config

    best = load_config(QWEN2, [*LOGP4, *ok[0].overrides()])
    assert best.trainer.generate_ahead_steps == ok[0].ahead
    assert len(best.trainer.separated_node_tasks) == len(ok[0].groups)


def test_plan_cli_prints_a_table_and_writes_the_overrides(tmp_path, capsys):
    run = _trace(tmp_path).parent
    out = tmp_path / "best.txt"
    assert main(["plan", "--config", QWEN2, "--from-run", str(run), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step s" in text and "best, as overrides:" in text
    lines = out.read_text().splitlines()
    assert lines[0].startswith("trainer.separated_node_tasks=[[")
    assert all(f"'{x}'" in text for x in lines)


@pytest.mark.parametrize("make, message", [
    (lambda d: None, "no such file"),
    (lambda d: (d / "timeline.json").write_text("{not json"), "not a megarl timeline"),
    (lambda d: write_chrome_trace(simulate(Pipeline(1, 4), {"generate": 1.0}),
                                  d / "timeline.json"), "no device count"),
])
def test_plan_errors_name_the_file(tmp_path, capsys, make, message):
    make(tmp_path)
    assert main(["plan", "--config", QWEN2, "--from-run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(tmp_path) in err, err


def test_plan_refuses_what_it_cannot_price(tmp_path, capsys):
    run = _trace(tmp_path).parent
    assert main(["plan", "--config", QWEN2, "--from-run", str(run),
                 "algorithm.adv_estimator=gae"]) == 2
    assert "algorithm.adv_estimator=gae" in capsys.readouterr().err
    assert main(["plan", "--config", QWEN2, "--from-run", str(run), "--out",
                 str(tmp_path / "nowhere" / "x")]) == 2
    assert "--out" in capsys.readouterr().err
    from megarl.controller.machine import Interval

    gen_only = write_chrome_trace([Interval("generate", "generate", k, k, k + 1.0)
                                   for k in range(4)], tmp_path / "g" / "timeline.json",
                                  {"generate": 16})
    with pytest.raises(ConfigError, match="no measured time for task"):
        planner.plan(QWEN2, [], planner.measure(gen_only))
    assert json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]


def test_plan_takes_a_rollout_tp_that_fits_where_the_configs_does_not(tmp_path):
    """On one node of 8 devices with rollout TP 4, a generate group of 2 or 6 devices cannot
    hold TP-4 engines: the planner takes the smallest power of two that places and fits the
    engines there, says so in the layout and in the overrides, and the overrides load."""
    from megarl.config import load_config

    m = planner.measure(_trace(tmp_path))
    one_node = ["trainer.nnodes=1", "trainer.n_gpus_per_node=8",
                "trainer.separated_node_tasks=[[logp,actor-train,ref_logp],[generate]]",
                "trainer.separated_node_ratios=[0.5,0.5]",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=4", *LOGP4]
    # 141 GiB (an H200): at TP2 the trainer's state, its log-prob path and the dual buffer's
    # snapshot of the whole 7B model, with the reference beside it, pass 80 GiB
    ok = [c for c in planner.plan(QWEN2, one_node, m, gpu_memory_gib=141.0)
          if c.refused is None]
    retuned = [c for c in ok if c.rollout_tp is not None]
    assert retuned, [c.label() for c in ok]
    for c in retuned:
        gen = next(d for g, d in zip(c.groups, c.devices) if "generate" in g)
        assert gen % 4 and gen % c.rollout_tp == 0
        assert f"(rollout TP {c.rollout_tp})" in c.label()
        cfg = load_config(QWEN2, [*one_node, *c.overrides()])
        assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == c.rollout_tp
    assert planner._rollout_tps(4, 8) == [4, 1, 2, 8]
    assert planner._rollout_tps(16, 8) == [16, 1, 2, 4, 8]


def test_plan_knows_context_parallelism(tmp_path):
    """With the actor at CP2 every layout the planner accepts gives the actor's groups (its
    trainer, a logp replica) an even number of devices; the others are refused naming
    context_parallel_size (the memory side: test_dryrun.py's CP test)."""
    m = planner.measure(_trace(tmp_path))
    cp2 = ["trainer.nnodes=1", "trainer.n_gpus_per_node=4",
           "trainer.separated_node_tasks=[[logp,actor-train,ref_logp],[generate]]",
           "trainer.separated_node_ratios=[0.5,0.5]",
           *(f"actor_rollout_ref.{s}.megatron.tensor_model_parallel_size=1"
             for s in ("actor", "ref")),
           "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
           "actor_rollout_ref.actor.megatron.context_parallel_size=2", *LOGP4]
    cands = planner.plan(QWEN2, cp2, m, gpu_memory_gib=141.0, aheads=[2])
    ok = [c for c in cands if c.refused is None]
    assert ok
    for c in ok:
        for g, d in zip(c.groups, c.devices):
            if {"actor-train", "logp"} & set(g):
                assert d % 2 == 0, c.label()
    assert any("context_parallel_size=2" in (c.refused or "") for c in cands)
