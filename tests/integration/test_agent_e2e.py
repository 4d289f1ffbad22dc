"""`configs/agent_tool_solve.yaml` end to end, short: the agent loop in a real run.

A real run (Ray, Megatron, the embedded engine, the tool workers), as a user starts it on a
fresh machine: the run makes its own tiny model (with the tool markers as special tokens) and
its data. In its first 60 steps the random model learns the first thing the task pays for,
writing a tool call (its keys are still mostly wrong, so the tool answers errors), and the run
leaves what a user inspects: the per-step tool metrics in TensorBoard, the trajectory dumps,
the tool row on the timeline. The whole task (exact answers through the tool) takes some 550
steps when it succeeds; that run is measured by hand, not here (docs/agents.md).
"""
import json

from launch_helpers import ROOT
from test_learns_task import validations
from test_train_e2e import megarl, scalars

STEPS = 60


def test_agent_run_learns_to_call_the_tool_and_leaves_its_record(tmp_path):
    out = megarl("train", [
        "--config", str(ROOT / "configs" / "agent_tool_solve.yaml"),
        f"actor_rollout_ref.model.path={tmp_path / 'tiny-tools'}",
        f"data.train_files={tmp_path / 'data' / 'train.jsonl'}",
        f"data.val_files={tmp_path / 'data' / 'val.jsonl'}",
        f"trainer.default_local_dir={tmp_path / 'runs'}", "trainer.experiment_name=t",
        f"trainer.total_training_steps={STEPS}", "trainer.test_freq=30",
        "trainer.logger=[console,tensorboard]"])
    val = validations(out)
    first, last = val[0], val[STEPS]
    assert sorted(val) == [0, 30, STEPS], sorted(val)
    # before training: the random model writes no call; after 60 steps it calls every time
    assert first["val/exact_frac"] <= 0.1 and first["val/tool_calls_mean"] == 0, first
    assert last["val/tool_calls_mean"] >= 0.8, (first, last, out[-3000:])
    calls = scalars(tmp_path / "runs", "rollout/tool_calls_mean")
    assert sorted(calls) == list(range(1, STEPS + 1))
    assert sum(calls[s] for s in range(1, 11)) / 10 < 0.5 <= calls[STEPS]
    reward = scalars(tmp_path / "runs", "reward/mean")
    assert sum(reward[s] for s in range(STEPS - 9, STEPS + 1)) > \
        sum(reward[s] for s in range(1, 11))
    # every call went through the tool workers; bad keys are answered, counted, not fatal
    tool_calls = scalars(tmp_path / "runs", "tool/calls")
    assert sum(tool_calls.values()) > 0
    assert sum(scalars(tmp_path / "runs", "rollout/tool_errors").values()) > 0
    assert sorted(scalars(tmp_path / "runs", "rollout/turns_mean")) == sorted(calls)
    run = tmp_path / "runs" / "megarl" / "t"
    dump = json.loads((run / "trajectories" / f"step_{STEPS - 1}.json").read_text())
    segs = dump[0]["segments"]
    assert [s["role"] for s in segs][:2] == ["model", "appended"], dump[0]
    assert dump[0]["calls"] and all(len(s["ids"]) == s["end"] - s["start"] for s in segs)
    trace = json.loads((run / "timeline.json").read_text())["traceEvents"]
    rows = {e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert "tools" in rows and any(e.get("cat") == "tool" for e in trace)
