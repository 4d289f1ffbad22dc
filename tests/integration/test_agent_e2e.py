"""`configs/agent_tool_solve.yaml` end to end: a tiny random model learns to use a tool.

A real run (Ray, Megatron, the embedded engine, the tool workers), as a user starts it on a
fresh machine: the run makes its own tiny model (with the tool markers as special tokens) and
its data. The answer to "Look up K" is in a table drawn per prompt that only the `lookup`
tool reads, so greedy validation exact-match accuracy above chance is tool use: it starts at
0 and must end at 0.8 or more, with a tool call in (nearly) every validation sample. The run
also leaves what a user inspects: the per-step tool metrics in TensorBoard, the trajectory
dumps, and the tool row on the timeline.
"""
import json

from launch_helpers import ROOT
from test_learns_task import validations
from test_train_e2e import megarl, scalars


def test_agent_task_learns_to_call_the_tool_and_answer(tmp_path):
    out = megarl("train", [
        "--config", str(ROOT / "configs" / "agent_tool_solve.yaml"),
        f"actor_rollout_ref.model.path={tmp_path / 'tiny-tools'}",
        f"data.train_files={tmp_path / 'data' / 'train.jsonl'}",
        f"data.val_files={tmp_path / 'data' / 'val.jsonl'}",
        f"trainer.default_local_dir={tmp_path / 'runs'}", "trainer.experiment_name=t",
        "trainer.logger=[console,tensorboard]"])
    val = validations(out)
    first, last = val[min(val)], val[max(val)]
    assert min(val) == 0 and max(val) > 0, sorted(val)
    assert first["val/exact_frac"] <= 0.1 and first["val/tool_calls_mean"] <= 0.1, first
    assert last["val/exact_frac"] >= 0.8, (first, last, out[-3000:])
    assert last["val/tool_calls_mean"] >= 0.9 and last["val/turns_mean"] >= 1.9, last
    assert last["val/eos_frac"] >= 0.8, last
    # per-step tool metrics, and every call answered by the end
    calls = scalars(tmp_path / "runs", "rollout/tool_calls_mean")
    steps = sorted(calls)
    assert calls[steps[0]] < 0.5 <= calls[steps[-1]]
    assert sorted(scalars(tmp_path / "runs", "rollout/turns_mean")) == steps
    assert scalars(tmp_path / "runs", "tool/calls")[steps[-1]] > 0
    run = tmp_path / "runs" / "megarl" / "t"
    dump = json.loads((run / "trajectories" / f"step_{steps[-1] - 1}.json").read_text())
    roles = [seg["role"] for seg in dump[0]["segments"]]
    assert roles[:2] == ["model", "appended"], dump[0]
    trace = json.loads((run / "timeline.json").read_text())["traceEvents"]
    rows = {e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert "tools" in rows and any(e.get("cat") == "tool" for e in trace)
