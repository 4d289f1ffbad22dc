"""`configs/agent_tool_solve.yaml` end to end: the agent loop in a real run learns its task.

A real run (Ray, Megatron, the embedded engine, the tool workers), as a user starts it on a
fresh machine: the run makes its own tiny model (with the tool markers as special tokens) and
its data. The random model cannot know the answers; within 200 steps (some 1.5 minutes here)
it learns to call the lookup tool for most prompts, and its reward (for calling with the key
copied from the prompt, then repeating the tool's answer and stopping) rises. The run also
leaves what a user inspects: the per-step tool metrics in TensorBoard, the trajectory dumps,
the tool row on the timeline.
"""
import json

from launch_helpers import ROOT
from test_learns_task import validations
from test_train_e2e import megarl, scalars

STEPS = 200


def test_agent_run_learns_to_use_the_tool_and_leaves_its_record(tmp_path):
    out = megarl("train", [
        "--config", str(ROOT / "configs" / "agent_tool_solve.yaml"),
        f"actor_rollout_ref.model.path={tmp_path / 'tiny-tools'}",
        f"data.train_files={tmp_path / 'data' / 'train.jsonl'}",
        f"data.val_files={tmp_path / 'data' / 'val.jsonl'}",
        f"trainer.default_local_dir={tmp_path / 'runs'}", "trainer.experiment_name=t",
        f"trainer.total_training_steps={STEPS}", "trainer.test_freq=50",
        "trainer.logger=[console,tensorboard]"], timeout=900)
    val = validations(out)
    first = val[0]
    assert sorted(val) == list(range(0, STEPS + 1, 50)), sorted(val)
    # Before training the random model writes no call and no answer. Then it learns to call
    # the tool for most validation prompts, whose tables it never saw: every run measured had
    # >= 0.6 calls per sample at some validation by step 200 (docs/agents.md). How far it gets
    # with the answers varies from run to run (16 prompts x 8 samples: 0.25-1.0 exact-match
    # at v200 over seven seeds; with 8 x 16 before, 0.03-1.0, and one CI run fell back to 0.41
    # calls at v300), so the bounds are on calling and reward:
    assert first["val/exact_frac"] <= 0.1 and first["val/tool_calls_mean"] == 0, first
    best = max(v["val/tool_calls_mean"] for v in val.values())
    assert best >= 0.5, (val, out[-3000:])
    assert max(v["val/reward_mean"] for v in val.values()) >= first["val/reward_mean"] + 0.2, val
    calls = scalars(tmp_path / "runs", "rollout/tool_calls_mean")
    assert sorted(calls) == list(range(1, STEPS + 1))
    assert sum(calls[s] for s in range(1, 11)) / 10 < 0.1
    reward = scalars(tmp_path / "runs", "reward/mean")
    assert sum(reward[s] for s in range(STEPS - 19, STEPS + 1)) / 20 > \
        sum(reward[s] for s in range(1, 21)) / 20 + 0.2
    # every call went through the tool workers, timed and counted
    assert sum(scalars(tmp_path / "runs", "tool/calls").values()) > 0
    assert sorted(scalars(tmp_path / "runs", "rollout/tool_errors")) == sorted(calls)
    assert sorted(scalars(tmp_path / "runs", "rollout/turns_mean")) == sorted(calls)
    run = tmp_path / "runs" / "megarl" / "t"
    # a sample that called, from the dumps of the last steps: its turn (the bare key), the
    # tool's answer (appended: mask 0), its answer turn
    dumps = [json.loads((run / "trajectories" / f"step_{k}.json").read_text())[0]
             for k in range(STEPS - 20, STEPS)]
    called = [d for d in dumps if d["calls"]]
    assert called, dumps[-1]
    segs = called[-1]["segments"]
    assert [s["role"] for s in segs] == ["model", "appended", "model"], called[-1]
    assert all(len(s["ids"]) == s["end"] - s["start"] for s in segs)
    trace = json.loads((run / "timeline.json").read_text())["traceEvents"]
    rows = {e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert "tools" in rows and any(e.get("cat") == "tool" for e in trace)
